"""A dependency-free progress indicator for long conversions."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

logger = logging.getLogger(__name__)


class Progress:
    """A redrawn line on stderr when it is a terminal, else a log line every 10%."""

    def __init__(self, total: int, description: str) -> None:
        self.total = total
        self.description = description
        self.done = 0
        self._interactive = sys.stderr.isatty()
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._last_logged_tenth = 0

    def update(self, count: int = 1) -> None:
        self.done += count
        if self._interactive:
            now = time.monotonic()
            if now - self._last_draw >= 0.2 or self.done >= self.total:
                self._last_draw = now
                sys.stderr.write(f"\r{self._status()}")
                sys.stderr.flush()
        elif self.total:
            tenth = self.done * 10 // self.total
            if tenth > self._last_logged_tenth:
                self._last_logged_tenth = tenth
                logger.info("%s", self._status())

    def _status(self) -> str:
        percent = 100 * self.done // self.total if self.total else 100
        rate = self.done / max(time.monotonic() - self._started, 1e-9)
        return f"{self.description}: {self.done}/{self.total} ({percent}%, {rate:.0f}/s)"

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._interactive and self._last_draw:
            sys.stderr.write("\n")
            sys.stderr.flush()

"""Errors that end a run with a one-line message instead of a traceback: the one way every CLI prints them."""

from __future__ import annotations

import argparse
import sys

from raytrain_ddp.redact import redact

EXIT_BAD_INPUT = 2  # bad input or a request the cluster cannot hold: nothing was started


class ConfigError(ValueError):
    """Bad user input: a flag, a config file, a dataset, a cluster request.

    Raised on the driver before any Ray worker starts; the CLI prints the
    message as one line and exits with code 2.
    """


class RunTakenOver(Exception):
    """Another driver took this run directory's lock over (this one hung past the stale limit): this driver
    stopped its run and writes nothing more there. The CLI prints the message as one line and exits with 1."""


def plural(count: int, noun: str) -> str:
    """'1 worker', '2 workers', '0 epochs': a count with the noun agreeing (every message says counts this way)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (pyarrow messages span several), credentials masked."""
    return redact(" ".join(str(exc).split())) or type(exc).__name__


def first_line(exc: BaseException) -> str:
    """An exception's first line (and the next, where the first only introduces it with a colon), control
    characters escaped: what it says, without what others appended (Ray Data adds its retry advice below)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return redact("".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text))


def headline(exc: BaseException) -> str:
    """`Type: first line`, the one way a failure from inside a run (a worker, a data task) is shown."""
    line = first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


class DataReadError(Exception):
    """Part of the data could not be read: `where` names it (a file's row group), `cause` is the reader's error.

    `cause` is kept through pickling (unlike __cause__, which Ray drops between processes), so the driver
    still sees the reader's error and its type. `corrupt`: the bytes themselves are bad (a read of them fails
    the same way again), not the storage that serves them.
    """

    def __init__(self, where: str, cause: BaseException, corrupt: bool):
        super().__init__(f"{where}: {headline(cause)}")
        self.where, self.cause, self.corrupt = where, cause, corrupt

    def __reduce__(self):
        return type(self), (self.where, self.cause, self.corrupt)


def bad_input(err: BaseException) -> int:
    """Print a bad-input error as the one line every CLI prints, `error: ...`; return the exit code for it."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return EXIT_BAD_INPUT


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2."""

    def error(self, message: str):  # type: ignore[override]  # exits, as argparse's does
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")

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


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (pyarrow messages span several), credentials masked."""
    return redact(" ".join(str(exc).split())) or type(exc).__name__


def bad_input(err: BaseException) -> int:
    """Print a bad-input error as the one line every CLI prints, `error: ...`; return the exit code for it."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return EXIT_BAD_INPUT


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2."""

    def error(self, message: str):  # type: ignore[override]  # exits, as argparse's does
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")

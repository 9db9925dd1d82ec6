"""The command: `python -m raytrain_ddp.report RUN_DIR` and `raytrain-ddp report RUN_DIR`."""

from __future__ import annotations

import argparse
import logging
import sys

from raytrain_ddp.errors import OneLineErrorParser, bad_input
from raytrain_ddp.report.page import write_report
from raytrain_ddp.report.records import ReportError


def main(argv: list[str] | None = None, prog: str = "python -m raytrain_ddp.report") -> int:
    """prog: the command's name in --help (`raytrain-ddp report` calls this too)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Write RUN_DIR/report/index.html (summary, workers, epochs, "
        "configuration and plots) and print its path.",
        epilog="examples:\n  %(prog)s runs/NAME\n  xdg-open $(%(prog)s runs/NAME)   # and open it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory: STORAGE_PATH/NAME")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is read and written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s", stream=sys.stderr)
    try:
        index = write_report(args.run_dir)
    except ReportError as err:
        return bad_input(err)
    except OSError as err:  # e.g. a read-only run directory
        sys.stderr.write(f"error: cannot write the report: {err}\n")
        return 1
    print(index)  # the CLI's designed output: the page's path, for scripts and `xdg-open $(...)`
    return 0

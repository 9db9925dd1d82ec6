"""The run report: plots and one self-contained HTML page for a run directory.

    python -m raytrain_ddp.report runs/NAME        # prints runs/NAME/report/index.html

:func:`write_report` reads what the trainer left in ``RUN_DIR`` (``summary.json``,
``metrics.jsonl``, ``config.toml``) and writes ``RUN_DIR/report/``: one PNG per
plot and ``index.html`` with the same plots embedded, so the page can be
copied or mailed on its own. Every section is optional: a field the run did
not record leaves out its plot or column; a failed run, or one still running,
gets a report that says so.

``records`` reads the run directory, ``plots`` draws, ``page`` writes the HTML page and RUN_DIR/report/,
``cli`` is the command.
"""

from raytrain_ddp.report.cli import main
from raytrain_ddp.report.page import INDEX, REPORT_DIR, render_html, write_report
from raytrain_ddp.report.plots import ALL_PLOT_FILES, MANY_RANKS, Plot, make_plots
from raytrain_ddp.report.records import KNOWN_RANK_KEYS, RANK_FIELDS, RankField, ReportError, Run, load_run

__all__ = [
    "ALL_PLOT_FILES",
    "INDEX",
    "KNOWN_RANK_KEYS",
    "MANY_RANKS",
    "RANK_FIELDS",
    "REPORT_DIR",
    "Plot",
    "RankField",
    "ReportError",
    "Run",
    "load_run",
    "main",
    "make_plots",
    "render_html",
    "write_report",
]

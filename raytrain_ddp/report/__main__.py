"""`python -m raytrain_ddp.report RUN_DIR`: see cli.py."""

from raytrain_ddp.report.cli import main

raise SystemExit(main())

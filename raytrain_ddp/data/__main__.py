"""`python -m raytrain_ddp.data`: see cli.py."""

from raytrain_ddp.data.cli import main

raise SystemExit(main())

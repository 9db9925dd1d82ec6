"""`python -m raytrain_ddp COMMAND`: the `raytrain-ddp` command (see cli.py)."""

import sys

from raytrain_ddp.cli import main

sys.exit(main())

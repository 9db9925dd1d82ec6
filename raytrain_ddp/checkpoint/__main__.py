"""`python -m raytrain_ddp.checkpoint COMMAND`: raytrain_ddp/checkpoint/cli.py."""

import sys

from raytrain_ddp.checkpoint.cli import main

sys.exit(main())

"""Imported first by the scripts in bench/ that run as files: puts the repo root on sys.path."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

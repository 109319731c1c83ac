"""`python -m kda_witness`: the CLI (see cli.py)."""

import sys

from .cli import main

sys.exit(main())

#!/usr/bin/env python3
"""Entry point: `python bench-competitive/run.py [--quick] [--brokers ...] [--out DIR]`.

See METHODOLOGY.md for what is measured and why, and `competitive/cli.py` for options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from competitive.cli import main

if __name__ == "__main__":
    sys.exit(main())

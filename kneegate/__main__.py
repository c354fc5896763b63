"""`python -m kneegate` is `kneegate`."""

from __future__ import annotations

import sys

from kneegate.cli import main

if __name__ == "__main__":
    sys.exit(main())

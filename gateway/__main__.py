"""`python -m gateway` is `kneegate`."""

from __future__ import annotations

import sys

from gateway.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m kneegate.sim ...` is `kneegate simulate ...`: the command is kneegate.sim.cli."""

from __future__ import annotations

from kneegate.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

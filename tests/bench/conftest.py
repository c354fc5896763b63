"""The emulator on a real socket (tests/helpers/emulator.py)."""

from helpers.emulator import emulator

__all__ = ["emulator"]

"""The docstrings of the controllers and the admission core hold the contract.

What a part does, its formula and the reason in a sentence or two; the seeds, the scenario
ratios and what was tried go to docs/ (docs/design/, docs/experiments/, docs/benchmarks.md),
and a docstring points there. This keeps the lab notebook out of the code (issue 45).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = [ROOT / "kneegate" / "controllers", ROOT / "kneegate" / "admission"]
MODULES = sorted(p for part in PARTS for p in part.rglob("*.py"))

# a seed number, a ratio to the oracle, a before -> after figure
MEASUREMENT = re.compile(r"\bseeds? \d|\bof the oracle\b|\d\.\d{2,} -> \d")


def measurements(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node) or ""
            name = getattr(node, "name", "<module>")
            found += [f"{name}: {m.group(0)!r}" for m in MEASUREMENT.finditer(doc)]
    return found


@pytest.mark.parametrize("module", MODULES, ids=[str(m.relative_to(ROOT)) for m in MODULES])
def test_no_docstring_reports_seeds_or_ratios(module: Path) -> None:
    assert measurements(module.read_text()) == []


def test_the_check_catches_what_it_means_to() -> None:
    source = '''"""Holds the knee.

    noisy-gentle-3x at seed 7: 0.915 -> 0.957 of the oracle."""

def f() -> None:
    """Over seeds 1-108."""
'''
    assert measurements(source) == [
        "<module>: 'seed 7'",
        "<module>: '0.915 -> 0'",
        "<module>: 'of the oracle'",
        "f: 'seeds 1'",
    ]
    assert measurements('"""limit = min(headroom x knee, ceiling) x share"""') == []

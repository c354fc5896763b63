"""Stop early, with the command that fixes it, when pytest runs outside kneegate's environment.

Without this, a `pytest` from an interpreter that lacks the test extras fails in a dozen
collection errors about missing modules. The requirements are read from pyproject.toml (the
runtime dependencies and the `test` extra, with the extras it includes) and from
bench/pyproject.toml (the load tools, kneegate-bench, which the tests drive too), so this file
never needs a list of its own.
"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent
# the distributions the tests run against: kneegate with its test extra, and its load tools
PROJECTS = [ROOT / "pyproject.toml", ROOT / "bench" / "pyproject.toml"]
# the README's test line (tests/test_docs.py holds them equal)
INSTALL = ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' -e ./bench "
           "&& .venv/bin/pytest -q")


def _requirements(project: dict[str, Any]) -> list[str]:
    name = project["name"]
    extras = project.get("optional-dependencies", {})
    reqs, todo, seen = list(project.get("dependencies", [])), ["test"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for req in extras.get(extra, []):
            own = re.fullmatch(rf"{re.escape(name)}\[([\w,\s-]+)\]", req)
            if own:  # "kneegate[plots]": an extra that includes another
                todo += [e.strip() for e in own.group(1).split(",") if e.strip() not in seen]
            else:
                reqs.append(req)
    return reqs


def _missing() -> list[str]:
    missing = []
    for path in PROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        missing += _absent([project["name"], *_requirements(project)])
    return missing


def _absent(reqs: list[str]) -> list[str]:
    missing = []
    for req in reqs:
        dist = re.match(r"[A-Za-z0-9_.-]+", req)
        if dist is None:
            continue
        try:
            version(dist.group(0))
        except PackageNotFoundError:
            missing.append(dist.group(0))
    return missing


def pytest_configure(config: pytest.Config) -> None:
    missing = _missing()
    if missing:
        raise pytest.UsageError(
            f"this Python lacks kneegate's test dependencies ({', '.join(missing)}); "
            f"install them and run the tests in that environment:\n    {INSTALL}"
        )


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio, as kneegate does (tests/gateway and tests/e2e pick
    uvloop's loop). anyio would also run them on trio when it is installed (selenium brings
    it)."""
    return "asyncio"

"""Tests share through tests/helpers, never by importing one another.

`from test_proxy import ...` resolves only when pytest happened to put test_proxy's folder on
the path first (it does so per collected folder), so such a test fails alone; what tests share
lives in tests/helpers (on the path by `pythonpath`), under public names.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_tests(path: Path, root: Path = TESTS) -> list[str]:
    """Each import in `path` of a test module (`test_*`, at any depth of the name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                  if any(part.startswith("test_") for part in n.split("."))]
    return found


def test_no_test_module_imports_another() -> None:
    found = [hit for p in sorted(TESTS.rglob("*.py")) for hit in imports_of_tests(p)]
    assert found == [], "move what they share into tests/helpers"


def test_the_check_sees_a_test_module_imported(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(
        "import json\nfrom test_proxy import Rig\nfrom helpers.rig import serve_rig\n"
        "def f():\n    import e2e.test_cli\n")
    assert imports_of_tests(tmp_path / "test_a.py", tmp_path) == [
        "test_a.py:2: test_proxy", "test_a.py:5: e2e.test_cli"]

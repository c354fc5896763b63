"""kneegate's floors only point down: controllers <- admission <- gateway <- benchmarks <- cli.

Read from the source with `ast`, nothing imported: every `import`, `from … import` (at the
top of a module or inside a function, relative or absolute) and every
`importlib.import_module("…")` with a literal name, in every module under kneegate/. A
module may import its own floor and the floors below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kneegate"

# the first name under kneegate. -> its floor; higher floors may import lower ones
FLOORS = {
    "controllers": 0,  # pure limit algorithms
    "admission": 1,  # the pure admission core
    "gateway": 2,  # the proxy's I/O
    "benchmarks": 3,  # the emulator and the load tools
    "cli": 4,  # the top floor: commands, the demo, the embedded engine
    "embedded": 4,
    "__main__": 4,
    "__init__": 4,  # kneegate/__init__.py: a docstring
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a module imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            if _floor(base) is not None:
                found.append((node.lineno, base))
            else:  # `from kneegate import gateway` imports kneegate.gateway
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _floor(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kneegate" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


def violations(root: Path) -> list[str]:
    """Each import under `root` (a kneegate/ folder) that points up a floor."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        own = _floor(module) or path.relative_to(root).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text(), str(path))
        for line, name in _imported(tree, module, path.name == "__init__.py"):
            target = _floor(name)
            if target is not None and FLOORS[target] > FLOORS[own]:
                found.append(f"{path.relative_to(root.parent)}:{line}: {own} imports {name}")
    return found


def test_every_part_of_the_package_has_a_floor() -> None:
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts <= set(FLOORS), f"place {sorted(parts - set(FLOORS))} in FLOORS"


def test_the_floors_only_point_down() -> None:
    assert violations(PACKAGE) == []


def test_the_check_sees_an_import_up_a_floor(tmp_path: Path) -> None:
    root = tmp_path / "kneegate"
    files = {
        "controllers/__init__.py": "",
        "controllers/aimd.py": "from kneegate.admission.queue import AdmissionQueue\n",
        "controllers/base.py": "import math\nfrom . import aimd\n",  # its own floor: fine
        "admission/__init__.py": "",
        "admission/queue.py": "from kneegate.controllers.base import Sample\n"
                              "def f():\n    from ..gateway import app\n",
        "gateway/__init__.py": "from kneegate import benchmarks\n",
        "gateway/app.py": "import importlib\nimportlib.import_module('kneegate.cli')\n",
        "benchmarks/__init__.py": "from kneegate.gateway.app import build_app\n",
        "benchmarks/tool.py": "from kneegate.embedded import emulator_app\n",
        "cli.py": "import kneegate.benchmarks.simulate\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "kneegate/admission/queue.py:3: admission imports kneegate.gateway",
        "kneegate/benchmarks/tool.py:1: benchmarks imports kneegate.embedded",
        "kneegate/controllers/aimd.py:1: controllers imports kneegate.admission.queue",
        "kneegate/gateway/__init__.py:1: gateway imports kneegate.benchmarks",
        "kneegate/gateway/app.py:2: gateway imports kneegate.cli",
    ]


@pytest.mark.parametrize("floor", ["controllers", "admission", "gateway", "benchmarks"])
def test_each_floor_is_a_real_folder(floor: str) -> None:
    folder = PACKAGE / floor
    assert folder.is_dir() and not folder.is_symlink() and (folder / "__init__.py").exists()

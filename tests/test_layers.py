"""kneegate's floors only point down: controllers <- admission <- gateway <- emulator <- sim
<- cli, embedded; and the load tools, kneegate_bench (bench/, the kneegate-bench
distribution), stand above them all.

Read from the source with `ast`, nothing imported: every `import`, `from … import` (at the
top of a module or inside a function, relative or absolute) and every
`importlib.import_module("…")` with a literal name, in every module under kneegate/ and
bench/kneegate_bench/. A module may import its own floor and the floors below it, never one
above. The one way up: `kneegate demo` and `kneegate sweep` run load tools, so the CLI may
load the modules `LAZY_UP` names, only when a command asks (inside a function, or a name
handed to a loader); no other module of kneegate names kneegate_bench at all, not even as a
string a loader could import.

Inside the gateway, its wings (config/, http/, upstream/, observability/, server/) point only
the way `WINGS` draws them; no module of either package imports one that imports it back,
however far round and however lazily (in a function, under TYPE_CHECKING); and no module
grows past `MAX_LINES`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kneegate"
BENCH = ROOT / "bench" / "kneegate_bench"

# a module's part (the first name under kneegate., or kneegate_bench) -> its floor; higher
# floors may import lower ones
FLOORS = {
    "controllers": 0,  # pure limit algorithms
    "admission": 1,  # the pure admission core
    "gateway": 2,  # the proxy's I/O
    "emulator": 3,  # the vLLM emulator (served by the gateway's server code)
    "sim": 4,  # the simulator: the admission core and the emulator's core in virtual time
    "cli": 5,  # kneegate's top floor: commands, the embedded engine
    "embedded": 5,
    "__main__": 5,
    "__init__": 5,  # kneegate/__init__.py: a docstring
    "kneegate_bench": 6,  # the load tools, a distribution of their own: above all of kneegate
}
# what a module may load from a floor above it, only when asked: the CLI runs these load
# tools for `kneegate demo` and `kneegate sweep`, and names their package to say how to
# install it when it is missing
LAZY_UP = {"kneegate.cli": {"kneegate_bench", "kneegate_bench.demo", "kneegate_bench.sweep"}}
BENCH_NAME = re.compile(r"kneegate_bench(?:\.\w+)*")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of what `from … import` imports from, in `module`."""
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join([*here, base] if base else here)
    return base


def _in_functions(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside a function: run when it is called, not at import."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for inner in ast.walk(node) if inner is not node}


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, bool]]:
    """(line, dotted name, lazy) of everything a module imports, and of every string that
    names a module of kneegate_bench (a name for a loader); lazy: not at import time."""
    found = []
    lazy = _in_functions(tree)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from(node, module, is_package)
            # `from kneegate import gateway` imports kneegate.gateway
            names = [base] if _part(base) is not None else [f"{base}.{a.name}"
                                                            for a in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            names = [node.args[0].value]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and BENCH_NAME.fullmatch(node.value)):
            found.append((node.lineno, node.value, True))  # loaded, if at all, when called
        found += [(node.lineno, name, id(node) in lazy) for name in names]
    return found


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "kneegate_bench":
        return "kneegate_bench"
    if parts[0] != "kneegate" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


def violations(root: Path) -> list[str]:
    """Each import under `root` (a kneegate/ or kneegate_bench/ folder) that points up a
    floor, but for what `LAZY_UP` lets a module load when asked."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        own = _part(module) or path.relative_to(root).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text(), str(path))
        for line, name, lazy in _imported(tree, module, path.name == "__init__.py"):
            target = _part(name)
            if target is None or FLOORS[target] <= FLOORS[own]:
                continue
            if not (lazy and name in LAZY_UP.get(module, set())):
                found.append(f"{path.relative_to(root.parent)}:{line}: {own} imports {name}")
    return found


def test_every_part_of_the_package_has_a_floor() -> None:
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts <= set(FLOORS), f"place {sorted(parts - set(FLOORS))} in FLOORS"


@pytest.mark.parametrize("root", [PACKAGE, BENCH], ids=["kneegate", "kneegate_bench"])
def test_the_floors_only_point_down(root: Path) -> None:
    assert violations(root) == []


def test_the_load_tools_are_loaded_when_asked_and_named_nowhere_else() -> None:
    loads = sorted({name for p in sorted(PACKAGE.rglob("*.py"))
                    for _, name, _ in _imported(ast.parse(p.read_text()), _module_name(
                        p, PACKAGE), p.name == "__init__.py")
                    if _part(name) == "kneegate_bench"})
    assert loads == sorted(LAZY_UP["kneegate.cli"])  # none is stale, none is new


def test_the_check_sees_an_import_up_a_floor(tmp_path: Path) -> None:
    root = tmp_path / "kneegate"
    files = {
        "controllers/__init__.py": "",
        "controllers/aimd.py": "from kneegate.admission.queue import AdmissionQueue\n",
        "controllers/base.py": "import math\nfrom . import aimd\n",  # its own floor: fine
        "admission/__init__.py": "",
        "admission/queue.py": "from kneegate.controllers.base import Sample\n"
                              "def f():\n    from ..gateway import app\n",
        "gateway/__init__.py": "from kneegate import emulator\n",
        "gateway/app.py": "import importlib\nimportlib.import_module('kneegate.cli')\n",
        "emulator/__init__.py": "from kneegate.gateway.app import build_app\n",
        "emulator/server.py": "from kneegate.sim.loop import run\n",
        "sim/__init__.py": "def f():\n    import kneegate_bench.sweep\n",  # lazy, not cli
        "sim/cli.py": "from kneegate.embedded import emulator_app\nTOOLS = ['kneegate_bench']\n",
        "cli.py": "import kneegate.sim.cli\nfrom kneegate_bench.sweep import main\n"
                  "def demo():\n    from kneegate_bench.demo import run_demo\n"
                  "TOOLS = {'soak': 'kneegate_bench.soak', 'sweep': 'kneegate_bench.sweep'}\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "kneegate/admission/queue.py:3: admission imports kneegate.gateway",
        "kneegate/cli.py:2: cli imports kneegate_bench.sweep",  # at import time
        "kneegate/cli.py:5: cli imports kneegate_bench.soak",  # not one LAZY_UP names
        "kneegate/controllers/aimd.py:1: controllers imports kneegate.admission.queue",
        "kneegate/emulator/server.py:1: emulator imports kneegate.sim.loop",
        "kneegate/gateway/__init__.py:1: gateway imports kneegate.emulator",
        "kneegate/gateway/app.py:2: gateway imports kneegate.cli",
        "kneegate/sim/__init__.py:2: sim imports kneegate_bench.sweep",
        "kneegate/sim/cli.py:1: sim imports kneegate.embedded",
        "kneegate/sim/cli.py:2: sim imports kneegate_bench",
    ]


@pytest.mark.parametrize("floor", ["controllers", "admission", "gateway", "emulator", "sim"])
def test_each_floor_is_a_real_folder(floor: str) -> None:
    folder = PACKAGE / floor
    assert folder.is_dir() and not folder.is_symlink() and (folder / "__init__.py").exists()


# --- inside the gateway: the wings, no cycles, no module over MAX_LINES ---------------------

# the gateway's parts: a module's wing is its folder under gateway/ (errors and types are the
# base every part may import; the other modules at gateway/'s top are the centre)
WINGS = {
    "base": set(),  # errors, types
    "config": {"base"},  # the YAML file's models, reading and watching it
    "http": {"base", "config"},  # the client-facing protocol: wire, limits, body writer
    "upstream": {"base", "config"},  # the client to engines, the pool, probes, telemetry
    "observability": {"base", "config", "upstream"},  # metrics, history, live page, logs
    "centre": {"base", "config", "http", "upstream", "observability"},  # app, proxy, gate…
    "server": {"base", "config", "http", "upstream", "observability", "centre"},  # the top
}
BASE = {"errors", "types"}

MAX_LINES = 400


def module_graph(*roots: Path) -> dict[str, set[str]]:
    """module -> the modules of the packages at `roots` it imports (at the top, in a function
    or under TYPE_CHECKING alike): `from a.b import c` names a.b.c when that is a module, else
    a.b."""
    paths = {_module_name(p, root): p for root in roots for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from(node, module, is_package)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                         for a in node.names]
            else:
                continue
            edges.update(n for n in names if n in paths and n != module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected part of more than one module
    (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _wing(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["kneegate", "gateway"] or len(parts) < 3:
        return None
    if len(parts) > 3 or parts[2] in WINGS:  # a folder of gateway/
        return parts[2]
    return "base" if parts[2] in BASE else "centre"


def wing_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import inside gateway/ from one wing into another it may not point at."""
    found = []
    for module, targets in sorted(graph.items()):
        own = _wing(module)
        for target in sorted(targets):
            wing = _wing(target)
            if own is not None and wing is not None and wing != own and wing not in WINGS[own]:
                found.append(f"{module} ({own}) imports {target} ({wing})")
    return found


def test_every_gateway_folder_is_a_wing() -> None:
    folders = {p.name for p in (PACKAGE / "gateway").iterdir() if (p / "__init__.py").exists()}
    assert folders <= set(WINGS), f"place {sorted(folders - set(WINGS))} in WINGS"


def test_the_gateway_wings_point_only_where_drawn() -> None:
    assert wing_violations(module_graph(PACKAGE)) == []


def test_no_import_cycles() -> None:
    assert cycles(module_graph(PACKAGE, BENCH)) == []


def test_the_checks_see_a_cycle_and_a_wing_pointing_back(tmp_path: Path) -> None:
    root = tmp_path / "kneegate"
    files = {
        "gateway/__init__.py": "",
        "gateway/app.py": "from kneegate.gateway.endpoints import routes\n",
        "gateway/endpoints.py": "def f():\n    from kneegate.gateway import app\n",
        "gateway/errors.py": "from kneegate.gateway.types import Clock\n",
        "gateway/types.py": "",
        "gateway/config/__init__.py": "",
        "gateway/config/read.py": "from kneegate.gateway.errors import ConfigError\n",
        "gateway/http/__init__.py": "",
        "gateway/http/wire.py": "from ..upstream.client import UpstreamClient\n",
        "gateway/upstream/__init__.py": "",
        "gateway/upstream/client.py": "from kneegate.gateway.config import read\n",
        "gateway/upstream/pool.py": "from . import probe\n",
        "gateway/upstream/probe.py": "from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n"
                                     "    from kneegate.gateway.upstream.pool import Pool\n",
        "gateway/observability/__init__.py": "",
        "gateway/observability/metrics.py": "from kneegate.gateway.proxy import Proxy\n",
        "gateway/proxy.py": "from kneegate.gateway.observability import metrics\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = module_graph(root)
    assert cycles(graph) == [
        ["kneegate.gateway.app", "kneegate.gateway.endpoints"],
        ["kneegate.gateway.observability.metrics", "kneegate.gateway.proxy"],
        ["kneegate.gateway.upstream.pool", "kneegate.gateway.upstream.probe"],
    ]
    assert wing_violations(graph) == [
        "kneegate.gateway.http.wire (http) imports kneegate.gateway.upstream.client (upstream)",
        "kneegate.gateway.observability.metrics (observability) imports "
        "kneegate.gateway.proxy (centre)",
    ]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_over_max_lines() -> None:
    over = {str(p.relative_to(ROOT)): _lines(p) for root in (PACKAGE, BENCH)
            for p in sorted(root.rglob("*.py")) if _lines(p) > MAX_LINES}
    assert over == {}, f"split these by responsibility (at most {MAX_LINES} lines a module)"

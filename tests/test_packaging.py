"""The two wheels, built here as a release builds them: kneegate's holds the package kneegate,
its package data and none of the load tools (no module of it imports aiohttp); kneegate-bench's
holds the load tools, kneegate_bench, and depends on this very kneegate.

`pip wheel --no-deps --no-build-isolation` with this environment's setuptools (the test
extra's): no network, about two seconds a wheel. Each source is copied first, so that no
`build/` left in the clone by an earlier build can slip a stale file into a wheel.
"""

from __future__ import annotations

import ast
import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# what each distribution is built from: its pyproject.toml, and what that names
SOURCES = {
    "kneegate": (ROOT, ["pyproject.toml", "README.md", "kneegate"]),
    "kneegate_bench": (BENCH, ["pyproject.toml", "kneegate_bench"]),
}
# the data the packages read at run time (the emulator's profiles, the simulator's scenarios
# and traces, the live page) or keep beside their tools (the recorded vLLM runs)
DATA = {
    "kneegate": ["kneegate/emulator/profiles/*.yaml", "kneegate/sim/scenarios/*.yaml",
                 "kneegate/sim/traces/*", "kneegate/gateway/observability/static/*"],
    "kneegate_bench": ["kneegate_bench/data/*.json"],
}


def _build(name: str, out: Path) -> zipfile.ZipFile:
    root, parts = SOURCES[name]
    src = out / f"src-{name}"
    for part in parts:
        if (root / part).is_dir():
            shutil.copytree(root / part, src / part,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / part, src / part)
    before = set(out.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = set(out.glob("*.whl")) - before
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, zipfile.ZipFile]:
    out = tmp_path_factory.mktemp("wheels")
    return {name: _build(name, out) for name in SOURCES}


def _top_level(wheel: zipfile.ZipFile) -> set[str]:
    return {n.split("/")[0] for n in wheel.namelist()
            if not n.split("/")[0].endswith((".dist-info", ".data"))}


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def _imports(source: str) -> set[str]:
    """The top-level names a module imports, at the top or in a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module")):
            found.add(node.args[0].value.split(".")[0])
    return found


def _expected(name: str, pattern: str) -> set[str]:
    root, _ = SOURCES[name]
    return {str(p.relative_to(root)) for p in root.glob(pattern)
            if p.is_file() and "__pycache__" not in p.parts}


def test_kneegate_holds_one_package_and_no_load_tools(wheels: dict[str, zipfile.ZipFile]) -> None:
    wheel = wheels["kneegate"]
    assert _top_level(wheel) == {"kneegate"}
    names = set(wheel.namelist())
    assert not any(n.startswith("kneegate/benchmarks/") for n in names)
    assert _expected("kneegate", "kneegate/**/*.py") <= names  # every module of the package
    clients = {n for n in names if n.endswith(".py") and "aiohttp" in _imports(
        wheel.read(n).decode())}
    assert clients == set(), "the load tools' client belongs to kneegate-bench"


def test_kneegate_ships_its_package_data(wheels: dict[str, zipfile.ZipFile]) -> None:
    names = set(wheels["kneegate"].namelist())
    for pattern in DATA["kneegate"]:
        expected = _expected("kneegate", pattern)
        assert expected and expected <= names, pattern


def test_kneegate_needs_no_aiohttp_and_has_no_bench_extra(
    wheels: dict[str, zipfile.ZipFile]
) -> None:
    meta = _metadata(wheels["kneegate"])
    assert not any(r.startswith("aiohttp") for r in meta.get_all("Requires-Dist") or [])
    assert "bench" not in (meta.get_all("Provides-Extra") or [])


def test_kneegate_bench_holds_the_load_tools(wheels: dict[str, zipfile.ZipFile]) -> None:
    wheel = wheels["kneegate_bench"]
    assert _top_level(wheel) == {"kneegate_bench"}
    names = set(wheel.namelist())
    tools = _expected("kneegate_bench", "kneegate_bench/**/*.py")
    assert {"kneegate_bench/overload.py", "kneegate_bench/sweep.py",
            "kneegate_bench/demo.py", "kneegate_bench/loadgen.py"} <= tools <= names
    for pattern in DATA["kneegate_bench"]:
        expected = _expected("kneegate_bench", pattern)
        assert expected and expected <= names, pattern


def test_kneegate_bench_depends_on_this_kneegate_and_aiohttp(
    wheels: dict[str, zipfile.ZipFile]
) -> None:
    version = _metadata(wheels["kneegate"])["Version"]
    requires = _metadata(wheels["kneegate_bench"]).get_all("Requires-Dist") or []
    assert f"kneegate=={version}" in requires  # released together, from one commit
    assert any(r.startswith("aiohttp") for r in requires)

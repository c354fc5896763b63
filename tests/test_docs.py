"""The docs point at things that exist: README.md and docs/**/*.md.

Every relative link (and its `#anchor`, by GitHub's heading slugs) resolves to a file in the
repository; every `python -m MODULE` shown in code names a module that `python -m` can run
(of kneegate or of its load tools, kneegate_bench: the tests run with both installed); every
`kneegate SUBCOMMAND …` names a subcommand, and one of the gateway's own (serve,
check-config, demo) shown with arguments parses whole, flags included; every
`python path/to/script.py` exists; the README's shell blocks run kneegate and Python from
the `.venv` its first command installs into; CI runs exactly the README's test line.
"""

from __future__ import annotations

import argparse
import ast
import importlib.machinery
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from kneegate import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXTERNAL = {"vllm"}  # other programs' modules, shown for their own environment

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
INDENTED = re.compile(r"(?:^|\n\n)((?: {4}.*\n?)+)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)
PYTHON_M = re.compile(r"(?<![\w-])python3?\s+-m\s+([\w.]+)")
PYTHON_FILE = re.compile(r"(?<![\w-])python3?\s+((?:[\w.-]+/)+[\w.-]+\.py)\b")
KNEEGATE = re.compile(r"(?<![\w/.:<>-])(?:[\w.~-]*/)*kneegate\s+([a-z][\w-]*)([^#;&|`\n]*)")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


def _prose(text: str) -> str:
    """The text without its fenced blocks (links and headings there are code, not markdown)."""
    return FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """Shell code shown in a doc: fenced shell blocks, indented blocks and inline spans."""
    shell = [body for lang, body in FENCE.findall(text) if lang in SHELL_LANGS]
    prose = _prose(text)
    spans = INLINE.findall(prose)
    indented = INDENTED.findall(INLINE.sub("", prose))
    joined = [s.replace("\\\n", " ") for s in shell + indented]
    return joined + [" ".join(span.split()) for span in spans]


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(_prose(path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(doc: Path) -> list[str]:
    prose = INLINE.sub("", _prose(doc.read_text()))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kneegate's parser has no subcommands")


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or (file and not path.is_relative_to(ROOT)):
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no such heading")
    return broken


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a package above it is missing: a name gone stale
        return None


def missing_modules(doc: Path) -> list[str]:
    missing = []
    for code in _code(doc.read_text()):
        for module in PYTHON_M.findall(code):
            if module.split(".")[0] in EXTERNAL:
                continue
            spec = _spec(module)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = _spec(f"{module}.__main__")
            if spec is None:
                missing.append(f"python -m {module}")
        missing += [f"python {s}" for s in PYTHON_FILE.findall(code) if not (ROOT / s).exists()]
    return missing


def wrong_commands(doc: Path) -> list[str]:
    subcommands = _subcommands()
    wrong = []
    for code in _code(doc.read_text()):
        for name, rest in KNEEGATE.findall(code):
            if name not in subcommands:
                wrong.append(f"kneegate {name}: no such subcommand")
            elif rest.strip() and name not in cli.PASSTHROUGH:
                # a command, not a mention; the benchmark tools parse their own flags
                argv = [name, *shlex.split(rest)]
                try:
                    cli._parser().parse_args(argv)
                except SystemExit:
                    wrong.append(f"kneegate {shlex.join(argv)}: does not parse")
    return wrong


def _ids(docs: list[Path]) -> list[str]:
    return [str(d.relative_to(ROOT)) for d in docs]


def test_the_docs_are_found() -> None:
    names = _ids(DOCS)
    assert "README.md" in names and "docs/benchmarks.md" in names, names


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_python_module_and_script_shown_exists(doc: Path) -> None:
    assert missing_modules(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_kneegate_command_shown_parses(doc: Path) -> None:
    assert wrong_commands(doc) == []


def test_the_checks_catch_what_they_mean_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# Top: the `x`'s part\n\n[a](missing.md) [b](#top-the-xs-part) [c](#nowhere) "
        "[d](https://example.com) `[e](gone.md)` `/kneegate/status` `kneegate\ncheck-config`\n\n"
        "```bash\n.venv/bin/kneegate serve --no-such-flag  # a comment\nkneegate frobnicate\n"
        "kneegate demo --load 2 && python -m kneegate_bench.no_such_tool --x \\\n  --y\n"
        "python3 -m json.tool && python tests/no_such_script.py\n```\n\n"
        "```yaml\n# not a heading\n```\n\n    python -m kneegate_bench.soak --seconds 1\n"
        "    python -m kneegate.sim --seed 7 && python -m kneegate.benchmarks.simulate\n"
    )
    assert broken_links(doc) == ["missing.md: no such file", "#nowhere: no such heading"]
    assert missing_modules(doc) == [
        "python -m kneegate_bench.no_such_tool", "python tests/no_such_script.py",
        "python -m kneegate.benchmarks.simulate",
    ]
    assert wrong_commands(doc) == [
        "kneegate serve --no-such-flag: does not parse",
        "kneegate frobnicate: no such subcommand",
    ]
    capsys.readouterr()  # argparse's complaint about the flag


# a command's first word in a shell block: at a line's start or after &&, ||, |, ; or $(
COMMAND = re.compile(
    r"(?:^|&&|\|\||[|;]|\$\()[ \t]*(kneegate|python3?)\b(?!/)[ \t]*(\S*[ \t]*\S*)", re.M)


def bare_commands(doc: Path) -> list[str]:
    """Commands in a doc's shell blocks that run `kneegate` or Python from the PATH rather
    than from the `.venv` the README installs into (`python3 -m venv` itself aside)."""
    found = []
    for lang, body in FENCE.findall(doc.read_text()):
        if lang in SHELL_LANGS:
            for name, args in COMMAND.findall(body.replace("\\\n", " ")):
                if name == "kneegate" or args != "-m venv":
                    found.append(f"{name} {args}".strip())
    return found


def test_the_readme_runs_kneegate_and_python_from_its_venv() -> None:
    # a newcomer installs into .venv (the README's first command) and pastes what follows
    assert bare_commands(ROOT / "README.md") == []


def test_bare_commands_are_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "`kneegate serve` in prose\n\n```bash\nkneegate serve --port 1\n"
        "python3 -m venv .venv && .venv/bin/kneegate demo\ncurl -s x | python3 -m json.tool\n"
        "docker build -t kneegate:1 .  # kneegate/ in a comment\n"
        "x=$(python -c 'print(1)')\n```\n\n```\nkneegate/\n  cli (`kneegate demo`)\n```\n")
    assert bare_commands(doc) == ["kneegate serve --port", "python3 -m json.tool",
                                  "python -c 'print(1)')"]


def test_the_benchmarks_reference_stays_a_reference() -> None:
    # one current table per benchmark, each with its command; earlier runs go to
    # docs/history/benchmarks.md (issue 45's bar: at most 500 lines)
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= 500, f"docs/benchmarks.md has {lines} lines: move past runs to docs/history/"


def test_the_readme_stays_short() -> None:
    # what kneegate is, the two commands, the first steps and pointers (issue 45: ~12 KB);
    # the detail lives in docs/
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes: move detail to docs/"


def _readme_commands() -> list[str]:
    """The README's first shell block: install and run the demo, install and run the tests."""
    return FENCE.findall((ROOT / "README.md").read_text())[0][1].strip().splitlines()


def test_ci_runs_exactly_the_readmes_test_line() -> None:
    demo, tests = _readme_commands()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci[0] == tests
    # and the root conftest.py names it to whoever runs pytest without the test extras
    install = next(node.value for node in ast.parse((ROOT / "conftest.py").read_text()).body
                   if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "INSTALL")
    assert ast.literal_eval(install) == tests
    # the demo and the tests both run the load tools: a distribution of their own, in bench/
    assert " -e ./bench " in demo and " -e ./bench " in tests

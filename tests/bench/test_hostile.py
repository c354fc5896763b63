"""The hostile-client benchmark end to end (real emulator, gateway and sockets), with short
windows: every case asked for prints its row, with honest completions counted on both sides
of the attack and the attack's own answers. The figures themselves are the benchmark's
business (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import ast

import pytest

from kneegate_bench.hostile import main


def _answers(row: str) -> dict[int, int]:
    """The attack's answers by status, the `{...}` a row prints."""
    return ast.literal_eval(row[row.index("{"):row.index("}") + 1])  # type: ignore[no-any-return]


def test_each_case_prints_the_honest_rate_around_its_attack_and_the_attacks_answers(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cases", "padded,models-flood", "--clients", "4", "--warmup", "2",
                 "--seconds", "2"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"padded", "models-flood"}
    for line in rows.values():
        before, during = (float(x) for x in line.split()[1:3])
        assert before > 0 and during > 0, line  # the honest users were served throughout
        assert _answers(line).get(200, 0) >= 1, line
    # the padded request is one request; the flood is many
    assert sum(_answers(rows["padded"]).values()) == 1

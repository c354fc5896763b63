"""kneegate_bench.overload: the figures, the arms, the client's rules over real sockets;
the whole
benchmark in miniature is opt-in (`pytest -m slow`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kneegate_bench.arms import _wait_idle, engine_holds, parse_arms, valve_sizes
from kneegate_bench.figures import family_ratios, per_key, round_medians, summarize
from kneegate_bench.openloop import Record, late_ticks, parse_keys, run_cell
from kneegate_bench.overload import main, parser


def test_summarize_judges_by_the_users_clock() -> None:
    def ok(ttft: float, window: int, **kw: object) -> Record:
        return Record(True, 200, 0.01, ttft, 64, window, **kw)  # type: ignore[arg-type]

    recs = [
        ok(0.5, 64, done=True, last=0.5 + 63 * 0.02),  # good; 20 ms a token
        ok(1.9, 30, done=True, last=1.9 + 63 * 0.04),  # good; 34 tokens came after the window
        ok(3.0, 64, done=True),  # late: not goodput; no last token seen: no TPOT
        Record(True, 200, 0.01, 1.0, 10, 10, error="cut"),  # good, partial
        Record(True, status=429, answer=0.004),
        Record(True, status=503, answer=0.040),
        Record(True, status=200, answer=0.01, gave_up=True),
        Record(True, error="ClientOSError"),
        Record(False, 200, 0.01, 0.7, 64, 20, done=True),  # a warm-up user's last 20 tokens
        Record(False, status=429, answer=5.0),  # not measured: not in the user figures
    ]
    s = summarize(recs, seconds=2.0, capacity_tok_s=100.0, objective=2.0)
    assert s["users"] == 8
    assert s["goodput_tok_s"] == (64 + 30 + 10 + 20) / 2
    assert s["goodput_over_capacity"] == pytest.approx(0.62)
    assert s["completed_tok_s"] == (64 + 30 + 64 + 20) / 2 and s["completed"] == 3
    assert s["rejected"] == 2 and s["rejected_by_status"] == {"429": 1, "503": 1}
    assert s["rejection_p99_ms"] == pytest.approx(39.64)
    assert s["ttft_p50_ms"] == pytest.approx(1450.0)
    assert s["tpot_p50_ms"] == pytest.approx(30.0) and s["tpot_p99_ms"] == pytest.approx(39.8)
    assert s["gave_up"] == 1 and s["errors"] == 2
    assert s["slo_goodput_tok_s"] is None  # no TPOT objective given


def test_the_slo_goodput_also_needs_the_answer_to_stream_within_its_tpot_objective() -> None:
    recs = [
        Record(True, 200, 0.01, 0.5, 64, 64, done=True, last=0.5 + 63 * 0.05),  # both met
        Record(True, 200, 0.01, 0.5, 64, 64, done=True, last=0.5 + 63 * 0.4),  # slow answer
        Record(True, 200, 0.01, 0.8, 20, 20, last=0.8 + 19 * 0.3),  # still streaming, slow
        Record(True, 200, 0.01, 0.9, 1, 1, done=True),  # one token: no TPOT to miss
        Record(True, 200, 0.01, 2.5, 64, 64, done=True, last=2.5 + 63 * 0.01),  # late
    ]
    s = summarize(recs, seconds=1.0, capacity_tok_s=100.0, objective=2.0, tpot_objective=0.1)
    assert s["goodput_tok_s"] == 64 + 64 + 20 + 1  # judged by the first token alone
    assert s["slo_goodput_tok_s"] == 64 + 1
    loose = summarize(recs, seconds=1.0, capacity_tok_s=100.0, objective=2.0,
                      tpot_objective=0.5)
    assert loose["slo_goodput_tok_s"] == loose["goodput_tok_s"]


def test_per_key_figures_follow_each_keys_measured_users() -> None:
    assert parse_keys("heavy:8,light:1") == {"heavy": 8.0, "light": 1.0}
    assert parse_keys(None) == {}

    def user(key: str, ttft: float | None, **kw: object) -> Record:
        return Record(True, 200, 0.01, ttft, 64, 64, key=key, **kw)  # type: ignore[arg-type]

    recs = [
        user("light", 0.5, done=True),
        user("light", 2.5, done=True),  # completed, but its first token came late
        user("heavy", 0.4, done=True),
        Record(True, status=429, answer=0.003, key="heavy", retry_after=True),
        Record(True, status=503, answer=0.003, key="heavy"),
        Record(False, 200, 0.01, 0.1, 64, 64, done=True, key="light"),  # not measured
    ]
    k = per_key(recs, seconds=2.0, max_tokens=64, objective=2.0)
    assert k["light"] == {"users": 2, "demand_tok_s": 64.0, "served_within_objective": 0.5,
                          "rejected": 0, "with_retry_after": 0, "reasons": {}}
    assert k["heavy"]["served_within_objective"] == pytest.approx(1 / 3)
    assert (k["heavy"]["rejected"], k["heavy"]["with_retry_after"]) == (2, 1)
    assert k["heavy"]["reasons"] == {"429": 1, "503": 1}  # no gateway's reason header: status


def test_round_medians_take_each_ratio_within_its_round() -> None:
    # the engine ran slow in round 0 and fast in round 1: every arm of a round moved with it,
    # so the ratio to the round's best valve is read within the round, then its median
    def row(arm: str, rnd: int, goodput: float, ttft_p99: float | None = 500.0) -> dict[str, Any]:
        return {"arm": arm, "load": 3.0, "round": rnd, "goodput_tok_s": goodput,
                "goodput_over_capacity": goodput / 1000, "ttft_p99_ms": ttft_p99,
                "goodput_over_direct_done": None if arm == "direct" else goodput / 100}

    rows = [row("direct", 0, 100), row("valve-512", 0, 800), row("valve-1280", 0, 700),
            row("kneegate", 0, 760, 600),
            row("direct", 1, 110), row("valve-512", 1, 1100), row("valve-1280", 1, 1200),
            row("kneegate", 1, 1080, 2600),
            row("direct", 2, 90), row("valve-512", 2, 1000), row("valve-1280", 2, 900),
            row("kneegate", 2, 850, None)]
    by_arm = {m["arm"]: m for m in round_medians(rows)}
    assert list(by_arm) == ["direct", "valve-512", "valve-1280", "kneegate"]
    k = by_arm["kneegate"]
    assert k["rounds"] == 3 and k["goodput_tok_s"] == [760, 1080, 850]
    assert k["over_best_valve"] == pytest.approx([0.95, 0.9, 0.85])
    # 0.9, where the medians' ratio (850 over the valves' median, 1,000) would read 0.85
    assert k["over_best_valve_p50"] == pytest.approx(0.9)
    assert k["goodput_p50"] == 850 and k["goodput_over_capacity_p50"] == pytest.approx(0.85)
    assert k["over_direct_p50"] == pytest.approx(8.5)
    # a round with no first token has no TTFT: the median and the worst of those that did
    assert k["ttft_p99_ms_p50"] == 1600 and k["ttft_p99_ms_max"] == 2600
    assert by_arm["direct"]["over_direct_p50"] is None
    assert by_arm["valve-1280"]["over_best_valve"] == pytest.approx([700 / 800, 1.0, 0.9])
    # without a valve arm there is no ratio to it
    alone = round_medians([row("kneegate", 0, 800), row("kneegate", 1, 900)])
    assert alone[0]["over_best_valve_p50"] is None and alone[0]["goodput_p50"] == 850


def test_a_hand_sized_arm_is_one_size_at_every_round() -> None:
    # valve-1024 wins rounds 0 and 2 by a hair, valve-2048 round 1 by much, and so has the
    # better median: the hand-sized valve. kneegate reads under the best valve of every
    # round, and over the hand-sized one in rounds 0 and 2
    goodput = {"valve-1024": [10, 30, 40], "valve-2048": [9, 60, 38], "kneegate": [9.5, 50, 39],
               "fixed-8": [8, 40, 30], "fixed-16": [12, 20, 31]}
    rows = [{"arm": arm, "load": 3.0, "round": n, "goodput_tok_s": float(g)}
            for arm, gs in goodput.items() for n, g in enumerate(gs)]
    rows.append({"arm": "kneegate", "load": 10.0, "round": 0, "goodput_tok_s": 5.0})
    hand = family_ratios(rows)
    # medians: valve-1024 30, valve-2048 38; fixed-8 30, fixed-16 20
    assert hand == {"valve": {3.0: "valve-2048"}, "fixed": {3.0: "fixed-8"}}
    k = [r for r in rows if r["arm"] == "kneegate" and r["load"] == 3.0]
    assert [r["over_best_valve"] for r in k] == pytest.approx([0.95, 50 / 60, 39 / 40])
    assert [r["over_hand_valve"] for r in k] == pytest.approx([9.5 / 9, 50 / 60, 39 / 38])
    assert [r["over_hand_fixed"] for r in k] == pytest.approx([9.5 / 8, 50 / 40, 39 / 30])
    # a load with no sized arm has nothing to be read against
    lone = rows[-1]
    assert lone["over_best_valve"] is None and lone["over_hand_valve"] is None
    assert lone["over_hand_fixed"] is None


def test_rounds_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_arms_expand_and_refuse_unknown_names() -> None:
    assert valve_sizes(2.0, 18.0, 128) == [9 * 128, 18 * 128, 36 * 128]
    names = "direct,valve,valve-640,kneegate,kneegate-w2,kneegate-fixed"
    arms = parse_arms(names, [1280, 2560], 25)
    assert [a.name for a in arms] == ["direct", "valve-1280", "valve-2560", "valve-640",
                                      "kneegate", "kneegate-w2", "kneegate-fixed"]
    assert arms[0].gateway_flags is None and arms[3].engine_flags == (
        "--max-num-queued-tokens", "640")
    assert arms[4].gateway_flags == ()  # no tuning flags
    assert arms[6].gateway_flags == ("--controller", "fixed", "--limit", "25")
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arms("direct,nginx", [], None)
    with pytest.raises(ValueError, match="needs a limit"):
        parse_arms("kneegate-fixed", [], None)


def _args(*extra: str):  # type: ignore[no-untyped-def]
    return parser().parse_args(["--warmup", "0.2", "--seconds", "1", "--give-up", "0.5",
                                "--request-timeout", "5", *extra])


def test_a_cell_on_a_shared_engine_waits_for_the_last_cells_requests_to_end(
        emulator) -> None:  # type: ignore[no-untyped-def]
    """`_wait_idle` returns once the engine runs and queues nothing, not before."""
    url, _app = emulator
    done: list[float] = []

    def one_request() -> None:
        body = json.dumps({"model": "cpu-tiny", "prompt": "x", "max_tokens": 256}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
        done.append(time.monotonic())

    worker = threading.Thread(target=one_request)
    worker.start()
    try:
        deadline = time.monotonic() + 10  # until the engine shows it running
        while engine_holds(url) != 1.0:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.01)
        waited = _wait_idle(url, limit=30)
        returned = time.monotonic()
    finally:
        worker.join(30)
    # The engine counts a request out of running at its last step and streams that step's
    # token when the step's time is up (~6 ms here), so its client may finish just after
    # the wait returns; a wait returning early would leave over a second of the answer.
    assert waited > 0 and done and done[0] <= returned + 0.25
    assert _wait_idle(url) < 1.0  # idle: at once


def test_users_below_capacity_are_all_served_within_the_objective(emulator) -> None:  # type: ignore[no-untyped-def]
    url, _app = emulator
    users = asyncio.run(run_cell(url, 5.0, _args(), seed=1))  # ~0.3x capacity
    recs = [r for r in users if r.measured]
    assert 1 <= len(recs) <= 20  # ~5 measured arrivals
    assert all(r.status == 200 and r.done and r.tokens == 64 for r in recs)
    assert 0 < sum(r.window_tokens for r in users) <= 64 * len(users)
    assert all(r.ttft is not None and r.answer is not None and r.ttft < 2.0 for r in recs)
    assert all(r.tpot is not None and 0 < r.tpot < 0.5 for r in recs)  # each answer streamed


def test_a_spread_varies_each_answers_length_around_the_mean(emulator) -> None:  # type: ignore[no-untyped-def]
    """`--spread 0.5`: each user asks for max_tokens within 32-96 and gets that many; the
    demand per key counts what each asked for."""
    url, _app = emulator
    args = _args("--spread", "0.5", "--keys", "a:1")
    users = asyncio.run(run_cell(url, 8.0, args, seed=4))
    recs = [r for r in users if r.measured]
    assert len(recs) >= 3
    assert all(32 <= r.asked <= 96 for r in users)
    assert len({r.asked for r in users}) > 1  # drawn, not one length
    assert all(r.status == 200 and r.done and r.tokens == r.asked for r in recs)
    demand = per_key(users, seconds=1.0, max_tokens=64, objective=2.0)["a"]["demand_tok_s"]
    assert demand == sum(r.asked for r in recs)


@asynccontextmanager
async def _peer(answer: bytes | None) -> AsyncIterator[tuple[str, list[str]]]:
    """A raw HTTP peer: answers `answer` at once, or (None) never; logs how each ended."""
    log: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(1000):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            if answer is None:  # hold the request until the client leaves
                log.append("closed" if await reader.read(1) == b"" else "data")
                break
            writer.write(answer)
            log.append("answered")
        writer.close()

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        server.close()


def test_a_user_with_no_first_token_gives_up_and_closes_the_stream() -> None:
    async def go() -> tuple[list[Record], list[str]]:
        async with _peer(None) as (url, log):
            users = await run_cell(url, 10.0, _args(), seed=2)
            async with asyncio.timeout(2):  # the peer sees every user's connection close
                while len(log) < len(users):
                    await asyncio.sleep(0.01)
            return users, log

    users, log = asyncio.run(go())
    recs = [r for r in users if r.measured]
    assert recs and all(r.gave_up and r.status is None for r in recs)
    assert set(log) == {"closed"}
    s = summarize(users, 1.0, 100.0, 2.0)
    assert s["gave_up"] == len(recs) and s["goodput_tok_s"] == 0 and s["errors"] == 0


def test_a_rejection_is_timed_and_not_retried() -> None:
    body = b'{"error":{"message":"full","type":"x","param":null,"code":503}}'
    answer = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def go() -> tuple[list[Record], list[str]]:
        async with _peer(answer) as (url, log):
            return await run_cell(url, 20.0, _args(), seed=3), log

    users, log = asyncio.run(go())
    assert users and all(r.status == 503 and r.answer is not None for r in users)
    assert len(log) == len(users)  # one try per user
    recs = [r for r in users if r.measured]
    s = summarize(users, 1.0, 100.0, 2.0)
    assert s["rejected"] == len(recs) and s["rejection_p99_ms"] < 1000


@pytest.mark.slow
def test_the_benchmark_in_miniature(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overload.json"
    rc = main(["--loads", "3", "--seconds", "3", "--warmup", "1", "--capacity-seconds", "2",
               "--give-up", "5", "--request-timeout", "10", "--arms",
               "direct,kneegate-fixed", "--fixed-limit", "16", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "capacity" in text and "kneegate-fixed limit 16 (--fixed-limit)" in text
    data = json.loads(out.read_text())
    assert data["capacity_rps"] > 0
    assert [(r["arm"], r["load"]) for r in data["rows"]] == [("direct", 3.0),
                                                             ("kneegate-fixed", 3.0)]
    assert all(r["users"] > 0 for r in data["rows"])
    direct, gated = data["rows"]
    # the gateway's own gauge, read over the window; the engine alone has none
    assert gated["limit_p50"] == 16 and direct["limit_p50"] is None
    assert 0 <= gated["in_flight_p50"] <= 16
    assert gated["prefill_cap_p50"] is not None and direct["prefill_cap_p50"] is None
    assert gated["goodput_over_direct_done"] == pytest.approx(
        gated["goodput_tok_s"] / direct["completed_tok_s"])


def test_a_given_capacity_is_offered_as_is(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # 640 tokens/s at 64 tokens a request: 10 requests/s, and 0.3x of it offered (3 a second)
    out = tmp_path / "overload.json"
    rc = main(["--capacity", "640", "--loads", "0.3", "--seconds", "2", "--warmup", "0",
               "--request-timeout", "10", "--arms", "direct", "--json", str(out)])
    assert rc == 0
    assert "capacity 10.00 req/s = 640 output tok/s (given, --capacity)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["capacity_rps"] == 10.0 and data["rows"][0]["offered_rps"] == pytest.approx(3.0)
    with pytest.raises(SystemExit, match="needs --fixed-limit"):
        main(["--capacity", "640", "--arms", "kneegate-fixed"])


def test_a_loop_kept_busy_reads_as_a_late_tick() -> None:
    """`late_ticks` records a stall of the load generator's own loop: what a process kept
    off the CPU looks like from inside."""
    async def main() -> list[float]:
        late: list[float] = []
        ticker = asyncio.create_task(late_ticks(late))
        await asyncio.sleep(0)  # the ticker is waiting on its first tick
        time.sleep(0.4)  # the loop held: that tick comes ~0.35 s past its time
        async with asyncio.timeout(5):
            while not late:
                await asyncio.sleep(0.01)
        ticker.cancel()
        return late

    assert max(asyncio.run(main())) >= 0.3

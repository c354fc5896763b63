"""A clock-free continuous-batching engine core, modelled on vLLM V1's scheduler.

Each `step()` schedules one batch and returns how long it takes (engine-seconds) and what
every request emitted. No clock, no sleep, no asyncio: the real-time server sleeps
`duration / speed` between steps, the simulator just adds `duration` to its virtual clock.

Scheduling (vllm/v1/core/sched/scheduler.py, `schedule()`):
1. Running requests first, in order, each taking min(tokens not yet computed, budget) from
   the per-step budget `max_num_batched_tokens` (a decode needs 1; a long prompt is chunked).
   A request that needs a KV block when none is free preempts the *newest* running request:
   its blocks are freed, its computed tokens reset to 0, and it goes back to the head of the
   waiting queue (recompute). If the victim is the request itself, scheduling stops.
2. Then, only if nothing was preempted this step, waiting requests in FCFS order while the
   running set is below `max_num_seqs`, budget remains and the KV cache has blocks for the
   chunk being scheduled.
A request whose computed tokens catch up with its tokens samples one output token in that
step (a partial prefill chunk emits nothing). Blocks are 16 tokens; the last token sampled
never needs KV, so a request of P prompt and N output tokens peaks at ceil((P+N-1)/16) blocks.

Admission (vLLM >= 0.32, `--max-num-queued-reqs` / `--max-num-queued-tokens`, both off by
default): `add_request` first asks `admission()` and raises `QueueFull(reason)` instead of
queueing; the request never enters the engine. vLLM decides this in its API server
(vllm/v1/engine/async_llm.py, `AsyncLLM.check_admission`) from the frontend's view of the
requests it has handed to the engine, which is what the core knows here:
- `max_num_queued_reqs`: unfinished requests, waiting *and* running; a request is refused when
  it would make them exceed the cap (count + 1 > cap; a cap of 0 refuses everything).
- `max_num_queued_tokens`: the prompt tokens of every request that has not yet emitted its
  first token (waiting, or running a chunked prefill: the frontend only learns of prefill
  progress from the first output), whole prompts, and not the new request's own; refused when
  that sum is already >= the cap. A preempted request that had emitted tokens does not count
  again (vLLM's frontend keeps it out of the prefill phase).
The request cap is checked first, so a request both caps refuse is counted under it.

Prefix caching (vLLM's automatic prefix caching, vllm/v1/core/kv_cache_manager.py; on when the
profile's `enable_prefix_caching` is): a request may carry `block_keys`, one key per *full*
block of its prompt, each standing for that block's tokens and everything before them (a hash
chain, as vLLM's block hashes). Blocks whose key is known stay in the cache after their request
ends, counted as free but kept in least-recently-freed order, and are evicted only when an
allocation needs more blocks than the uncached free ones. When a request is scheduled with
nothing computed (first time, or after a preemption), its leading run of known keys, capped
at `prompt - 1` tokens (the last prompt token is always recomputed for its logits), counts as
computed: those blocks are shared (a reference each), their prefill is skipped. As a request
computes a full prompt block, the block is published under its key (or, if another request
published it meanwhile, the request drops its copy and shares theirs). First schedulings
count the prompt tokens queried and hit (vLLM's `vllm:prefix_cache_queries` / `_hits`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from kneegate.emulator.blocks import BlockPool
from kneegate.emulator.cost import StepCost, Wander
from kneegate.emulator.profiles import Profile

__all__ = [
    "ADMISSION_REASONS",
    "QUEUED_REQS",
    "QUEUED_TOKENS",
    "CoreStats",
    "EngineCore",
    "EngineRequest",
    "QueueFull",
    "StepResult",
    "TokenEvent",
]

# the `reason` label of vllm:admission_rejections_total: the setting whose cap refused
QUEUED_REQS = "max_num_queued_reqs"
QUEUED_TOKENS = "max_num_queued_tokens"
ADMISSION_REASONS = (QUEUED_REQS, QUEUED_TOKENS)


class QueueFull(Exception):
    """`add_request` refused a request: the admission cap `reason` is full (vLLM: HTTP 503)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} refused: {reason} is full")
        self.request_id, self.reason = request_id, reason


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int  # output tokens to generate
    ignore_eos: bool = False  # True: exactly max_tokens even if the profile has an EOS model
    block_keys: tuple[int, ...] = ()  # one per full prompt block: the prefix-cache hash chain


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    new_tokens: int  # output tokens emitted by this step for this request
    first: bool  # this step emitted the request's first output token
    finished: str | None  # None | "length" | "stop" | "abort"


@dataclass(frozen=True, slots=True)
class StepResult:
    duration: float  # engine-seconds, already multiplied by slowdown
    events: list[TokenEvent]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    started: list[str] = field(default_factory=list)  # scheduled for the first time this step


@dataclass(frozen=True, slots=True)
class CoreStats:
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    admission_rejections: dict[str, int] = field(default_factory=dict)  # by reason
    prefill_tokens: int = 0  # what max_num_queued_tokens is compared with
    prefix_cache_queries: int = 0  # prompt tokens looked up at first scheduling
    prefix_cache_hits: int = 0  # ... of which found in the cache


class _Req:
    __slots__ = (
        "block_keys", "blocks", "computed", "id", "keys", "max_tokens", "output", "prompt",
        "started", "target",
    )

    def __init__(self, req: EngineRequest, target: int) -> None:
        self.id = req.request_id
        self.prompt = req.prompt_tokens
        self.max_tokens = req.max_tokens
        self.target = target  # output tokens it will produce (< max_tokens: an EOS stop)
        self.output = 0
        self.computed = 0  # tokens whose KV is in the cache
        self.blocks = 0  # blocks held alone (not published under a key)
        self.block_keys = req.block_keys
        self.keys: list[int] = []  # the leading prompt blocks it shares, by key
        self.started = False

    @property
    def held(self) -> int:
        return self.blocks + len(self.keys)


class EngineCore:
    """The engine: add requests, call `step()` while `has_unfinished()`."""

    def __init__(self, profile: Profile, *, seed: int = 0) -> None:
        self.profile = profile
        self.slowdown = 1.0  # capacity knob: step durations are multiplied by it
        self._cost = StepCost.from_profile(profile)
        self._rng = random.Random(seed)
        self._wander = Wander(profile.cost.jitter, profile.cost.jitter_s, seed + 1)
        self._block = profile.engine.block_size
        self._max_seqs = profile.engine.max_num_seqs
        self._budget = profile.engine.max_num_batched_tokens
        self._total_blocks = profile.num_blocks
        self._pool = BlockPool(self._total_blocks)
        self._running: list[_Req] = []
        self._waiting: deque[_Req] = deque()
        self._by_id: dict[str, _Req] = {}
        self._preemptions = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._max_queued_reqs = profile.engine.max_num_queued_reqs
        self._max_queued_tokens = profile.engine.max_num_queued_tokens
        self._prefill_tokens = 0  # prompts of requests with no output token yet
        self._rejections = dict.fromkeys(ADMISSION_REASONS, 0)
        self._caching = profile.engine.enable_prefix_caching
        self._queries = self._hits = 0

    # -- requests ---------------------------------------------------------------------------

    def admission(self) -> str | None:
        """The cap that would refuse one more request now (a reason), or None to admit it."""
        cap = self._max_queued_reqs
        if cap is not None and len(self._by_id) + 1 > cap:
            return QUEUED_REQS
        cap = self._max_queued_tokens
        if cap is not None and self._prefill_tokens >= cap:
            return QUEUED_TOKENS
        return None

    def add_request(self, req: EngineRequest) -> None:
        """Queue `req`. Raises ValueError if it could never fit the KV cache or is a duplicate,
        QueueFull (counted by reason) if an admission cap refuses it."""
        if req.prompt_tokens < 1 or req.max_tokens < 1:
            raise ValueError(
                f"request {req.request_id!r}: prompt_tokens and max_tokens must be >= 1"
            )
        if req.request_id in self._by_id:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if self._blocks_for(req.prompt_tokens + req.max_tokens - 1) > self._total_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {req.prompt_tokens + req.max_tokens} tokens of "
                f"KV cache; the cache holds {self._total_blocks * self._block}"
            )
        reason = self.admission()
        if reason is not None:
            self._rejections[reason] += 1
            raise QueueFull(req.request_id, reason)
        r = _Req(req, self._target(req))
        self._by_id[r.id] = r
        self._waiting.append(r)
        self._prefill_tokens += r.prompt

    def abort_request(self, request_id: str) -> bool:
        """Remove a request now and free its blocks. False if it is unknown or finished."""
        r = self._by_id.pop(request_id, None)
        if r is None:
            return False
        if r in self._waiting:
            self._waiting.remove(r)
        else:
            self._running.remove(r)
        if r.output == 0:
            self._prefill_tokens -= r.prompt
        self._release(r)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    def stats(self) -> CoreStats:
        return CoreStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=1.0 - self._pool.free / self._total_blocks,
            num_preemptions_total=self._preemptions,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._gen_total,
            admission_rejections=dict(self._rejections),
            prefill_tokens=self._prefill_tokens,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule one batch, advance every scheduled request, price the step."""
        scheduled, preempted = self._schedule_running()
        if not preempted:
            self._schedule_waiting(scheduled)
        if not scheduled:
            return StepResult(0.0, [], 0, 0, preempted)
        return self._execute(scheduled, preempted)

    def _schedule_running(self) -> tuple[list[tuple[_Req, int]], int]:
        scheduled: list[tuple[_Req, int]] = []
        budget, preempted, i = self._budget, 0, 0
        running = self._running
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.prompt + r.output - r.computed, budget)
            need = self._blocks_for(r.computed + n) - r.held
            while need > self._pool.free:
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is r:
                    return scheduled, preempted
            self._pool.take(need)
            r.blocks += need
            scheduled.append((r, n))
            budget -= n
            i += 1
        return scheduled, preempted

    def _schedule_waiting(self, scheduled: list[tuple[_Req, int]]) -> None:
        budget = self._budget - sum(n for _, n in scheduled)
        waiting, running = self._waiting, self._running
        while waiting and budget > 0 and len(running) < self._max_seqs:
            r = waiting[0]
            hits = self._lookup(r) if r.computed == 0 and self._caching else []
            computed = len(hits) * self._block or r.computed
            n = min(r.prompt + r.output - computed, budget)
            need = self._blocks_for(computed + n) - r.held - len(hits)
            if need + self._pool.revived(hits) > self._pool.free:
                break
            waiting.popleft()
            running.append(r)
            if r.computed == 0 and self._caching:
                self._share(r, hits)
            self._pool.take(need)
            r.blocks += need
            scheduled.append((r, n))
            budget -= n

    def _execute(self, scheduled: list[tuple[_Req, int]], preempted: int) -> StepResult:
        events: list[TokenEvent] = []
        started: list[str] = []
        prefill = decode = sampled = context = 0
        attn = 0.0
        for r, n in scheduled:
            if not r.started:
                r.started = True
                started.append(r.id)
            is_decode = n == 1 and r.computed > 0
            if is_decode:
                decode += 1
            else:
                prefill += n
            attn += n * (r.computed + n / 2)
            r.computed += n
            context += r.computed
            if len(r.keys) < len(r.block_keys):
                self._publish(r)
            if r.computed == r.prompt + r.output:
                sampled += 1
                events.append(self._emit(r))
        if any(e.finished for e in events):
            self._running = [r for r in self._running if self._by_id.get(r.id) is r]
        seconds = self._cost.seconds(len(scheduled), prefill + decode, sampled, attn, context)
        seconds *= self._wander.factor(seconds)
        return StepResult(seconds * self.slowdown, events, prefill, decode, preempted, started)

    def _emit(self, r: _Req) -> TokenEvent:
        first = r.output == 0
        if first:
            self._prompt_total += r.prompt
            self._prefill_tokens -= r.prompt  # out of the prefill phase, as vLLM's frontend sees
        r.output += 1
        self._gen_total += 1
        finished: str | None = None
        if r.output >= r.target:
            finished = "length" if r.output >= r.max_tokens else "stop"
            self._finish(r)
        return TokenEvent(r.id, 1, first, finished)

    def _finish(self, r: _Req) -> None:
        del self._by_id[r.id]  # _execute drops it from the running list after the batch
        self._release(r)

    def _preempt(self, r: _Req) -> None:
        self._release(r)
        r.computed = 0
        self._waiting.appendleft(r)
        self._preemptions += 1

    # -- the prefix cache -------------------------------------------------------------------

    def _release(self, r: _Req) -> None:
        """Give back every block `r` holds; its published blocks stay cached while unshared."""
        self._pool.give(r.blocks)
        r.blocks = 0
        self._pool.unref(r.keys)
        r.keys = []

    def _lookup(self, r: _Req) -> list[int]:
        """The leading keys of `r` the cache knows, at most `prompt - 1` tokens' worth."""
        hits: list[int] = []
        for key in r.block_keys[: (r.prompt - 1) // self._block]:
            if not self._pool.knows(key):
                break
            hits.append(key)
        return hits

    def _share(self, r: _Req, hits: list[int]) -> None:
        """`r` starts from its cached prefix `hits`: a reference on each, prefill skipped."""
        if not r.started:
            self._queries += r.prompt
            self._hits += len(hits) * self._block
        for key in hits:
            self._pool.ref(key)
        r.keys = hits
        r.computed = len(hits) * self._block

    def _publish(self, r: _Req) -> None:
        """Publish every full prompt block `r` has computed and holds alone."""
        while len(r.keys) < len(r.block_keys) and (len(r.keys) + 1) * self._block <= r.computed:
            key = r.block_keys[len(r.keys)]
            self._pool.publish(key)
            r.blocks -= 1
            r.keys.append(key)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block)

    def _target(self, req: EngineRequest) -> int:
        mean = self.profile.cost.eos_mean_tokens
        if req.ignore_eos or mean is None:
            return req.max_tokens
        # geometric stop length with the profile's mean: one EOS chance per token
        drawn = 1 + int(self._rng.expovariate(1.0 / max(mean - 1.0, 1e-9)))
        return min(req.max_tokens, drawn)

"""The admission queue's values: what it is asked, what it answers, and what it holds.

A `Ticket` is one request asking for a slot; `offer` answers it `Admitted(upstream)`,
`Queued(position)` or `Rejected(reason, retry_after, message)`. A `ClassPolicy` is one
priority class as the queue applies it, an `UpstreamState` one engine as the queue sees it:
its controller and the requests (and their prompt-size estimates) in flight there.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from kneegate.admission.slow_start import SlowStart
from kneegate.admission.wait import PrefillLine
from kneegate.controllers.base import Controller

__all__ = [
    "Admitted",
    "ClassPolicy",
    "Queued",
    "RejectReason",
    "Rejected",
    "TenantPolicy",
    "Ticket",
    "UpstreamState",
    "least_full",
    "no_upstream",
    "over_objective",
    "queue_full",
    "queue_timeout",
    "shutting_down",
    "tenant_quota",
]


class RejectReason(enum.Enum):
    QUEUE_FULL = "queue_full"  # 429: capacity exists, but not now
    QUEUE_TIMEOUT = "queue_timeout"  # 503: waited past the class's timeout or objective
    OVER_OBJECTIVE = "over_objective"  # 429: could not be served within its objective now
    NO_UPSTREAM = "no_upstream"  # 503: nothing usable to send to
    SHUTTING_DOWN = "shutting_down"  # 503: the gateway is draining for shutdown
    TENANT_QUOTA = "tenant_quota"  # 429: the tenant is over its own cap (in flight, tokens)


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """One priority class: its rank, how long it may wait, its share of the queue."""

    name: str
    priority: int = 0  # higher is dispatched first
    max_wait: float = 30.0  # seconds in the queue before 503
    queue_share: float = 1.0  # fraction of the queue's capacity this class may fill
    ttft_objective: float = math.inf  # seconds from arrival to the first token
    queue_budget: float = 0.25  # of the objective less the engine's TTFT: the queue's part


@dataclass(slots=True)
class UpstreamState:
    """One engine as admission sees it: its controller and its live in-flight count.

    It has room for a ticket while its in-flight count is under its `limit` (its controller's,
    or more while its slow start is open: `admission.slow_start`),
    the controller `fits` the ticket's prompt-size estimate beside the sizes already in
    flight there (a token budget; most controllers count requests only), and fewer of its
    streamed requests await their first token than `prefill_cap` (0: no cap; set by the
    queue from `prefill_line`: `AdmissionQueue.first_token`)."""

    name: str
    controller: Controller
    inflight: int = 0
    usable: bool = True
    inflight_tokens: int = 0  # the in-flight requests' prompt-size estimates, summed
    passing: int = 0  # requests that are not generation in flight here: no slot (`offer`)
    refusing: bool = False  # its engine refused a request unstarted: full until a slot frees
    prefilling: int = 0  # streamed requests dispatched here with no first token yet
    prefill_cap: int = 0  # at most this many of them (0: no cap)
    # its TTFT against the backlog each request found: what sets `prefill_cap`
    prefill_line: PrefillLine = field(default_factory=PrefillLine)
    # no refusal without evidence: None for a controller that is not adaptive (`fixed`)
    slow_start: SlowStart | None = None
    # model id -> its context (`max_model_len`; None: not listed), as its engine lists them
    # (or its config names them); None (or empty: its list could not be read) while
    # unknown: it may serve any
    models: dict[str, int | None] | None = None

    def __post_init__(self) -> None:
        if self.slow_start is None and getattr(self.controller, "adaptive", True):
            self.slow_start = SlowStart()

    @property
    def limit(self) -> int:
        """The in-flight count it may hold: its controller's limit, or its slow start's
        allowance while that is open and larger."""
        ss = self.slow_start
        return self.controller.limit if ss is None else ss.limit(self.controller.limit)

    @property
    def fullness(self) -> float:
        return self.inflight / max(1, self.limit)

    def has_room_for(self, tokens: int) -> bool:
        """Room for one more request of `tokens` (estimated prompt tokens): usable, under
        the limit, and within the controller's token budget. An idle upstream always has
        room for one, whatever its budget says: nothing else would ever run."""
        if not self.usable or self.refusing or self.inflight >= self.limit:
            return False
        if self.prefill_cap and self.prefilling >= self.prefill_cap:
            return False
        return self.inflight == 0 or self.controller.fits(
            self.inflight, self.inflight_tokens, tokens
        )

    def serves(self, model: str | None) -> bool:
        """It may serve `model`: it lists it, or its list is unknown (or no model is named)."""
        return model is None or not self.models or model in self.models

    def take(self, tokens: int) -> None:
        """One more request in flight here, of `tokens` (its prompt-size estimate)."""
        self.inflight += 1
        self.inflight_tokens += tokens

    def free(self, tokens: int) -> None:
        """One request of `tokens` left: its slot, and room in the engine's own queue."""
        self.refusing = False  # a request left the engine: its own queue has room again
        self.inflight -= 1
        self.inflight_tokens -= tokens
        assert self.inflight >= 0, "released more slots than were taken"
        assert self.inflight_tokens >= 0, "released more tokens than were taken"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Who a request is for, as admission weighs it: fair shares within a class are kept
    between tenants (`admission.fairness`). `name` is its key in the queue (a configured
    tenant's name, or a hash of an unconfigured API key; "" is everyone without one);
    `label` is what metrics call it. `unlisted`: a name any client can mint (a key no
    config lists, a tenant header's value): pooled until it has been served."""

    name: str = ""
    weight: float = 1.0  # its share relative to other tenants' (2: twice a weight-1 share)
    max_inflight: int | None = None  # its requests queued or in flight, at most
    tokens_per_minute: float | None = None  # prompt + output tokens a minute, at most
    label: str = "anonymous"
    unlisted: bool = False
    # either cap set (read on every offer: a field, not a property)
    capped: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        capped = self.max_inflight is not None or self.tokens_per_minute is not None
        object.__setattr__(self, "capped", capped)


ANONYMOUS = TenantPolicy()


@dataclass(slots=True, eq=False)
class Ticket:
    """One request asking for a slot. `payload` belongs to the caller (a future, a sim request)."""

    cls: str
    arrived_at: float
    payload: Any = None
    tokens: int = 0  # the prompt's size estimate, for controllers with a token budget
    # generation (a completion, chat, embedding, response): evidence about the engine's
    # prompts, load and demand; anything else passes with no slot and tells nobody
    generation: bool = True
    deadline: float = math.inf  # set when queued: leave the queue (503) by then
    due: float = math.inf  # set when queued: never dispatched from then (its objective)
    ttft_objective: float = math.inf  # the request's own objective (it can only tighten)
    upstream: UpstreamState | None = None  # set at dispatch
    dispatched_at: float | None = None
    inflight_at_admit: int = 0
    tenant: TenantPolicy = ANONYMOUS
    charged: float = 0.0  # what its tenant's fair-share counter was charged for it
    output_charged: int = 0  # of which output tokens, as they streamed
    streamed: bool = False  # its answer streams: its first token is seen (`first_token`)
    awaiting_first: bool = False  # dispatched, streamed, and no first token yet
    backlog_at_dispatch: int = 0  # its upstream's streamed requests awaiting a first token
    pooled: bool = False  # queued or served in its class's pool of unproven tenants
    model: str | None = None  # the model it names: only an upstream serving it takes it
    prefix: tuple[int, ...] = ()  # its prompt's prefix keys, for affinity (`admission.affinity`)
    pool: Any = None  # the admission queue holding it, where several share the gateway


# how much fuller than the least full upstream (a share of its limit) the one holding a
# request's prefix may be and still take it
AFFINITY_SLACK = 0.5


def least_full(upstreams: list[UpstreamState], tokens: int,
               skip: UpstreamState | None = None, model: str | None = None,
               prefer: str | None = None) -> UpstreamState | None:
    """The upstream serving `model` with room for `tokens` that is least full (in-flight /
    limit), `skip` aside; None when none has room. The first of equals wins. The upstream
    named `prefer` (prefix affinity: `admission.affinity`) wins while it has room and is
    no fuller than the least full by more than `AFFINITY_SLACK` of its limit: its cache
    saves a prefill, but a replica loaded past the others slows every answer on it."""
    best: UpstreamState | None = None
    preferred: UpstreamState | None = None
    for u in upstreams:
        if u is skip or not u.has_room_for(tokens) or not (
                model is None or not u.models or model in u.models):
            continue
        if u.name == prefer:
            preferred = u
        if best is None or u.fullness < best.fullness:
            best = u
    if preferred is not None and best is not None and (
            preferred.fullness <= best.fullness + AFFINITY_SLACK):
        return preferred
    return best


@dataclass(frozen=True, slots=True)
class Admitted:
    upstream: UpstreamState


@dataclass(frozen=True, slots=True)
class Queued:
    position: int  # tickets ahead of this one that will be dispatched first
    # a queued ticket of the tenant furthest over its share, shed to make room for this
    # one (`admission.fairness`), and the answer it is owed; None when nothing was shed
    evicted: tuple[Ticket, Rejected] | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    retry_after: int  # whole seconds, for the Retry-After header
    message: str


# --- each refusal, in words for the client (the OpenAI-style error body's message) ---------


def no_upstream(retry_after: int) -> Rejected:
    return Rejected(
        RejectReason.NO_UPSTREAM,
        retry_after,
        "no upstream engine is usable right now; retry shortly",
    )


def shutting_down(retry_after: int) -> Rejected:
    return Rejected(
        RejectReason.SHUTTING_DOWN,
        retry_after,
        "kneegate is shutting down; retry (another replica can take the request)",
    )


def over_objective(objective: float, ahead: int, predicted: float, retry_after: int) -> Rejected:
    """`predicted`: seconds to a first token, the queue's wait and the engine's TTFT."""
    return Rejected(
        RejectReason.OVER_OBJECTIVE,
        retry_after,
        f"cannot serve a first token within {objective:g}s now ({ahead} waiting, "
        f"~{predicted:.1f}s predicted); retry after {retry_after}s",
    )


def queue_full(cls: str, queued: int, capacity: int, retry_after: int) -> Rejected:
    return Rejected(
        RejectReason.QUEUE_FULL,
        retry_after,
        f"admission queue for class '{cls}' is full "
        f"({queued}/{capacity}); retry after {retry_after}s",
    )


def tenant_quota(tenant: str, what: str, retry_after: int) -> Rejected:
    """`what`: the cap, in words ("8 requests in flight", "60000 tokens a minute")."""
    return Rejected(
        RejectReason.TENANT_QUOTA, retry_after,
        f"tenant '{tenant}' is at its quota of {what}; retry after {retry_after}s",
    )


def queue_timeout(cls: str, cap: float, waited: float, retry_after: int) -> Rejected:
    """A queued request left the queue after `waited` seconds: its class's wait `cap`, or
    too late for a first token within its objective."""
    why = (f"queue wait exceeded {cap:g}s" if waited >= cap - 1e-6 else
           f"no slot in time for a first token within the objective "
           f"({waited:.1f}s waited)")
    return Rejected(
        RejectReason.QUEUE_TIMEOUT, retry_after,
        f"{why} for class '{cls}'; retry after {retry_after}s",
    )

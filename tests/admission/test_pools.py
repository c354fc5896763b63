"""Pools: engines serving different models, each pool admitted on its own."""

from __future__ import annotations

from kneegate.admission.pools import Pools, group
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    TenantPolicy,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.registry import build_controller

CLASSES = {"default": ClassPolicy("default", priority=0, max_wait=5.0)}


def up(name: str, limit: int, *models: str, known: bool = True) -> UpstreamState:
    u = UpstreamState(name, build_controller("fixed", {"initial": limit}))
    u.models = dict.fromkeys(models) if known else None
    return u


def ticket(model: str | None, at: float = 0.0, tenant: TenantPolicy | None = None) -> Ticket:
    t = Ticket("default", at, model=model)
    if tenant is not None:
        t.tenant = tenant
    return t


def test_upstreams_sharing_a_model_are_one_pool_and_unknown_ones_join_everything() -> None:
    a, b, c = up("a", 1, "llama"), up("b", 1, "llama", "llama-lora"), up("c", 1, "qwen")
    assert [[u.name for u in g] for g in group([a, b, c])] == [["a", "b"], ["c"]]
    d = up("d", 1, known=False)
    assert [[u.name for u in g] for g in group([a, b, c, d])] == [["a", "b", "c", "d"]]
    assert group([]) == []


def test_a_request_goes_only_to_an_engine_serving_its_model() -> None:
    llama, qwen = up("llama", 4, "llama"), up("qwen", 4, "qwen")
    pools = Pools([llama, qwen], CLASSES)
    assert pools.models == ["llama", "qwen"]
    for model, engine in (("llama", llama), ("qwen", qwen), ("qwen", qwen)):
        decision = pools.offer(ticket(model), 0.0)
        assert isinstance(decision, Admitted) and decision.upstream is engine
    assert (llama.inflight, qwen.inflight) == (1, 2)
    unknown = pools.offer(ticket("gpt-4"), 0.0)
    assert isinstance(unknown, Rejected) and unknown.reason is RejectReason.NO_UPSTREAM


def test_one_full_pool_never_holds_the_other_back() -> None:
    llama, qwen = up("llama", 1, "llama"), up("qwen", 1, "qwen")
    pools = Pools([llama, qwen], CLASSES)
    first = ticket("llama")
    assert isinstance(pools.offer(first, 0.0), Admitted)
    waiting = ticket("llama", 0.1)
    assert isinstance(pools.offer(waiting, 0.1), Queued)  # llama is full: it queues
    other = pools.offer(ticket("qwen", 0.2), 0.2)  # ... and qwen's request goes at once
    assert isinstance(other, Admitted) and other.upstream is qwen
    assert pools.depth() == 1
    assert pools.release(first, 0.3) == [waiting]  # llama's slot goes to llama's queue
    assert waiting.upstream is llama


def test_adapters_on_some_replicas_only_are_routed_to_those() -> None:
    base, both = up("base", 4, "llama"), up("both", 4, "llama", "sql-lora")
    pools = Pools([base, both], CLASSES)
    assert len(pools.pools) == 1  # they share the base model's engines
    for _ in range(3):
        decision = pools.offer(ticket("sql-lora"), 0.0)
        assert isinstance(decision, Admitted) and decision.upstream is both
    assert isinstance(pools.offer(ticket("sql-lora"), 0.0), Admitted)
    assert isinstance(pools.offer(ticket("sql-lora"), 0.0), Queued)  # `both` is full
    assert base.inflight == 0


def test_until_models_are_known_there_is_one_pool_that_takes_any_model() -> None:
    a, b = up("a", 2, known=False), up("b", 2, known=False)
    pools = Pools([a, b], CLASSES)
    assert len(pools.pools) == 1 and pools.pool_of("anything") is pools.pools[0]
    held = ticket("llama")
    assert isinstance(pools.offer(held, 0.0), Admitted)
    a.models, b.models = {"llama": None}, {"qwen": None}
    pools.regroup()
    assert len(pools.pools) == 2
    # the old pool drains: its ticket is released where it was taken
    assert pools.release(held, 1.0) == []
    assert pools.flying == 0 and len(pools.queues()) == 2


def test_a_tenants_cap_counts_its_requests_in_every_pool() -> None:
    capped = TenantPolicy("team", max_inflight=2)
    pools = Pools([up("llama", 4, "llama"), up("qwen", 4, "qwen")], CLASSES)
    assert isinstance(pools.offer(ticket("llama", tenant=capped), 0.0), Admitted)
    assert isinstance(pools.offer(ticket("qwen", tenant=capped), 0.0), Admitted)
    third = pools.offer(ticket("qwen", tenant=capped), 0.0)
    assert isinstance(third, Rejected) and third.reason is RejectReason.TENANT_QUOTA


def test_no_model_named_goes_to_the_only_pool_and_nowhere_when_there_are_several() -> None:
    one = Pools([up("a", 1, "llama")], CLASSES)
    assert isinstance(one.offer(ticket(None), 0.0), Admitted)
    two = Pools([up("a", 1, "llama"), up("b", 1, "qwen")], CLASSES)
    assert two.pool_of(None) is None


def test_a_tick_times_out_each_pools_own_queue() -> None:
    llama, qwen = up("llama", 1, "llama"), up("qwen", 1, "qwen")
    pools = Pools([llama, qwen], CLASSES)
    pools.offer(ticket("llama"), 0.0)
    late = ticket("llama", 0.0)
    pools.offer(late, 0.0)
    dispatched, expired = pools.tick(10.0)
    assert dispatched == [] and expired == [late]


def test_a_pool_that_gains_a_replica_keeps_its_queue_and_what_waits_in_it() -> None:
    a, b = up("a", 1, "llama"), up("b", 1, "llama")
    pools = Pools([a], CLASSES)
    first = ticket("llama")
    assert isinstance(pools.offer(first, 0.0), Admitted)
    waiting = ticket("llama", 0.1)
    assert isinstance(pools.offer(waiting, 0.1), Queued)
    queue = pools.pools[0].queue
    pools.reconfigure(CLASSES, 256, [a, b])  # a reload adds a replica
    assert pools.pools[0].queue is queue and len(pools.queues()) == 1
    assert pools.pump(0.2) == [waiting] and waiting.upstream is b

"""Who a request is for cannot be minted, claimed or made expensive: a tenant's name is a
keyed hash of its key, the header names only tenants that allow it, a long key is never
kept, and a reload keeps the budget of labels (gateway/tenants.py)."""

from __future__ import annotations

import hashlib
import tracemalloc

from helpers.gateway import gw_config

from kneegate.admission.types import ANONYMOUS
from kneegate.gateway.tenants import Tenants

SALT = "a-deployment-secret-0123456789"


def tenants(**overrides: object) -> Tenants:
    return Tenants.from_config(gw_config(**overrides))


def test_an_unlisted_key_is_named_by_a_keyed_hash_alike_where_the_salt_is_alike() -> None:
    one, two = tenants(tenant_key_salt=SALT), tenants(tenant_key_salt=SALT)
    name = one.resolve(b"Bearer EMPTY").name
    assert name.startswith("key-") and name == two.resolve(b"Bearer EMPTY").name
    assert name != "key-" + hashlib.blake2b(b"EMPTY", digest_size=6).hexdigest()  # unsalted
    assert name != tenants(tenant_key_salt=SALT[::-1]).resolve(b"Bearer EMPTY").name


def test_the_header_names_a_configured_tenant_only_where_it_allows_it() -> None:
    t = tenants(tenant_header="x-tenant", tenants={
        "paid": {"keys": ["sk-paid"], "weight": 8},
        "team": {"by_header": True, "weight": 2}})
    claimed = t.resolve(b"Bearer sk-trial", b"paid")  # any client can send a header
    assert claimed.name.startswith("key-") and claimed.weight == 1
    assert t.resolve(None, b"paid") is ANONYMOUS
    assert t.resolve(None, b"team").weight == 2
    assert t.resolve(None, b"newcomer").name == "newcomer"  # unconfigured: weight 1
    assert t.resolve(b"Bearer sk-paid", b"team").name == "paid"  # its key first


def test_a_long_key_is_hashed_each_time_and_never_kept() -> None:
    t = tenants()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(400):
        key = b"Bearer " + str(i).encode() * (60_000 // len(str(i)))
        assert t.resolve(key).name == t.resolve(key).name
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 400 * 1_000, grown  # ~60 KB each if the keys were kept


def test_a_reload_keeps_the_budget_of_labels() -> None:
    first = tenants()
    for i in range(Tenants.LABELS_MAX):
        first.resolve(b"Bearer k%d" % i)
    again = Tenants.from_config(gw_config(), first)
    assert again.resolve(b"Bearer fresh").label == "other"
    assert Tenants.from_config(gw_config()).resolve(b"Bearer fresh").label != "other"


def test_a_name_any_client_can_mint_is_unlisted_a_configured_one_is_not() -> None:
    t = tenants(tenant_header="x-tenant", tenants={"paid": {"keys": ["sk-paid"]}})
    assert t.resolve(b"Bearer sk-minted-0001").unlisted  # pooled until served (fairness)
    assert t.resolve(None, b"someone").unlisted  # any client can send a header
    assert not t.resolve(b"Bearer sk-paid").unlisted and not ANONYMOUS.unlisted

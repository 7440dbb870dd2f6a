"""The capacity store's layout: one slot per route, and wait members that order each tenant's jobs FIFO."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sluice.schemas.keys import Keys, key_slot, parse_wait_member, tenant_prefix, wait_member


def test_every_key_of_a_route_is_in_one_slot_and_routes_differ() -> None:
    rk = Keys("p").route("claude")
    assert rk.tag == "p:{cap:claude}"
    keys = rk.script_keys("w1")
    assert len(keys) == 16 and keys[-2] == "p:{cap:claude}:finished" and keys[-1] == "p:{cap:claude}:admit:w1"
    assert {key_slot(k) for k in keys} == {key_slot("{cap:claude}")}
    assert (
        rk.wait("batch") == "p:{cap:claude}:wait:batch" and rk.ring("interactive") == "p:{cap:claude}:ring:interactive"
    )


@given(
    st.text(max_size=20).filter(lambda t: len(t.encode()) <= 128),
    st.integers(0, 10**13 - 1),
    st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True),
)
def test_a_wait_member_round_trips_and_starts_with_its_tenant_prefix(tenant: str, at: int, rid: str) -> None:
    m = wait_member(tenant, at, rid)
    assert parse_wait_member(m) == (tenant, at, rid)
    assert m.startswith(tenant_prefix(tenant))


def test_one_tenants_members_sort_by_queued_at_and_tenants_do_not_interleave() -> None:
    members = [wait_member(t, at, r) for t, at, r in [("b", 5, "x"), ("a", 9, "y"), ("a", 1, "z"), ("ab", 0, "w")]]
    ordered = sorted(m.encode() for m in members)
    assert [parse_wait_member(m) for m in ordered] == [("a", 1, "z"), ("a", 9, "y"), ("b", 5, "x"), ("ab", 0, "w")]

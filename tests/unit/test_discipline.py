"""The admission discipline's pure model (tests.oracles.discipline): exact choice sequences, and properties
over any run: no batch job admitted while an admissible interactive one waits, and a waiting tenant is served
within a bounded number of admissions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracles.discipline import Discipline, TenantShare


def _park(d: Discipline, jobs: list[tuple[str, str, str]]) -> None:
    """Jobs offered while the route is full: all parked, in order."""
    for i, (rid, tenant, prio) in enumerate(jobs):
        assert d.offer(rid, tenant, prio, i) == "parked"  # type: ignore[arg-type]


def _full(d: Discipline, n: int) -> None:
    for i in range(n):
        assert d.offer(f"busy{i}", "busy", "interactive", -1) == "admitted"


def _drain(d: Discipline) -> list[str]:
    """One admission per freed permit, as the RELEASE handoff does."""
    out: list[str] = []
    while True:
        d.release(next(iter(d.held)))
        got = d.admit(1)
        if not got:
            return out
        out += got


def test_interactive_before_batch_and_fifo_within_a_tenant() -> None:
    d = Discipline(max_concurrency=1)
    _full(d, 1)
    _park(d, [("b1", "", "batch"), ("i1", "", "interactive"), ("b2", "", "batch"), ("i2", "", "interactive")])
    assert _drain(d) == ["i1", "i2", "b1", "b2"]


def test_deficit_round_robin_by_weight() -> None:
    d = Discipline(max_concurrency=1, tenants={"a": TenantShare(weight=2)})
    _full(d, 1)
    _park(d, [(f"a{i}", "a", "batch") for i in range(5)] + [(f"b{i}", "b", "batch") for i in range(3)])
    assert _drain(d) == ["a0", "a1", "b0", "a2", "a3", "b1", "a4", "b2"]


def test_a_turn_cut_short_by_n_goes_on_at_the_next_call() -> None:
    d = Discipline(max_concurrency=1, tenants={"a": TenantShare(weight=3)})
    _full(d, 1)
    _park(d, [("a0", "a", "batch"), ("a1", "a", "batch"), ("a2", "a", "batch"), ("b0", "b", "batch")])
    d.max_concurrency = 0  # the cap lifted: only n bounds a call
    assert d.admit(2) == ["a0", "a1"]
    assert d.admit(2) == ["a2", "b0"]


def test_a_tenant_at_its_cap_is_skipped_and_others_go_on() -> None:
    d = Discipline(max_concurrency=10, tenants={"a": TenantShare(max_concurrency=1)})
    assert d.offer("a0", "a", "interactive", 0) == "admitted"
    assert d.offer("a1", "a", "interactive", 1) == "parked"  # its tenant is at its cap
    assert d.offer("b0", "b", "interactive", 2) == "parked"  # a job of its class waits: no queue jumping
    assert d.admit(5) == ["b0"]
    d.release("a0")
    assert d.admit(5) == ["a1"]


def test_a_capped_interactive_tenant_lets_batch_go() -> None:
    d = Discipline(max_concurrency=10, tenants={"a": TenantShare(max_concurrency=1)})
    assert d.offer("a0", "a", "interactive", 0) == "admitted"
    _park(d, [("a1", "a", "interactive"), ("z0", "z", "batch")])
    assert d.admit(5) == ["z0"]


_job = st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["interactive", "batch"]))


@settings(max_examples=300)
@given(
    jobs=st.lists(_job, min_size=1, max_size=40),
    weights=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    caps=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    cap=st.integers(1, 4),
    steps=st.lists(st.integers(1, 3), max_size=80),
)
def test_no_batch_while_an_admissible_interactive_waits_and_every_tenant_is_served_in_bounded_turns(
    jobs: list[tuple[str, str]], weights: list[int], caps: list[int], cap: int, steps: list[int]
) -> None:
    tenants = {t: TenantShare(w, c) for t, w, c in zip("abcd", weights, caps, strict=True)}
    d = Discipline(max_concurrency=cap, tenants=tenants)
    _full(d, cap)
    for i, (t, p) in enumerate(jobs):
        d.offer(f"j{i}", t, p, i)  # type: ignore[arg-type]
    prio = {f"j{i}": (t, p) for i, (t, p) in enumerate(jobs)}
    for n in [*steps, *[1] * (4 * len(jobs) + 8)]:
        if d.held:
            d.release(sorted(d.held)[0])
        got = d.admit(n)
        for rid in got:
            if prio[rid][1] == "batch":  # no interactive job of a tenant below its cap was left waiting
                left = [t for t, q in d.waiting["interactive"].items() if q and not d.capped(t)]
                assert not left, (rid, left)
    assert not any(d.waiting[p] for p in ("interactive", "batch"))  # everything was served


@settings(max_examples=300)
@given(
    jobs=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=60),
    weights=st.lists(st.integers(1, 4), min_size=4, max_size=4),
)
def test_a_waiting_tenant_is_served_before_the_others_get_more_than_their_quanta(
    jobs: list[str], weights: list[int]
) -> None:
    """Under a binding cap (one admission per release): while tenant t waits, the other tenants get at most
    the sum of their weights before t gets its next admission."""
    tenants = {t: TenantShare(w) for t, w in zip("abcd", weights, strict=True)}
    d = Discipline(max_concurrency=1, tenants=tenants)
    _full(d, 1)
    for i, t in enumerate(jobs):
        d.offer(f"j{i}", t, "batch", i)
    owner = {f"j{i}": t for i, t in enumerate(jobs)}
    others_since: dict[str, int] = dict.fromkeys("abcd", 0)
    for rid in _drain(d):
        t = owner[rid]
        for u in others_since:
            if u != t and d.waiting["batch"].get(u):
                others_since[u] += 1
                assert others_since[u] <= sum(tenants[x].weight for x in "abcd" if x != u), (u, others_since)
        others_since[t] = 0

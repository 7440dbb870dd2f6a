"""The key layout: shard tags in their slot ranges, the request's shard, the single-instance names unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.harness.embedded_cluster import key_slot as harness_key_slot
from sluice.schemas.keys import SLOTS, Keys, Position, key_slot, shard_index, shard_tag


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 7, 16, 100])
def test_each_shard_tag_hashes_into_its_own_equal_slot_range(shards: int) -> None:
    for i in range(shards):
        first, last = i * SLOTS // shards, (i + 1) * SLOTS // shards - 1
        tag = shard_tag(i, shards)
        assert tag.startswith(f"shard-{i}-of-{shards}-")
        assert first <= key_slot(tag) <= last
        k = int(tag.rsplit("-", 1)[1])  # the smallest such k: every smaller one falls outside
        assert all(not first <= key_slot(f"shard-{i}-of-{shards}-{j}") <= last for j in range(k))
        keys = Keys("sluice", shards, cluster=True).shard(i)
        assert {
            key_slot(keys.jobs),
            key_slot(keys.terminal),
            key_slot(keys.dead_letters),
            key_slot(keys.terminal_marker("r1")),
            key_slot(keys.dead_letter_marker("1-0")),
        } == {key_slot(tag)}


@given(st.binary(max_size=40))
def test_key_slot_is_redis_clusters(key: bytes) -> None:
    assert key_slot(key) == harness_key_slot(key)  # the harness's own CRC16, checked against CLUSTER KEYSLOT


@given(st.text(alphabet="abcXYZ019-_.:", min_size=1, max_size=40), st.integers(1, 64))
def test_a_request_goes_to_keyslot_mod_n(rid: str, shards: int) -> None:
    keys = Keys("p", shards, cluster=True)
    assert shard_index(rid, shards) == key_slot(rid) % shards
    assert keys.shard_for(rid) == keys.shard(key_slot(rid) % shards)
    assert keys.shard_for(rid).index == shard_index(rid, shards)


def test_the_single_instance_layout_keeps_its_names() -> None:
    keys = Keys("sluice")
    assert not keys.sharded and len(keys.shards) == 1
    assert (keys.jobs, keys.terminal, keys.dead_letters) == ("sluice:jobs", "sluice:terminal", "sluice:dlq")
    assert keys.shard_for("anything") == keys.shard(0)
    assert keys.terminal_marker("r") == "sluice:terminal:published:r"
    assert keys.dead_letter_marker("1-0") == "sluice:dlq:entry:1-0"
    assert keys.control == "sluice:control"


def test_a_sharded_layout_has_no_single_stream_names() -> None:
    keys = Keys("sluice", 1, cluster=True)  # a cluster: the markers need the streams' hash tag
    assert keys.sharded and keys.shard(0).jobs == "sluice:{shard-0-of-1-0}:jobs"
    with pytest.raises(ValueError, match="sharded"):
        _ = keys.jobs
    with pytest.raises(ValueError):
        Keys("sluice", 0)
    assert Keys("sluice", 3).sharded  # sharding one Redis is allowed too


# -- Position: the one reader and writer of <attempt>-<seq> -------------------------------------------


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_a_position_round_trips_through_its_entry_id(attempt: int, seq: int) -> None:
    pos = Position(attempt, seq)
    assert str(pos) == f"{attempt}-{seq}"
    assert Position.from_entry_id(str(pos)) == pos == Position.from_entry_id(str(pos).encode())


@pytest.mark.parametrize("bad", ["", "1", "1-", "-1", "1-2-3", "a-1", "1-b", " 1-2", "1-2 ", "١-٢", "1-2.0", "+1-2"])
def test_anything_but_two_ascii_digit_runs_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="not a stream entry id <attempt>-<seq>: ") as info:
        Position.from_entry_id(bad)
    assert repr(bad) in str(info.value)


def test_positions_order_as_redis_orders_entry_ids() -> None:
    ids = ["2-10", "10-1", "2-9", "1-0", "2-0", "1700000000000-3"]
    assert sorted(ids, key=Position.from_entry_id) == ["1-0", "2-0", "2-9", "2-10", "10-1", "1700000000000-3"]


def test_an_attempts_range_holds_exactly_its_entries() -> None:
    low, high = (Position.from_entry_id(b) for b in Position.attempt_range(3))
    inside = [Position(3, 0), Position(3, 1), Position(3, 2**64 - 1)]
    outside = [Position(2, 2**64 - 1), Position(4, 0)]
    assert all(low <= p <= high for p in inside) and not any(low <= p <= high for p in outside)

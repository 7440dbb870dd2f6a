"""What must hold for every request after any fault, checked straight in Redis (never through the worker).

- exactly one terminal status, and exactly one terminal-stream entry naming the request (on the request's
  terminal shard, in a sharded layout);
- per attempt: seq 1..n without gap, ``stream.start`` first, one terminal last, the contract's rules
  (``ContractChecker``); attempts are numbered 1..N and the status names the last;
- every ``raw`` reference of an event exists in the same attempt's raw log;
- the request's job entries are acked;
- no configured secret anywhere under the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.schemas.events import Event, StreamDone, StreamError, StreamStart, decode_event
from sluice.schemas.invariants import ContractChecker
from sluice.schemas.keys import Keys, Position
from sluice.schemas.states import TERMINAL_STATES as STATUS_TERMINAL_STATES

__all__ = ["RequestFacts", "assert_no_secret", "check_request"]

TERMINAL_STATES = {s.encode() for s in STATUS_TERMINAL_STATES}


@dataclass(slots=True)
class RequestFacts:
    state: str
    attempts: dict[int, list[Event]]
    terminal_entries: int

    @property
    def last(self) -> list[Event]:
        return self.attempts[max(self.attempts)]

    @property
    def provider_attempts(self) -> int:
        """Attempts that reached a provider (a stream.start naming a real provider, not a lost worker's, and not
        refused by a budget before anything was sent)."""
        return sum(
            1
            for evs in self.attempts.values()
            if evs and getattr(evs[0], "provider", "") != "unknown" and not _refused_by_budget(evs[-1])
        )


def _refused_by_budget(last: Event) -> bool:
    error = getattr(last, "error", None)
    return error is not None and getattr(error, "category", "") == "budget_exceeded"


async def check_request(redis: Any, keys: Keys, rid: str, *, group: str = "sluice-workers") -> RequestFacts:
    rk = keys.request(rid)
    status = await redis.hgetall(rk.status)
    state = status.get(b"state", b"")
    assert state in TERMINAL_STATES, (rid, status)
    entries = await redis.xrange(rk.events)
    attempts: dict[int, list[Event]] = {}
    for eid, fields in entries:
        attempt, seq = Position.from_entry_id(eid)
        ev = decode_event(fields[b"event"])
        assert ev.seq == seq and ev.stream_id == f"{rid}:{attempt}", (eid, ev)
        attempts.setdefault(attempt, []).append(ev)
    assert sorted(attempts) == list(range(1, len(attempts) + 1)), sorted(attempts)
    assert int(status[b"attempt"]) == max(attempts)
    raw_ids = {Position.from_entry_id(eid) for eid, _ in await redis.xrange(rk.raw)}
    for attempt, evs in attempts.items():
        checker = ContractChecker()
        for ev in evs:
            checker.process(ev)
        assert checker.terminal, (rid, attempt, "no terminal")
        assert isinstance(evs[0], StreamStart) and isinstance(evs[-1], StreamDone | StreamError)
        assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
        for ev in evs:
            for ref in ev.raw:
                assert (attempt, ref) in raw_ids, (rid, attempt, ev.seq, ref)
    last = attempts[max(attempts)][-1]
    assert state.decode() == ("completed" if isinstance(last, StreamDone) else last.status)  # type: ignore[union-attr]
    shard = keys.shard_for(rid)
    terminal = [f for _, f in await redis.xrange(shard.terminal) if f.get(b"request_id") == rid.encode()]
    assert len(terminal) == 1, (rid, terminal)
    assert terminal[0][b"status"] == state
    job_entry = status.get(b"job_entry", b"").decode()
    if job_entry:
        jobs = status.get(b"job_stream", b"").decode() or shard.jobs  # the stream the entry was read from
        pending = await redis.xpending_range(jobs, group, job_entry, job_entry, 1)
        assert pending == [], (rid, "job not acked", pending)
    return RequestFacts(state.decode(), attempts, len(terminal))


async def assert_no_secret(redis: Any, prefix: str, secret: str) -> None:
    needle = secret.encode()
    async for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
        kind = await redis.type(key)
        values: list[bytes] = [key]
        if kind == b"stream":
            for _, fields in await redis.xrange(key):
                values += [*fields.keys(), *fields.values()]
        elif kind == b"hash":
            h = await redis.hgetall(key)
            values += [*h.keys(), *h.values()]
        elif kind == b"string":
            values.append(await redis.get(key) or b"")
        for v in values:
            assert needle not in v, (key, v[:200])

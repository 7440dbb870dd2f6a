"""One request's scripts (claim it, append batches to its logs, finalize its status, publish its terminal)
and what one append carries (``PendingBatch``).

Rule: every call is one idempotent, fenced script (``sluice.worker.redis.scripts``) sent to the master of
the request's slot on the worker's own connections (``SlotRouter``: appends on one, claims and finalizes
on another, finalizes followed by WAIT on a third), retried until Redis answers or the outage limit passes
(then ``StorageError``); a refused epoch raises ``Fenced`` and the caller must stop at once. Nothing here
reorders: the seq is the order. An append that would go on another connection than the one that
acknowledged the request's last append (it broke and was replaced, a redirect, a failed or lost reply)
first checks that the streams still reach the last entries acknowledged before (``APPEND_AFTER``): a
failover may have lost them, and ``LogLost`` is raised instead of appending after a hole. Appends are
pinned to that connection (``ConnectionChanged``), so the check cannot be skipped by a reconnect that
happened between two appends, with nothing in flight. The append connection of the request's slot is
resolved by the first append sent without waiting, and again only after the router's map changed (a
MOVED, a reload, a failure marking it stale, ``close``), so the router is not consulted per event.

Rule (the batch, built by the attempt and stored whole by one append): the raw stream's entry layout is
defined here and read back through ``sluice.schemas.raw``: every row has ``kind``, ``event``, ``data``,
``id``, ``offset`` and ``ts``; optional fields follow as name/value pairs (``redacted``: a configured secret
was replaced; ``data_bytes``: the exact bytes where the decoded ``data`` lost them; ``body``: an HTTP error
body; ``frame``: an AWS event-stream message's exact bytes, or the message framed again with a secret redacted,
on rows of ``kind`` ``frame``). Text travels as
msgpack str (Redis's Lua cmsgpack does not read msgpack's bin type); exact bytes
travel as separate script arguments, named in the row by their position (``blobs``), because Redis values
are binary-safe and script arguments too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis
import msgspec

from sluice.normalizer.sse import SSEEvent
from sluice.schemas.events import EVENT_TAGS, BlockDelta, Event, encode_event
from sluice.schemas.keys import RequestKeys, key_slot
from sluice.schemas.raw import REDACTION_MARKER
from sluice.worker.clock import now_ms
from sluice.worker.redis import scripts
from sluice.worker.redis.pipe import ConnectionChanged, RedisPipe
from sluice.worker.redis.retry import Fenced, LogLost, is_transient, with_retry
from sluice.worker.redis.route import SlotRouter

__all__ = ["ClaimInfo", "PendingBatch", "RawRow", "RequestLog", "event_tag"]

_TWO_EMPTY = b"$0\r\n\r\n$0\r\n\r\n"  # how pack_command ends with two empty arguments
_TERMINAL_MAXLEN = 1_000_000

# index, kind, event, data, id, offset, ts, then name/value pairs (a value that is an int names a blob)
RawRow = tuple[object, ...]

_PACK = msgspec.msgpack.Encoder().encode


def event_tag(ev: Event) -> str:
    return EVENT_TAGS[type(ev)]


_DELTA_TAG = EVENT_TAGS[BlockDelta]
_MARKER_BYTES = REDACTION_MARKER.encode()


@dataclass(slots=True)
class PendingBatch:
    """Raw rows and events waiting for one append call, in order."""

    raw: list[RawRow] = field(default_factory=list)
    events: list[tuple[int, str, str, int]] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[Event]) -> PendingBatch:
        """A batch of contract events only (a terminal written without provider data)."""
        b = cls()
        for ev in events:
            b.add_event(ev)
        return b

    @classmethod
    def normalized(cls, raw: list[SSEEvent], events: Iterable[Event], ts: int) -> PendingBatch:
        """What one ``Normalizer.feed`` (or ``close_batch``) gave: its raw events, then its contract events."""
        b = cls()
        b.add_sse_events(raw, ts)
        for ev in events:
            b.add_event(ev)
        return b

    def add_raw(
        self, index: int, kind: str, event: str, data: str, sse_id: str, offset: int, ts: int,
        *, extra_text: dict[str, str] | None = None, extra_bytes: dict[str, bytes] | None = None,
    ) -> None:  # fmt: skip
        row: list[object] = [index, kind, event, data, sse_id, offset, ts]
        for name, text in (extra_text or {}).items():
            row += [name, text]
        for name, blob in (extra_bytes or {}).items():
            self.blobs.append(blob)
            row += [name, len(self.blobs)]  # 1-based: the script reads ARGV[5 + n]
        self.raw.append(tuple(row))

    def add_event(self, ev: Event) -> None:
        # As str, not bytes: Redis's Lua cmsgpack does not read msgpack's bin type.
        if type(ev) is BlockDelta:  # nearly every event, and the only visible kind: the shortest way
            self.events.append((ev.seq, _DELTA_TAG, encode_event(ev).decode(), 1))
            return
        self.events.append((ev.seq, event_tag(ev), encode_event(ev).decode(), 0))

    def add_sse_events(self, sse: list[SSEEvent], ts: int) -> None:
        for e in sse:
            if e.frame is not None:  # an AWS event-stream message: its exact bytes beside the decoded fields
                marked = {"redacted": "1"} if _MARKER_BYTES in e.frame else None
                frame = {"frame": e.frame}
                self.add_raw(
                    e.index, "frame", e.event, e.data, e.id, e.offset, ts, extra_text=marked, extra_bytes=frame
                )
                continue
            redacted = REDACTION_MARKER in e.data or REDACTION_MARKER in e.event or REDACTION_MARKER in e.id
            if not (redacted or e.unframed or e.data_bytes is not None):  # nearly every event: the short way
                self.raw.append((e.index, "sse", e.event, e.data, e.id, e.offset, ts))
                continue
            text = {"redacted": "1"} if redacted else {}
            if e.unframed:
                text["unframed"] = "1"
            blobs = {"data_bytes": e.data_bytes} if e.data_bytes is not None else None
            self.add_raw(e.index, "sse", e.event, e.data, e.id, e.offset, ts, extra_text=text, extra_bytes=blobs)

    def add_tail(self, index: int, tail: bytes, offset: int, ts: int) -> None:
        """The bytes of an unfinished event the end of the stream cut off (``kind`` ``tail``)."""
        if tail:
            redacted = {"redacted": "1"} if REDACTION_MARKER.encode() in tail else {}
            self.add_raw(index, "tail", "", "", "", offset, ts, extra_text=redacted, extra_bytes={"data_bytes": tail})

    def packed(self) -> tuple[bytes, bytes]:
        """The script's two packed arguments (raw rows, events); ``blobs`` follow them when there are any."""
        return _PACK(self.raw), _PACK(self.events)

    def __len__(self) -> int:
        return len(self.raw) + len(self.events)


@dataclass(slots=True)
class ClaimInfo:
    outcome: str  # run | takeover | duplicate | done
    epoch: int
    attempt: int
    visible: bool
    cancel: bool
    published: bool


class RequestLog:
    def __init__(self, router: SlotRouter, keys: RequestKeys, *, maxlen: int = 0, outage_limit: float = 30.0) -> None:
        self.router = router
        self.keys = keys
        self.maxlen = maxlen
        self.outage_limit = outage_limit
        self._append_keys = [keys.status, keys.raw, keys.events]
        self.slot = key_slot(keys.status)  # every key of the request shares it (one hash tag)
        self._head: tuple[tuple[int, int], bytes] | None = None  # (epoch, attempt) and its packed head
        self.epoch = 0
        # The last raw index and seq acknowledged per attempt (-1: none), and whether the next append checks
        # that Redis still holds them.
        self.stored: dict[int, tuple[int, int]] = {}
        self._verify_next = False
        # The connection that acknowledged the last append (None: none yet), and the one the append in flight
        # went on: an append on any other connection checks first (the module docstring says why).
        self._acked_on: int | None = None
        self._sent_on: int | None = None
        self._pipe: RedisPipe | None = None  # the append connection to the slot's master, as of ``_routed``
        self._routed = -1  # the router's ``map_version`` ``_pipe`` was resolved at

    async def _run(self, purpose: str, source: str, keys: list[str], args: list[object]) -> Any:
        """One script on the master of ``keys[0]``'s slot, retrying transient connection errors with back-off
        (the scripts are idempotent). Raises ``StorageError`` once Redis stayed away past the outage limit."""
        slot, sha = key_slot(keys[0]), scripts.sha(source)

        async def once() -> Any:
            res, _ = await self.router.evalsha(purpose, slot, sha, source, keys, args)
            return res

        return await with_retry(once, outage_limit=self.outage_limit)

    async def _run_and_wait(self, source: str, keys: list[str], args: list[object], wait: tuple[int, int]) -> Any:
        """A script followed by ``WAIT replicas timeout_ms`` on the same connection (so it counts the replicas
        holding every earlier write to that master, the request's appends included), retried like ``_run``
        (the scripts write even when sent again, so the WAIT always follows a write of its own connection):
        (reply, replicas that acknowledged)."""
        slot, sha = key_slot(keys[0]), scripts.sha(source)

        async def once() -> tuple[Any, int]:
            res, acked = await self.router.evalsha("durable", slot, sha, source, keys, args, wait=wait)
            return res, int(acked or 0)

        return await with_retry(once, outage_limit=self.outage_limit)

    async def claim(
        self,
        *,
        job_entry: str,
        worker: str,
        request_id: str,
        route: str,
        model: str,
        metadata: dict[str, str],
        normalizer_version: str,
        contract_version: str,
        job_stream: str = "",
        token: str | None = None,
    ) -> ClaimInfo:
        """Mark the request running under a new epoch (or learn it is done, a duplicate, or a takeover).
        The token makes a claim sent again after a lost reply answer as the first one did; a job admitted by
        its route's capacity store claims with its lease token (the permit and the epoch are one claim's)."""
        token = token or f"{worker}:{uuid.uuid4().hex}"
        res = await self._run(
            "control",
            scripts.CLAIM,
            [self.keys.status],
            [
                token,
                job_entry,
                worker,
                now_ms(),
                route,
                model,
                msgspec.json.encode(metadata),
                self.keys.raw,
                self.keys.events,
                self.maxlen,
                normalizer_version,
                contract_version,
                request_id,
                job_stream,
            ],
        )
        f = [x.decode() if isinstance(x, bytes) else str(x) for x in res]
        self.epoch = int(f[1])
        return ClaimInfo(f[0], int(f[1]), int(f[2]), f[3] == "1", f[4] == "1", f[5] == "1")

    # -- appends --------------------------------------------------------------------------------------------

    def send_append(self, attempt: int, batch: PendingBatch) -> asyncio.Future[Any] | None:
        """Write one append on the append connection to the request's master and return its reply's future
        at once (give its result to ``check_append``; on an error, ``append_again`` the same batch: appends
        are idempotent), or None when only the waiting ``append`` can send it now (no live connection, a
        stale slot map, a batch with blobs)."""
        if batch.blobs:  # the packed head has room for the two batch arguments only
            return None
        pipe = self._pipe
        if pipe is None or self._routed != self.router.map_version:  # the first append, or the map changed
            self._routed = self.router.map_version
            pipe = self._pipe = self.router.pipe_now("append", self.slot)
            if pipe is None:
                return None
        conn = pipe.connection_id
        if conn is None:
            return None
        if self._acked_on is not None and conn != self._acked_on:
            self._verify_next = True  # a new connection since the last acknowledged append
            return None
        self._sent_on = conn
        raw, events = batch.packed()
        packed = b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (self._append_head(attempt), len(raw), raw, len(events), events)
        return pipe.send_packed_nowait(packed)

    def _append_head(self, attempt: int) -> bytes:
        """The RESP of an append call up to its two packed batch arguments: the same bytes for every batch of
        an attempt, so they are packed once."""
        head = self._head
        if head is None or head[0] != (self.epoch, attempt):
            fixed = (self.epoch, attempt)
            args = ("EVALSHA", scripts.sha(scripts.APPEND), 3, *self._append_keys, *fixed, self.maxlen, b"", b"")
            head = self._head = (fixed, hiredis.pack_command(cast(Any, args))[: -len(_TWO_EMPTY)])
        return head[1]

    def check_append(self, res: object, attempt: int, batch: PendingBatch) -> None:
        """Record an append's reply. Raises ``Fenced`` when it says the request was taken over."""
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        self._verify_next = False
        self._acked_on = self._sent_on
        raw, seq = self.stored.get(attempt, (-1, -1))
        last_raw = cast(int, batch.raw[-1][0]) if batch.raw else raw
        self.stored[attempt] = (last_raw, batch.events[-1][0] if batch.events else seq)

    def assume_stored(self, attempt: int, raw: int, seq: int) -> None:
        """What Redis holds of the attempt now (read back after ``LogLost``): the next append follows it."""
        self.stored[attempt] = (raw, seq)
        self._verify_next = False
        self._acked_on = None  # read back just now: what Redis holds is known, wherever the next append goes

    async def append(self, attempt: int, batch: PendingBatch) -> None:
        """Store one batch and wait for its reply. Raises ``Fenced``, ``LogLost`` or ``StorageError``."""
        if not len(batch):
            return
        args = [self.epoch, attempt, self.maxlen, *batch.packed(), *batch.blobs]
        if self._verify_next:
            res = await self._append_after(attempt, args)
        else:
            try:  # the first try without the retry wrapper's closures: this runs once per batch
                res, self._sent_on = await self.router.evalsha_on(
                    "append",
                    self.slot,
                    scripts.sha(scripts.APPEND),
                    scripts.APPEND,
                    self._append_keys,
                    args,
                    self._acked_on,
                )
            except Exception as exc:
                if not (is_transient(exc) or isinstance(exc, ConnectionChanged)):
                    raise
                self._verify_next = True
                res = await self._append_after(attempt, args)
        self.check_append(res, attempt, batch)

    async def append_again(self, attempt: int, batch: PendingBatch) -> None:
        """The batch whose sent append failed (a broken connection, an overdue reply, a redirect): stored
        after checking that Redis still holds what it acknowledged before (a failover may have lost it).
        Raises as ``append``."""
        self._verify_next = True
        await self.append(attempt, batch)

    async def _append_after(self, attempt: int, args: list[object]) -> object:
        raw, seq = self.stored.get(attempt, (-1, -1))
        checked = [*args, f"{raw} {seq}"]

        async def once() -> Any:
            res, self._sent_on = await self.router.evalsha_on(
                "append",
                self.slot,
                scripts.sha(scripts.APPEND_AFTER),
                scripts.APPEND_AFTER,
                self._append_keys,
                checked,
                None,
            )
            return res

        res = await with_retry(once, outage_limit=self.outage_limit)
        if res in (b"gap", "gap"):
            raise LogLost(
                f"Redis no longer holds appends it acknowledged (raw {raw}, seq {seq} of attempt {attempt}): "
                "a failover lost them",
                attempt,
            )
        return res

    # -- the end --------------------------------------------------------------------------------------------

    async def finalize(
        self, ttl: int, fields: dict[str, str | int], *, wait: tuple[int, int] | None = None
    ) -> int | None:
        """Set the final status fields and the retention TTL. With ``wait`` (replicas, timeout ms), WAIT on
        the connection that wrote them and return how many replicas acknowledged the request's writes.
        Raises ``Fenced`` or ``StorageError``."""
        keys, args = [self.keys.status, self.keys.raw, self.keys.events], [self.epoch, ttl, *_flat(fields)]
        acked: int | None = None
        if wait is None:
            res = await self._run("control", scripts.FINALIZE, keys, args)
        else:
            res, acked = await self._run_and_wait(scripts.FINALIZE, keys, args, wait)
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        return acked

    async def finalize_and_read(self, ttl: int, fields: dict[str, str | int], names: list[str]) -> list[bytes | None]:
        """``finalize`` (without a WAIT) with the status hash's ``names`` read back in the same write on the
        same connection, so after the script: one round trip for both. Raises ``Fenced`` or ``StorageError``."""
        keys, args = [self.keys.status, self.keys.raw, self.keys.events], [self.epoch, ttl, *_flat(fields)]
        sha = scripts.sha(scripts.FINALIZE)

        async def once() -> tuple[Any, Any]:
            # Both queued in this loop tick: the pipe writes them together and answers in order.
            stored = asyncio.ensure_future(self.router.evalsha("control", self.slot, sha, scripts.FINALIZE, keys, args))
            read = asyncio.ensure_future(self.router.call("control", self.slot, "HMGET", self.keys.status, *names))
            try:
                (res, _), vals = await asyncio.gather(stored, read)
            except BaseException:
                for fut in (stored, read):
                    fut.cancel()
                    fut.add_done_callback(_retrieved)
                raise
            return res, vals

        res, vals = await with_retry(once, outage_limit=self.outage_limit)
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        return cast(list[bytes | None], vals)

    async def read_status(self, names: list[str]) -> list[bytes | None]:
        """The status hash's ``names`` (HMGET), on the control connection. Raises ``StorageError``."""
        return cast(list[bytes | None], await self._command("HMGET", self.keys.status, *names))

    async def mark_published(self) -> None:
        """Record that the terminal entry is published (a later claim then has nothing to publish)."""
        await self._command("HSET", self.keys.status, "published", "1")

    async def _command(self, *args: str) -> Any:
        """One idempotent plain command on the request's keys, retried like ``_run``."""
        return await with_retry(lambda: self.router.call("control", self.slot, *args), outage_limit=self.outage_limit)

    async def publish(
        self, stream: str, marker: str, ttl: int, entry: dict[str, str], *, wait: tuple[int, int] | None = None
    ) -> str:
        """Add the request's terminal-stream entry once (the marker holds its id): a call sent again after a
        lost reply returns the existing id. With ``wait``, WAIT for replicas after it (best effort: the
        count is not kept). Raises ``StorageError``."""
        keys, args = [stream, marker], [ttl, _TERMINAL_MAXLEN, *_flat(entry)]
        if wait is None:
            res = await self._run("control", scripts.PUBLISH, keys, args)
        else:
            res, _ = await self._run_and_wait(scripts.PUBLISH, keys, args, wait)
        return res.decode() if isinstance(res, bytes) else str(res)


def _flat(fields: Mapping[str, str | int]) -> list[object]:
    flat: list[object] = []
    for k, v in fields.items():
        flat += [k, v]
    return flat


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # whoever failed first already raised it

"""The Redis key layout: every key sluice reads or writes is named here and nowhere else.

Rule: all keys of one request share the hash tag ``{req:<request_id>}`` so they live in one Redis Cluster
slot (the append script touches several at once). Stream entry ids of a request's logs are derived from
the attempt: ``events`` entry ``<attempt>-<seq>``, ``raw`` entry ``<attempt>-<raw index>`` (index 0 is the
HTTP response record), so a consumer can jump from a normalized event's ``raw`` refs to the raw entries and
a re-sent batch can never be appended twice. ``Position`` is that id, parsed and written in one place.

The shared streams (jobs, terminal, dead letters) form *shards*. The single-instance layout (one shard, not
a cluster) keeps the plain names ``{prefix}:jobs``, ``{prefix}:terminal``, ``{prefix}:dlq``. With
``job_shards = N > 1`` or on a Redis Cluster, shard ``i`` of ``N`` owns ``{prefix}:{<tag>}:jobs``,
``{prefix}:{<tag>}:terminal`` and ``{prefix}:{<tag>}:dlq`` and their publish-once markers, all under one hash
tag (one slot), where the tag is ``shard-<i>-of-<N>-<k>`` for the smallest ``k = 0, 1, 2, ...`` whose key
slot falls in the i-th of N equal slot ranges ``[floor(i*16384/N), floor((i+1)*16384/N) - 1]``: on a
cluster whose masters own equal contiguous slot ranges (what ``redis-cli --cluster create`` makes), the N
shards land on N different masters, or spread evenly when N exceeds them. A request's shard is
``KEYSLOT(request_id) mod N`` (request ids never contain braces, so any Redis client's key-slot function,
or ``CLUSTER KEYSLOT``, computes it). The control stream stays one key: every worker reads it.

A route with capacity limits owns a *capacity store* (``RouteKeys``, docs/design-capacity.md B.2): every key
under the one hash tag ``{prefix}:{cap:<route>}``, so each capacity script touches all of them in one slot.
The key set is fixed (request ids and tenants live in members and fields, never in key names), except the
one admit memo per worker. The wait-queue member and the lease encodings are pure functions here, so the
CLI reads what the worker's scripts write.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple, get_args

import msgspec

__all__ = [
    "PRIORITIES",
    "REQUEST_ID_RULE",
    "SLOTS",
    "Keys",
    "Lease",
    "Position",
    "Priority",
    "RequestKeys",
    "RouteKeys",
    "ShardKeys",
    "WaitRecord",
    "decode_lease",
    "decode_wait_record",
    "encode_wait_record",
    "key_slot",
    "parse_wait_member",
    "shard_index",
    "shard_tag",
    "tenant_prefix",
    "valid_request_id",
    "wait_member",
]

SLOTS = 16384

# One rule for a request id, which names its keys: the client, the worker and the relay all apply this one.
# ASCII only, so ids that look alike are alike (a Cyrillic "е" in "rеq-1" would name another request).
REQUEST_ID_RULE = "1-128 ASCII letters, digits and - _ . :"
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def valid_request_id(rid: str) -> bool:
    """Whether ``rid`` follows ``REQUEST_ID_RULE``."""
    return _REQUEST_ID.fullmatch(rid) is not None


def key_slot(key: bytes | str) -> int:
    """Redis Cluster's slot of a key: CRC16 (XMODEM) of the key, or of the part inside its first non-empty
    ``{...}``, modulo 16384."""
    k = key.encode() if isinstance(key, str) else key
    start = k.find(b"{")
    if start != -1:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1 : end]
    return binascii.crc_hqx(k, 0) % SLOTS


def shard_index(request_id: str, shards: int) -> int:
    """The job shard of a request: ``KEYSLOT(request_id) mod shards`` (the module docstring says why)."""
    return key_slot(request_id) % shards if shards > 1 else 0


@lru_cache(maxsize=64)
def _tags(shards: int) -> tuple[str, ...]:
    tags = []
    for i in range(shards):
        first, last = i * SLOTS // shards, (i + 1) * SLOTS // shards - 1
        k = 0
        while not first <= key_slot(f"shard-{i}-of-{shards}-{k}") <= last:
            k += 1
        tags.append(f"shard-{i}-of-{shards}-{k}")
    return tuple(tags)


def shard_tag(index: int, shards: int) -> str:
    """The hash tag of shard ``index`` of ``shards`` (without the braces)."""
    if not 0 <= index < shards <= SLOTS:
        raise ValueError(f"no shard {index} of {shards}")
    return _tags(shards)[index]


@dataclass(frozen=True, slots=True)
class RequestKeys:
    raw: str  # stream: provider events exactly as received
    events: str  # stream: normalized contract events
    status: str  # hash: the request's status record


@dataclass(frozen=True, slots=True)
class ShardKeys:
    """One shard's shared streams. Its publish-once markers share the shard's hash tag, so a script can
    touch a stream and its marker together on a cluster."""

    index: int
    jobs: str  # stream + consumer group: jobs
    terminal: str  # stream: one entry per finished request of this shard
    dead_letters: str  # stream: jobs that cannot run

    def terminal_marker(self, request_id: str) -> str:
        """Holds the terminal-stream entry id of a finished request: at most one entry per request."""
        return f"{self.terminal}:published:{request_id}"

    def dead_letter_marker(self, job_entry: str) -> str:
        """Holds the dead-letter entry id of a job entry of this shard: at most one dead letter per job."""
        return f"{self.dead_letters}:entry:{job_entry}"


@dataclass(frozen=True, slots=True)
class BudgetKeys:
    """One tenant's budget store (docs/capacity.md#budgets), every key under ``tag``: the tenant's budget and
    its keys' nest in one Cluster slot, so one script holds room in all of a job's budgets at once.

    ``held`` ZSET reservation id -> expiry ms, ``res`` HASH reservation id -> packed reservation (its amount
    and the ``<budget>|<window start>`` lines it counts in), ``reserved`` / ``spent`` HASH line -> micro-units
    of the currency, ``settled`` ZSET reservation id -> until ms and ``charged`` HASH reservation id -> what
    its settlement charged (a settlement sent again answers the same), ``state`` HASH (counters, line
    metadata for ``sluice budgets``), ``lines`` ZSET line -> the time it may be removed (the end of the window
    after its own; windowless lines are never in it)."""

    tenant: str
    tag: str
    state: str
    held: str
    res: str
    reserved: str
    spent: str
    settled: str
    charged: str
    lines: str

    def script_keys(self) -> list[str]:
        """The KEYS every budget script takes, in its fixed order."""
        return [self.state, self.held, self.res, self.reserved, self.spent, self.settled, self.charged, self.lines]


Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)  # in admission order: strict priority


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """One limited route's capacity store (docs/design-capacity.md B.2), every key under ``tag``.

    ``state`` HASH (limits JSON, cooldown, counters), ``held`` ZSET rid -> lease expiry ms, ``lease`` HASH
    rid -> packed lease, ``permits`` ZSET attempt token -> expiry ms (ZCARD = in flight), ``reserved`` ZSET
    token -> expiry ms, ``rpm`` / ``tpm`` ZSET token -> admission ms, ``tpm_cost`` HASH token -> tokens,
    ``wait_interactive`` / ``wait_batch`` ZSET of ``wait_member`` (all scores 0), ``waiting`` HASH rid ->
    wait record, ``ring_interactive`` / ``ring_batch`` LIST of tenants in DRR order, ``drr`` HASH
    (``d:<prio>:<tenant>`` deficit, ``n:<prio>:<tenant>`` waiting count, ``f:<tenant>`` permits held),
    ``finished`` ZSET rid -> until ms (requests whose custody ended lately: a late OFFER of one admits nothing)."""

    route: str
    tag: str
    state: str
    held: str
    lease: str
    permits: str
    reserved: str
    rpm: str
    tpm: str
    tpm_cost: str
    wait_interactive: str
    wait_batch: str
    waiting: str
    ring_interactive: str
    ring_batch: str
    drr: str
    finished: str

    def admit_memo(self, call_id: str) -> str:
        """STRING (TTL lease_ms): what the ADMIT call ``call_id`` returned, so a re-sent call answers the same.
        Call ids are ``<worker>.<n>``; one memo per call (not per worker: concurrent handoffs of one worker
        would overwrite each other's)."""
        return f"{self.tag}:admit:{call_id}"

    def wait(self, priority: Priority) -> str:
        return self.wait_interactive if priority == "interactive" else self.wait_batch

    def ring(self, priority: Priority) -> str:
        return self.ring_interactive if priority == "interactive" else self.ring_batch

    def script_keys(self, call_id: str = "-") -> list[str]:
        """The KEYS every capacity script takes, in its fixed order (the admit memo of ``call_id`` last: the
        ADMIT and the RELEASE handoff's; other scripts pass none)."""
        return [
            self.state,
            self.held,
            self.lease,
            self.permits,
            self.reserved,
            self.rpm,
            self.tpm,
            self.tpm_cost,
            self.wait_interactive,
            self.wait_batch,
            self.waiting,
            self.ring_interactive,
            self.ring_batch,
            self.drr,
            self.finished,
            self.admit_memo(call_id),
        ]


def tenant_prefix(tenant: str) -> str:
    """The lexicographic prefix of one tenant's wait members: ``<len(tenant bytes):03d><tenant>``."""
    return f"{len(tenant.encode()):03d}{tenant}"


def wait_member(tenant: str, queued_at: int, request_id: str) -> str:
    """A wait-queue member ``<len:03d><tenant><queued_at:013d><request id>``: all scores are 0, so members
    order by bytes, each tenant's jobs form one range in FIFO order of ``queued_at``."""
    return f"{tenant_prefix(tenant)}{max(0, queued_at):013d}{request_id}"


def parse_wait_member(member: bytes | str) -> tuple[str, int, str]:
    """``(tenant, queued_at, request_id)`` of a wait member. Raises ``ValueError``."""
    b = member.encode() if isinstance(member, str) else member
    if len(b) < 16 or not b[:3].isdigit():
        raise ValueError(f"not a wait member: {b[:40]!r}")
    n = int(b[:3])
    tenant, rest = b[3 : 3 + n], b[3 + n :]
    if len(rest) < 14 or not rest[:13].isdigit():
        raise ValueError(f"not a wait member: {b[:40]!r}")
    return tenant.decode(), int(rest[:13]), rest[13:].decode()


class WaitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a parked job's admission needs without reading its jobs stream (another slot): the
    ``waiting`` hash's value, and the tail of its lease once admitted."""

    tenant: str
    priority: Priority
    shard: int
    job_entry: str
    queued_at: int  # unix ms
    est_tokens: int
    job: str  # the job's JSON as enqueued


_WAIT_ENCODER = msgspec.json.Encoder()
_WAIT_DECODER = msgspec.json.Decoder(WaitRecord)


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """The ``lease`` hash's value (JSON, written by the capacity scripts): who holds an admitted job, under
    which lease token (= the CLAIM's token), and the wait member and record to requeue it on expiry."""

    token: str
    worker: str
    tenant: str
    priority: Priority
    member: str
    record: str


_LEASE_DECODER = msgspec.json.Decoder(Lease)


def decode_lease(data: bytes | str) -> Lease:
    return _LEASE_DECODER.decode(data)


def encode_wait_record(record: WaitRecord) -> bytes:
    return _WAIT_ENCODER.encode(record)


def decode_wait_record(data: bytes | str) -> WaitRecord:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a record that is not one."""
    return _WAIT_DECODER.decode(data)


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "sluice"
    job_shards: int = 1
    cluster: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.job_shards <= SLOTS:
            raise ValueError(f"job_shards must be 1..{SLOTS}, not {self.job_shards}")

    @property
    def sharded(self) -> bool:
        """Shard-tagged names (``{prefix}:{shard-...}:jobs``) instead of the single-instance ones."""
        return self.job_shards > 1 or self.cluster

    def shard(self, index: int) -> ShardKeys:
        if not self.sharded:
            if index != 0:
                raise ValueError(f"no shard {index}: the layout has one")
            p = self.prefix
            return ShardKeys(0, f"{p}:jobs", f"{p}:terminal", f"{p}:dlq")
        tag = f"{self.prefix}:{{{shard_tag(index, self.job_shards)}}}"
        return ShardKeys(index, f"{tag}:jobs", f"{tag}:terminal", f"{tag}:dlq")

    @property
    def shards(self) -> tuple[ShardKeys, ...]:
        return tuple(self.shard(i) for i in range(self.job_shards))

    def shard_for(self, request_id: str) -> ShardKeys:
        """The shard a request's job goes to and its terminal entry is published on."""
        return self.shard(shard_index(request_id, self.job_shards))

    def _single(self) -> ShardKeys:
        if self.sharded:
            raise ValueError("this layout is sharded: use shard_for(request_id) or shards")
        return self.shard(0)

    @property
    def jobs(self) -> str:
        """The jobs stream of the single-instance layout (sharded layouts: ``shard_for`` / ``shards``)."""
        return self._single().jobs

    @property
    def terminal(self) -> str:
        """The terminal stream of the single-instance layout."""
        return self._single().terminal

    @property
    def dead_letters(self) -> str:
        """The dead-letter stream of the single-instance layout."""
        return self._single().dead_letters

    def terminal_marker(self, request_id: str) -> str:
        return self._single().terminal_marker(request_id)

    def dead_letter_marker(self, job_entry: str) -> str:
        return self._single().dead_letter_marker(job_entry)

    @property
    def control(self) -> str:
        """Stream of cancel requests every worker listens to (one key in every layout)."""
        return f"{self.prefix}:control"

    @property
    def workers(self) -> str:
        """Hash: consumer name -> the routes it serves and its last heartbeat (``pipeline.membership``)."""
        return f"{self.prefix}:workers"

    @property
    def layout(self) -> str:
        """Hash recording a sharded layout (``job_shards``), so workers and producers that disagree on the
        shard count refuse to start instead of losing jobs in a shard nobody reads."""
        return f"{self.prefix}:layout"

    def route(self, name: str) -> RouteKeys:
        """The capacity store of a limited route (tag ``{prefix}:{cap:<route>}``, one Cluster slot). Route
        names with limits match ``[A-Za-z0-9_.-]+`` (the config check), so nothing moves the hash tag."""
        t = f"{self.prefix}:{{cap:{name}}}"
        return RouteKeys(
            route=name,
            tag=t,
            state=f"{t}:state",
            held=f"{t}:held",
            lease=f"{t}:lease",
            permits=f"{t}:permits",
            reserved=f"{t}:reserved",
            rpm=f"{t}:rpm",
            tpm=f"{t}:tpm",
            tpm_cost=f"{t}:tpm_cost",
            wait_interactive=f"{t}:wait:interactive",
            wait_batch=f"{t}:wait:batch",
            waiting=f"{t}:waiting",
            ring_interactive=f"{t}:ring:interactive",
            ring_batch=f"{t}:ring:batch",
            drr=f"{t}:drr",
            finished=f"{t}:finished",
        )

    def budget(self, tenant: str) -> BudgetKeys:
        """The budget store of ``tenant`` (tag ``{prefix}:{budget:<hex of the name>}``: a tenant name is any
        1-128 bytes, so it is hex-encoded to keep braces out of the hash tag)."""
        t = f"{self.prefix}:{{budget:{tenant.encode().hex()}}}"
        return BudgetKeys(
            tenant=tenant,
            tag=t,
            state=f"{t}:state",
            held=f"{t}:held",
            res=f"{t}:res",
            reserved=f"{t}:reserved",
            spent=f"{t}:spent",
            settled=f"{t}:settled",
            charged=f"{t}:charged",
            lines=f"{t}:lines",
        )

    def request(self, request_id: str) -> RequestKeys:
        tag = f"{self.prefix}:{{req:{request_id}}}"
        return RequestKeys(raw=f"{tag}:raw", events=f"{tag}:events", status=f"{tag}:status")


_MAX_ID_PART = 2**64 - 1  # each half of a Redis stream entry id is an unsigned 64-bit number


class Position(NamedTuple):
    """A stream entry id ``<attempt>-<seq>``: an event of a request's ``events`` log (seq as the event
    says) or, with the raw index as ``seq``, an entry of its ``raw`` log. Tuples order as Redis orders
    ids, so any stream's ids (Redis's own ``<ms>-<n>`` too) sort by their ``Position``."""

    attempt: int
    seq: int

    def __str__(self) -> str:
        return f"{self.attempt}-{self.seq}"

    @classmethod
    def from_entry_id(cls, entry_id: bytes | str) -> Position:
        """Two runs of ASCII digits joined by ``-``. Raises ``ValueError`` naming what was received."""
        s = entry_id.decode(errors="replace") if isinstance(entry_id, bytes) else entry_id
        a, sep, b = s.partition("-")
        if not (sep and a.isascii() and a.isdigit() and b.isascii() and b.isdigit()):
            raise ValueError(f"not a stream entry id <attempt>-<seq>: {s[:40]!r}")
        return cls(int(a), int(b))

    @staticmethod
    def attempt_range(attempt: int) -> tuple[str, str]:
        """The ``XRANGE`` bounds of one attempt's entries."""
        return f"{attempt}-0", f"{attempt}-{_MAX_ID_PART}"

"""Jobs (what producers enqueue) and the status record (what the worker publishes per request).

Rule: a job names a configured route; it can never carry a base URL, a host or a credential header
(the strict decoder refuses unknown fields, so there is nowhere to put one). A job is checked before it is
decoded: its size (``max_bytes``), its nesting (``MAX_JOB_DEPTH`` levels of arrays and objects) and its
values (``MAX_JOB_VALUES``), by a scan linear in its bytes whatever they are; every refusal, of these or of the
decoder, is a ``JobError`` with a one-line message, never another exception. ``peek_request_id`` reads the
request id of a job that was refused, bounded the same way, and never raises. The status record is a Redis
hash of strings; ``STATUS_FIELDS`` lists its fields.
"""

from __future__ import annotations

import math
import re
from itertools import accumulate

import msgspec

from sluice.schemas.errors import JobError
from sluice.schemas.events import CheckPolicy
from sluice.schemas.keys import REQUEST_ID_RULE, Priority, valid_request_id
from sluice.schemas.request import GenerateRequest

__all__ = [
    "DEFAULT_MAX_JOB_BYTES",
    "JOB_FIELD",
    "MAX_BUDGET_KEY_BYTES",
    "MAX_JOB_DEPTH",
    "MAX_JOB_VALUES",
    "MAX_TENANT_BYTES",
    "PEEK_MAX_BYTES",
    "STATUS_FIELDS",
    "Job",
    "JobTimeouts",
    "JobTooComplex",
    "JobTooLarge",
    "decode_job",
    "encode_job",
    "peek_request_id",
]

DEFAULT_MAX_JOB_BYTES = 1 << 20
JOB_FIELD = "job"  # the jobs-stream entry field holding the JSON job
MAX_TENANT_BYTES = 128
# Nesting levels of arrays and objects in a job (serde_json's default recursion limit): far above any request
# (a tool's JSON schema nests a few levels per property), far below where a recursive decoder or encoder
# meets Python's recursion limit.
MAX_JOB_DEPTH = 128
# Values (array elements and object members, counted by their separators: an empty array or object counts
# one): bounds the objects a decoded job holds, so its memory, to a few MiB whatever its bytes.
MAX_JOB_VALUES = 100_000
MAX_BUDGET_KEY_BYTES = 128


class JobTimeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-job overrides in seconds; the worker clamps them to the route's configured bounds."""

    connect: float | None = None
    first_byte: float | None = None
    idle: float | None = None
    total: float | None = None


class Job(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    route: str
    request: GenerateRequest
    request_id: str | None = None
    model: str | None = None
    timeouts: JobTimeouts | None = None
    metadata: dict[str, str] = {}
    # W3C trace context from the producer ({"traceparent": ..., "tracestate": ...}).
    trace: dict[str, str] = {}
    # Configured route names tried in order when an attempt fails before anything was visible with an
    # availability category; replaces the route's own ``fallbacks`` ([]: none). None: the route's list.
    fallbacks: list[str] | None = None
    # Capacity (docs/design-capacity.md B.5): on a limited route interactive jobs go before batch ones and
    # tenants share by deficit round robin. No tenant: the tenant "" (one tenant, FIFO, as before).
    tenant: str | None = None
    priority: Priority = "interactive"
    # The finer budget the job's spend counts against besides its tenant's (a project, an end user, a key of
    # the caller's own): ``budgets.<tenant>.keys.<budget_key>``, else ``keys."*"`` (docs/capacity.md#budgets).
    budget_key: str | None = None
    # What output that fails its checks does (docs/contract.md#output-checks); None: the route's invalid_output.
    invalid_output: CheckPolicy | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or ""


class JobTooLarge(JobError):
    """A job over the size limit: refused before it is decoded."""

    code = "job_too_large"


class JobTooComplex(JobError):
    """A job nested deeper than ``MAX_JOB_DEPTH`` or holding more than ``MAX_JOB_VALUES`` values: refused
    before it is decoded."""

    code = "job_too_complex"


class _Peek(msgspec.Struct):
    request_id: str | None = None


_JOB_DECODER = msgspec.json.Decoder(Job)
_PEEK_DECODER = msgspec.json.Decoder(_Peek)
_ENCODER = msgspec.json.Encoder()

# The status hash's fields, for consumers; all values are strings.
STATUS_FIELDS: dict[str, str] = {
    "state": "queued | running | completed | failed | interrupted",
    "request_id": "the request id",
    "job_entry": "the jobs-stream entry id that carries this request",
    "job_stream": "the jobs stream holding job_entry (sharded layouts only: entry ids repeat across shards)",
    "route": "the job's own route (where the job is held and retried; an attempt may run on a fallback)",
    "attempt_route": "the route the attempt of the terminal ran on (set when the request finishes)",
    "routes_tried": "JSON list: the route of each attempt, in attempt order (set when the request finishes)",
    "model": "the model asked for",
    "attempt": "the current attempt (1, 2, ...); stream_id is '<request_id>:<attempt>'",
    "epoch": "fencing token: bumped by every claim or takeover; appends with an older epoch are refused",
    "worker": "the consumer name of the worker running it",
    "last_seq": "the seq of the terminal event (set when the request finishes)",
    "visible": "1 once a block.delta of the current attempt was appended (no automatic retry after that)",
    "raw_count": "raw entries appended, all attempts (set when the request finishes; MAXLEN may keep fewer)",
    "event_count": "normalized events appended, all attempts (set when the request finishes)",
    "raw_stream": "key of the raw stream",
    "events_stream": "key of the normalized stream",
    "queued_at / started_at / finished_at": "unix ms",
    "stop_reason": "normalized stop reason (completed only)",
    "error": "JSON error object (failed / interrupted)",
    "usage": "JSON usage object",
    "result_hash": "sha256 of the assembled result (see sluice.schemas.result.result_hash)",
    "usage_reported": "1 when the provider reported usage, 0 when the stream ended without any (no cost then)",
    "cost": "the request's cost from its reported usage, a decimal string (when a price applies)",
    "currency": "the cost's currency",
    "prices_version": "the version of the prices the cost was computed with",
    "provider_cost": "the provider's own reported cost of the request (OpenRouter's usage.cost), a decimal string,"
    " beside the computed cost (when the provider reported one)",
    "budgets": "JSON list: the budgets the request's attempts were held and charged in, outermost first (set when"
    " the request finishes, only when it falls under any: docs/capacity.md#budgets)",
    "normalizer_version / contract_version": "versions that produced the normalized stream",
    "maxlen": "the MAXLEN cap applied to the per-request streams, or 0 for none",
    "cancel": "1 when a cancel was requested",
    "metadata": "JSON metadata echoed from the job",
    "durability": "with durability = replica: waiting (stored, WAIT under way), replica (that many replicas held the"
    " log when the terminal status was stored) or unconfirmed (the WAIT timed out first)",
    "replicas_acked": "with durability = replica: how many replicas acknowledged the log within the wait",
    "waiting_on": "a queued job parked by its route's limits: concurrency, rate, tokens, cooldown or tenant; or"
    " worker (no worker had a free run slot) (advisory; the claim deletes it)",
    "waiting_route": "the limited route a parked job waits on",
    "waiting_since": "unix ms: when the job was parked",
    "checks": "JSON: what the output was checked against (tools, tool_choice, the answer's schema; set when the"
    " request finishes, only when the job declares any: sluice.schemas.checks.CheckSpec)",
    "validator": "the validator and its version that judged the output (with checks)",
    "invalid_calls": "how many tool calls' verdicts are invalid (set when a call was checked)",
    "answer_check": "valid or invalid: the structured answer's verdict (set when an answer was checked)",
}


def encode_job(job: Job) -> bytes:
    return _ENCODER.encode(job)


def decode_job(data: bytes | str, *, max_bytes: int = DEFAULT_MAX_JOB_BYTES) -> Job:
    """Size-check, shape-check (nesting, values), then strictly decode one job. Raises ``JobTooLarge``,
    ``JobTooComplex`` or ``JobError`` with the field at fault, each with a one-line message."""
    try:
        raw = data.encode() if isinstance(data, str) else data
    except UnicodeEncodeError:  # a str with a lone surrogate
        raise JobError("job is not valid JSON: it is not UTF-8 text") from None
    if len(raw) > max_bytes:
        raise JobTooLarge(f"job is {len(raw)} bytes, over the limit of {max_bytes}")
    _check_shape(raw)
    try:
        job = _JOB_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise JobError(f"invalid job: {_one_line(exc)}") from None
    except msgspec.DecodeError as exc:
        raise JobError(f"job is not valid JSON: {_one_line(exc)}") from None
    except RecursionError:  # the shape check bounds the depth far below this: a guard, never the rule
        raise JobTooComplex(f"job nests deeper than the limit of {MAX_JOB_DEPTH}") from None
    if job.request_id is not None and not valid_request_id(job.request_id):
        raise JobError(f"invalid job: request_id must be {REQUEST_ID_RULE}")
    if job.timeouts is not None:
        _check_timeouts(job.timeouts)
    if job.tenant is not None and not 0 < len(job.tenant.encode()) <= MAX_TENANT_BYTES:
        raise JobError(f"invalid job: tenant must be 1-{MAX_TENANT_BYTES} bytes, not {len(job.tenant.encode())}")
    if job.budget_key is not None and not 0 < len(job.budget_key.encode()) <= MAX_BUDGET_KEY_BYTES:
        raise JobError(
            f"invalid job: budget_key must be 1-{MAX_BUDGET_KEY_BYTES} bytes, not {len(job.budget_key.encode())}"
        )
    return job


def _check_timeouts(t: JobTimeouts) -> None:
    """A zero, negative or infinite timeout cannot work (it fires at once, or never): refused as the
    configuration refuses it, naming the key, rather than clamped or dropped."""
    for field in msgspec.structs.fields(JobTimeouts):
        value = getattr(t, field.name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise JobError(f"invalid job: timeouts.{field.name} must be above 0 seconds, not {value!r}")


# How much of a job ``peek_request_id`` reads at most: msgspec skips the other fields without building them,
# so the parse stays bounded in memory and takes milliseconds even at this size.
PEEK_MAX_BYTES = 64 << 20
# A job too deep for msgspec is peeked by a scan of its top-level object; it reads at most this much of it.
_PEEK_SCAN_BYTES = DEFAULT_MAX_JOB_BYTES

# A JSON string, possessive (no backtracking) and also matching one left open to the end of the text, so
# every scan below is linear in the bytes whatever they are.
_STRING = rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)'
_STRINGS = re.compile(_STRING, re.DOTALL)
# The tokens of the top-level scan: a string, a run of openings or closings, a colon, a comma (scalars
# between them are not needed to find a top-level member).
_TOKENS = re.compile(_STRING + rb"|[\[{]+|[\]}]+|[:,]", re.DOTALL)
# Inside a nested value: everything up to the next run of brackets (strings skipped whole), then the run.
_NESTED = re.compile(rb'(?:[^"\[\]{}]++|' + _STRING + rb")*+([\[{]+|[\]}]+)", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def _check_shape(raw: bytes) -> None:
    """Raises ``JobTooComplex`` when ``raw`` (JSON or not) nests deeper than ``MAX_JOB_DEPTH`` or holds more than
    ``MAX_JOB_VALUES`` values, outside its strings."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_JOB_DEPTH and opens + raw.count(b",") < MAX_JOB_VALUES:
        return  # brackets and commas inside strings only over-count: nothing to scan
    bare = _STRINGS.sub(b'""', raw)
    depth = max(accumulate(map(_STEP.__getitem__, bare.translate(None, _NOT_BRACKETS))), default=0)
    if depth > MAX_JOB_DEPTH:
        raise JobTooComplex(f"job nests {depth} levels deep, over the limit of {MAX_JOB_DEPTH}")
    values = bare.count(b"[") + bare.count(b"{") + bare.count(b",")
    if values > MAX_JOB_VALUES:
        raise JobTooComplex(f"job holds about {values} values, over the limit of {MAX_JOB_VALUES}")


def peek_request_id(data: bytes | str) -> str | None:
    """Best effort, never raising: the request_id of a job that failed to decode (invalid, too large, too
    deep), so it still gets a terminal status. ``None`` when it cannot be read or the job passes
    ``PEEK_MAX_BYTES``. A job too deep for msgspec's skipping is read by a scan of its top-level object,
    over its first ``_PEEK_SCAN_BYTES``."""
    raw = data.encode(errors="surrogatepass") if isinstance(data, str) else data
    if len(raw) > PEEK_MAX_BYTES:
        return None
    try:
        rid = _PEEK_DECODER.decode(raw).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    except RecursionError:
        rid = _scan_request_id(raw[:_PEEK_SCAN_BYTES])
    return rid if rid and valid_request_id(rid) else None


def _scan_request_id(raw: bytes) -> str | None:
    """The string value of the top-level member ``request_id`` of ``raw`` (a JSON object, perhaps cut; the last
    one, as msgspec keeps), read token by token without building anything; None when there is none. Inside a
    member's value only its brackets are visited (``_NESTED`` skips the rest in one match)."""
    depth, pos = 0, 0
    found: str | None = None
    key: bytes | None = None  # the current top-level member's key, once its colon was seen
    candidate: bytes | None = None  # a top-level string that is a key if a colon follows
    while True:
        if depth >= 2:
            nested = _NESTED.match(raw, pos)
            if nested is None:
                return found  # cut inside a value
            run = nested.group(1)
            depth += len(run) if run[:1] in (b"[", b"{") else -len(run)
            pos = nested.end()
            continue
        m = _TOKENS.search(raw, pos)
        if m is None:
            return found
        tok, pos = m.group(), m.end()
        if depth <= 0:
            if tok != b"{":
                return found  # not an object, or its end
            depth = 1
        elif tok[:1] == b'"':
            if key is not None:  # a member's value
                if _is_request_id(key):
                    found = _json_string(tok)
                key = None
            else:
                candidate = tok
        elif tok == b":":
            key, candidate = candidate, None
        elif tok == b",":
            key = candidate = None
        elif tok[:1] in (b"[", b"{"):
            key = candidate = None  # a container value: not a request id
            depth += len(tok)
        else:
            depth -= len(tok)


def _is_request_id(key: bytes) -> bool:
    return key == b'"request_id"' or (b"\\" in key and _json_string(key) == "request_id")


def _json_string(tok: bytes) -> str | None:
    try:
        return msgspec.json.decode(tok, type=str)
    except msgspec.DecodeError:  # left open by the cut, or not UTF-8
        return None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

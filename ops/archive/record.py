"""The archive's format: one finished request as one gzip-compressed JSON-lines object, and its names.

Rule: the object is a pure function of what Redis held for the request (its status hash, every raw and
every normalized entry, in stream order, field order kept), so writing it again after a redelivery writes
the same bytes (gzip ``mtime`` 0, keys in a fixed order). Field values are kept byte-exact: a value that is
valid UTF-8 is a JSON string, any other is ``{"b64": ...}``. Line 1 is the ``request`` header, then one
``raw`` line per raw entry and one ``event`` line per normalized entry, and the last line is ``end`` with
the counts and the SHA-256 of every line before it, so a reader tells a missing object, a truncated one
(no ``end`` line, a cut gzip member) and an altered one (a CRC, hash or count that does not match) apart
from a mismatch of the normalizer.

Names (relative to the destination's root): the object ``log/date=<finish date>/<request_id>.a<attempt>
.jsonl.gz``; its index row ``index/date=<finish date>/<request_id>.a<attempt>.json`` (one JSON object, the
analysts' reader: ``read_json('index/date=2026-12-02/*.json')`` in DuckDB); and the pointer
``id/<request_id>.json`` naming the object and its SHA-256, written last: a request is archived once its
pointer names an object whose bytes hash to what the pointer says.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

__all__ = [
    "FORMAT",
    "ArchiveCorrupt",
    "ArchivedRequest",
    "Entry",
    "IndexRow",
    "Names",
    "Pointer",
    "decode_index",
    "decode_pointer",
    "decode_record",
    "encode_json",
    "encode_record",
    "finish_date",
    "index_row",
    "names_for",
    "pointer_name",
    "sha256_hex",
]

FORMAT = 1
Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry as redis-py returns it: (id, fields)
_ENC = msgspec.json.Encoder(order="deterministic")
_DEC = msgspec.json.Decoder()


class ArchiveCorrupt(Exception):
    """An archive object that is missing, truncated or altered; ``kind`` says which."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"archive object {kind}: {detail}")
        self.kind = kind  # "missing" | "truncated" | "altered"
        self.detail = detail


class Pointer(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    attempt: int
    object: str
    sha256: str
    bytes: int


class IndexRow(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    attempt: int
    date: str
    finished_at: int
    route: str
    model: str
    tenant: str  # metadata "tenant", "" when the job named none
    status: str
    stop_reason: str
    error_category: str
    raw_count: int
    event_count: int
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cache_write_tokens: int | None
    reasoning_tokens: int | None
    cost: str  # a decimal string, "" when no price applied
    currency: str
    prices_version: str
    usage_reported: bool
    metadata: dict[str, str]
    object: str
    sha256: str
    bytes: int
    # (contract 1.3) Output checks, for a job that declared any: invalid tool calls (None: no call checked)
    # and the structured answer's verdict ("valid" | "invalid"; "" when none was checked). Defaults, so rows
    # written before them still decode.
    invalid_calls: int | None = None
    answer_check: str = ""
    # The budgets the request was charged in (its status's ``budgets``), outermost first; [] when none.
    budgets: list[str] = []
    # The provider's own reported cost (its status's ``provider_cost``), "" when it reported none.
    provider_cost: str = ""


@dataclass(frozen=True, slots=True)
class Names:
    object: str
    index: str
    pointer: str


def finish_date(finished_at_ms: int) -> str:
    """The UTC day a request finished on (its partition), ``YYYY-MM-DD``."""
    return datetime.fromtimestamp(finished_at_ms / 1000, UTC).strftime("%Y-%m-%d")


def pointer_name(request_id: str) -> str:
    return f"id/{request_id}.json"


def names_for(request_id: str, attempt: int, finished_at_ms: int) -> Names:
    day = finish_date(finished_at_ms)
    base = f"{request_id}.a{attempt}"
    return Names(f"log/date={day}/{base}.jsonl.gz", f"index/date={day}/{base}.json", pointer_name(request_id))


def _val(v: bytes) -> str | dict[str, str]:
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(v).decode()}


def _unval(v: object) -> bytes:
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, dict) and isinstance(v.get("b64"), str):
        return base64.b64decode(v["b64"], validate=True)
    raise ValueError(f"not an archived value: {str(v)[:40]!r}")


def _fields(fields: Mapping[bytes, bytes]) -> list[list[object]]:
    return [[_val(k), _val(v)] for k, v in fields.items()]


def _unfields(pairs: object) -> dict[bytes, bytes]:
    if not isinstance(pairs, list):
        raise ValueError("fields are not a list")
    return {_unval(k): _unval(v) for k, v in pairs}


@dataclass(frozen=True, slots=True)
class ArchivedRequest:
    """One request as archived: its status hash and both logs exactly as Redis held them."""

    request_id: str
    attempt: int
    terminal: dict[str, str]  # the terminal-stream entry's fields
    status: dict[bytes, bytes]
    raw: list[Entry]
    events: list[Entry]

    @property
    def status_text(self) -> dict[str, str]:
        return {k.decode(): v.decode("utf-8", "replace") for k, v in self.status.items()}

    @property
    def finished_at(self) -> int:
        v = self.status.get(b"finished_at", b"")
        return int(v) if v.isdigit() else 0


def encode_record(req: ArchivedRequest) -> bytes:
    """The object's bytes: deterministic for the same request (see the module docstring)."""
    lines = [
        _ENC.encode(
            {
                "kind": "request",
                "format": FORMAT,
                "request_id": req.request_id,
                "attempt": req.attempt,
                "terminal": req.terminal,
                "status": _fields(req.status),
            }
        )
    ]
    lines += [_ENC.encode({"kind": "raw", "id": i.decode(), "fields": _fields(f)}) for i, f in req.raw]
    lines += [_ENC.encode({"kind": "event", "id": i.decode(), "fields": _fields(f)}) for i, f in req.events]
    body = b"".join(line + b"\n" for line in lines)
    end = _ENC.encode(
        {"kind": "end", "raw": len(req.raw), "events": len(req.events), "sha256": hashlib.sha256(body).hexdigest()}
    )
    return gzip.compress(body + end + b"\n", compresslevel=6, mtime=0)


def decode_record(data: bytes) -> ArchivedRequest:
    """The request an object holds. Raises ``ArchiveCorrupt`` (``truncated`` or ``altered``)."""
    try:
        text = gzip.decompress(data)
    except EOFError as exc:
        raise ArchiveCorrupt("truncated", f"the compressed stream ends early ({exc})") from None
    except (gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise ArchiveCorrupt("altered", f"not a valid gzip stream ({exc})") from None
    lines = text.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    try:
        docs = [_DEC.decode(line) for line in lines]
    except msgspec.DecodeError as exc:
        raise ArchiveCorrupt("altered", f"a line is not JSON ({exc})") from None
    if not docs or not isinstance(docs[-1], dict) or docs[-1].get("kind") != "end":
        raise ArchiveCorrupt("truncated", f"no end line after {len(docs)} line(s)")
    end = docs[-1]
    body = b"".join(line + b"\n" for line in lines[:-1])
    if hashlib.sha256(body).hexdigest() != end.get("sha256"):
        raise ArchiveCorrupt("altered", "the lines do not hash to the end line's sha256")
    head = docs[0]
    if not isinstance(head, dict) or head.get("kind") != "request" or head.get("format") != FORMAT:
        raise ArchiveCorrupt("altered", "the first line is not a request header of format 1")
    try:
        raw = [(d["id"].encode(), _unfields(d["fields"])) for d in docs[1:-1] if d["kind"] == "raw"]
        events = [(d["id"].encode(), _unfields(d["fields"])) for d in docs[1:-1] if d["kind"] == "event"]
        req = ArchivedRequest(
            request_id=str(head["request_id"]),
            attempt=int(head["attempt"]),
            terminal={str(k): str(v) for k, v in head["terminal"].items()},
            status=_unfields(head["status"]),
            raw=raw,
            events=events,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArchiveCorrupt("altered", f"a line does not have the archive's shape ({exc})") from None
    if (len(raw), len(events)) != (end.get("raw"), end.get("events")) or len(raw) + len(events) != len(docs) - 2:
        raise ArchiveCorrupt("altered", "the entry counts do not match the end line")
    return req


def index_row(req: ArchivedRequest, names: Names, sha256: str, size: int) -> IndexRow:
    st = req.status_text
    usage = _DEC.decode(st["usage"]) if st.get("usage") else {}
    meta: dict[str, str] = {}
    try:
        meta = msgspec.json.decode(st.get("metadata") or "{}", type=dict[str, str])
    except (msgspec.DecodeError, msgspec.ValidationError):
        meta = {}

    def num(name: str) -> int:
        v = st.get(name, "")
        return int(v) if v.isdigit() else 0

    def tok(name: str) -> int | None:
        v = usage.get(name) if isinstance(usage, dict) else None
        return v if isinstance(v, int) else None

    return IndexRow(
        request_id=req.request_id,
        attempt=req.attempt,
        date=finish_date(req.finished_at),
        finished_at=req.finished_at,
        route=st.get("route", ""),
        model=st.get("model", ""),
        tenant=meta.get("tenant", ""),
        status=st.get("state", ""),
        stop_reason=st.get("stop_reason", ""),
        error_category=req.terminal.get("error_category", ""),
        raw_count=num("raw_count"),
        event_count=num("event_count"),
        input_tokens=tok("input_tokens"),
        output_tokens=tok("output_tokens"),
        cache_read_tokens=tok("cache_read_tokens"),
        cache_write_tokens=tok("cache_write_tokens"),
        reasoning_tokens=tok("reasoning_tokens"),
        cost=st.get("cost", ""),
        currency=st.get("currency", ""),
        prices_version=st.get("prices_version", ""),
        usage_reported=st.get("usage_reported", "1" if usage else "0") == "1",
        metadata=meta,
        object=names.object,
        sha256=sha256,
        bytes=size,
        invalid_calls=num("invalid_calls") if st.get("invalid_calls", "").isdigit() else None,
        answer_check=st.get("answer_check", ""),
        budgets=_budgets(st.get("budgets", "")),
        provider_cost=st.get("provider_cost", ""),
    )


def _budgets(text: str) -> list[str]:
    try:
        return msgspec.json.decode(text or "[]", type=list[str])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []


def encode_json(doc: msgspec.Struct) -> bytes:
    return _ENC.encode(doc) + b"\n"


def decode_pointer(data: bytes) -> Pointer:
    try:
        return msgspec.json.decode(data, type=Pointer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArchiveCorrupt("altered", f"the pointer object is not valid ({exc})") from None


def decode_index(data: bytes) -> IndexRow:
    try:
        return msgspec.json.decode(data, type=IndexRow)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArchiveCorrupt("altered", f"the index row is not valid ({exc})") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

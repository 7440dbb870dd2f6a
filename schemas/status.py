"""The status record, typed: what a request's ``{prefix}:{req:<id>}:status`` hash says, read once into a
struct (numbers as ints, the error and usage as the contract's own types, metadata as a dict), so no
consumer parses JSON out of strings.

Rule: the hash stays strings (``sluice.schemas.jobs.STATUS_FIELDS`` describes it); ``Status.from_record``
is the one reader. Fields the struct does not name (added by a later version) are ignored; a value that
does not parse raises ``msgspec.ValidationError``.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from sluice.schemas.checks import CheckSpec
from sluice.schemas.events import ErrorInfo, Usage
from sluice.schemas.states import TERMINAL_STATES, RequestState

__all__ = ["Status"]

_INTS = (
    "attempt",
    "epoch",
    "last_seq",
    "raw_count",
    "event_count",
    "queued_at",
    "started_at",
    "finished_at",
    "maxlen",
    "waiting_since",
    "invalid_calls",
)
_JSON = {
    "error": ErrorInfo,
    "usage": Usage,
    "metadata": dict[str, str],
    "routes_tried": list[str],
    "checks": CheckSpec,
    "budgets": list[str],
}


class Status(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    state: RequestState
    route: str = ""  # the job's own route
    attempt_route: str = ""  # the route the terminal's attempt ran on (a fallback, or the job's own)
    routes_tried: list[str] = []  # the route of each attempt, in order
    model: str = ""
    attempt: int = 0  # the current attempt; its stream is "<request_id>:<attempt>"
    epoch: int = 0
    worker: str = ""
    job_entry: str = ""
    last_seq: int | None = None  # the terminal event's seq, once finished
    visible: bool = False  # a block.delta of the current attempt was appended
    raw_count: int | None = None
    event_count: int | None = None
    queued_at: int | None = None  # unix ms
    started_at: int | None = None
    finished_at: int | None = None
    stop_reason: str | None = None
    error: ErrorInfo | None = None
    usage: Usage | None = None
    result_hash: str | None = None
    normalizer_version: str | None = None
    contract_version: str | None = None
    maxlen: int = 0
    cancel: bool = False  # a cancel was requested
    metadata: dict[str, str] = {}
    # cost (sluice.worker.cost): usage_reported always once finished; the rest when a price applied
    usage_reported: bool | None = None
    cost: str | None = None  # a decimal string
    currency: str | None = None
    prices_version: str | None = None
    provider_cost: str | None = None  # the provider's own reported cost (OpenRouter's usage.cost)
    # The budgets its attempts were charged in (docs/capacity.md#budgets), once finished; [] when none.
    budgets: list[str] = []
    # A queued job parked by its route's limits (advisory; the claim deletes them): the limit it waits on
    # (concurrency, rate, tokens, cooldown, tenant), the route, and since when (unix ms).
    waiting_on: str | None = None
    waiting_route: str | None = None
    waiting_since: int | None = None
    # Output checks (contract 1.3), once finished, for a job that declared anything to check: the declarations,
    # the validator that judged, how many tool calls were invalid (None: no call checked), the answer's verdict.
    checks: CheckSpec | None = None
    validator: str | None = None
    invalid_calls: int | None = None
    answer_check: str | None = None  # "valid" | "invalid"; None: no answer checked

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> Status:
        """The typed view of a status hash (decoded to ``str``). Raises ``msgspec.ValidationError``."""
        doc: dict[str, object] = {}
        names = cls.__struct_fields__
        for key, value in record.items():
            if key not in names or value == "":
                continue
            if key in _INTS:
                doc[key] = int(value) if value.lstrip("-").isdigit() else value  # not digits: the check names it
            elif key in ("visible", "cancel", "usage_reported"):
                doc[key] = value == "1"
            elif key in _JSON:
                try:
                    doc[key] = msgspec.json.decode(value, type=_JSON[key])
                except msgspec.DecodeError as exc:
                    raise msgspec.ValidationError(f"{key}: {exc}") from None
            else:
                doc[key] = value
        return msgspec.convert(doc, cls)

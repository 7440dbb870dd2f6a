"""sluice: streaming LLM provider output as one ordered, provable event log on Redis Streams.

The public API: ``SluiceClient`` (enqueue, follow, fetch results, cancel), the assembled ``Result``, the
contract's event types and ``CONTRACT_VERSION``, and the job and request shapes. The installed package
maps the repository's folders: ``sluice`` is ``ops/`` (this file, the CLI, client, relay, fake provider
and benchmarks), ``sluice.worker`` is ``worker/``, ``sluice.normalizer`` is ``normalizer/`` and
``sluice.schemas`` is ``schemas/``.

Names resolve on first use (PEP 562), so importing the pure core (``sluice.normalizer``,
``sluice.schemas``) never loads the client's Redis dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.client import (
        InvalidJob,
        RedisCommandError,
        RedisUnavailable,
        ResultTimeout,
        SluiceClient,
        SluiceError,
        UnknownRequest,
    )
    from sluice.schemas.events import (
        CONTRACT_VERSION,
        BlockDelta,
        BlockStart,
        BlockStop,
        Event,
        StreamDone,
        StreamError,
        StreamStart,
        StreamWarning,
    )
    from sluice.schemas.jobs import Job
    from sluice.schemas.request import GenerateRequest, Message
    from sluice.schemas.result import Result, ResultBlock
    from sluice.schemas.status import Status

__all__ = [
    "CONTRACT_VERSION",
    "BlockDelta",
    "BlockStart",
    "BlockStop",
    "Event",
    "GenerateRequest",
    "InvalidJob",
    "Job",
    "Message",
    "RedisCommandError",
    "RedisUnavailable",
    "Result",
    "ResultBlock",
    "ResultTimeout",
    "SluiceClient",
    "SluiceError",
    "Status",
    "StreamDone",
    "StreamError",
    "StreamStart",
    "StreamWarning",
    "UnknownRequest",
]

_CLIENT_NAMES = (
    "SluiceClient", "SluiceError", "InvalidJob", "UnknownRequest", "ResultTimeout", "RedisUnavailable",
    "RedisCommandError",
)  # fmt: skip
_HOME = {
    **dict.fromkeys(_CLIENT_NAMES, "sluice.client"),
    "Status": "sluice.schemas.status",
    "Job": "sluice.schemas.jobs",
    "GenerateRequest": "sluice.schemas.request",
    "Message": "sluice.schemas.request",
    "Result": "sluice.schemas.result",
    "ResultBlock": "sluice.schemas.result",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME.get(name, "sluice.schemas.events")), name)
    globals()[name] = value
    return value

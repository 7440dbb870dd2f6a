"""sluice: streaming LLM provider output as one ordered, provable event log on Redis Streams.

The public API: ``SluiceClient`` (enqueue, follow, fetch results, cancel) and every error it raises
(``SluiceError`` and its subclasses), the assembled ``Result``, the contract's event types and
``CONTRACT_VERSION``, the job and request shapes, and ``__version__`` (the installed distribution's,
``sluice-llm``). The installed package maps the repository's folders: ``sluice`` is ``ops/`` (this file,
the client in ``client/``, the CLI, the relay, the benchmarks, and in ``harness/`` the embedded Redis,
cluster and fake provider the demo and the tests start), ``sluice.worker`` is ``worker/``,
``sluice.normalizer`` is ``normalizer/`` and ``sluice.schemas`` is ``schemas/``.

Names resolve on first use (PEP 562), so importing the pure core (``sluice.normalizer``,
``sluice.schemas``) never loads the client's Redis dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.client import (
        InvalidJob,
        LayoutMismatch,
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

    __version__: str

__all__ = [
    "CONTRACT_VERSION",
    "BlockDelta",
    "BlockStart",
    "BlockStop",
    "Event",
    "GenerateRequest",
    "InvalidJob",
    "Job",
    "LayoutMismatch",
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
    "SluiceClient",
    "SluiceError",
    "InvalidJob",
    "UnknownRequest",
    "ResultTimeout",
    "RedisUnavailable",
    "RedisCommandError",
    "LayoutMismatch",
)
_HOME = {
    **dict.fromkeys(_CLIENT_NAMES, "sluice.client"),
    "Status": "sluice.schemas.status",
    "Job": "sluice.schemas.jobs",
    "GenerateRequest": "sluice.schemas.request",
    "Message": "sluice.schemas.request",
    "Result": "sluice.schemas.result",
    "ResultBlock": "sluice.schemas.result",
}


_DISTRIBUTION = "sluice-llm"  # the name on PyPI (``pip install sluice-llm``); the import name is ``sluice``


def _version() -> str:
    """The installed distribution's version; in a source checkout that was never installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_DISTRIBUTION)
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            return str(
                tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"][
                    "version"
                ]
            )
        except (OSError, ValueError, KeyError):
            return "0+unknown"


def __getattr__(name: str) -> Any:
    if name not in __all__ and name != "__version__":
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    if name == "__version__":
        value: Any = _version()
    else:
        value = getattr(importlib.import_module(_HOME.get(name, "sluice.schemas.events")), name)
    globals()[name] = value
    return value

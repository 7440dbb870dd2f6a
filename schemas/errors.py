"""One error hierarchy for all of sluice, with stable codes and categories.

Rule: everything raised on purpose inherits from ``WorkerError``. ``code`` is stable (metrics, logs);
``category`` is the contract's error category it maps to in a ``stream.error``; ``retryable`` says
whether running the request again may help. Messages are safe to show: no secrets, no prompt text.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractViolation",
    "JobError",
    "LimitExceeded",
    "ProtocolError",
    "ProviderProtocolError",
    "StorageError",
    "UnknownDialect",
    "WorkerError",
]


class WorkerError(Exception):
    code: str = "internal"
    category: str = "unknown"
    retryable: bool = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)

    @property
    def message(self) -> str:
        return str(self)


class ProtocolError(WorkerError):
    """The stream broke a protocol; never retried."""

    code = "protocol"
    category = "protocol"


class ProviderProtocolError(ProtocolError):
    """The peer (the provider) broke its own protocol: malformed SSE, invalid JSON, bad sequencing."""

    code = "provider_protocol"

    def __init__(self, message: str, *, block_index: int | None = None) -> None:
        super().__init__(message)
        self.block_index = block_index


class ContractViolation(ProtocolError):
    """Sluice itself tried to emit an event the contract forbids (our bug, h11's LocalProtocolError)."""

    code = "contract_violation"


class LimitExceeded(WorkerError):
    """A configured bound (line, event, total bytes, events, tool arguments, job size) was passed."""

    code = "limit_exceeded"
    category = "limit_exceeded"

    def __init__(self, what: str, limit: int, *, block_index: int | None = None) -> None:
        super().__init__(f"{what} exceeds the limit of {limit}")
        self.what, self.limit, self.block_index = what, limit, block_index


class UnknownDialect(WorkerError):
    code = "unknown_dialect"
    category = "invalid_request"


class ConfigError(WorkerError):
    code = "config"
    category = "invalid_request"


class JobError(WorkerError):
    """The job itself is unusable (undecodable, oversized, unknown route); it is dead-lettered."""

    code = "job"
    category = "invalid_request"


class StorageError(WorkerError):
    """Redis failed."""

    code = "storage"
    category = "unknown"
    retryable = True

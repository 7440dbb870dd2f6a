"""The Redis key layout: every key sluice reads or writes is named here and nowhere else.

Rule: all keys of one request share the hash tag ``{req:<request_id>}`` so they live in one Redis Cluster
slot (the append script touches several at once); the global streams (jobs, terminal, dead letters,
control) are one key each. Stream entry ids of a request's logs are derived from the attempt:
``events`` entry ``<attempt>-<seq>``, ``raw`` entry ``<attempt>-<raw index>`` (index 0 is the HTTP
response record), so a consumer can jump from a normalized event's ``raw`` refs to the raw entries and a
re-sent batch can never be appended twice.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys", "RequestKeys", "event_entry_id", "parse_entry_id", "raw_entry_id"]


@dataclass(frozen=True, slots=True)
class RequestKeys:
    raw: str  # stream: provider events exactly as received
    events: str  # stream: normalized contract events
    status: str  # hash: the request's status record


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "sluice"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def terminal(self) -> str:
        return f"{self.prefix}:terminal"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dlq"

    @property
    def workers(self) -> str:
        """Hash: consumer name -> the routes it serves and its last heartbeat (``sluice.worker.membership``)."""
        return f"{self.prefix}:workers"

    def terminal_marker(self, request_id: str) -> str:
        """Holds the terminal-stream entry id of a finished request: at most one entry per request. Named
        after the terminal stream, so a Cluster hash tag on that key would cover both."""
        return f"{self.terminal}:published:{request_id}"

    def dead_letter_marker(self, job_entry: str) -> str:
        """Holds the dead-letter entry id of a job entry: at most one dead letter per job."""
        return f"{self.dead_letters}:entry:{job_entry}"

    @property
    def control(self) -> str:
        """Stream of cancel requests every worker listens to."""
        return f"{self.prefix}:control"

    def request(self, request_id: str) -> RequestKeys:
        tag = f"{self.prefix}:{{req:{request_id}}}"
        return RequestKeys(raw=f"{tag}:raw", events=f"{tag}:events", status=f"{tag}:status")


def event_entry_id(attempt: int, seq: int) -> str:
    return f"{attempt}-{seq}"


def raw_entry_id(attempt: int, index: int) -> str:
    return f"{attempt}-{index}"


def parse_entry_id(entry_id: bytes | str) -> tuple[int, int]:
    """``<attempt>-<seq>`` (events) or ``<attempt>-<index>`` (raw) as two ints. Raises ``ValueError``."""
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    a, sep, b = s.partition("-")
    if not sep or not a.isdigit() or not b.isdigit():
        raise ValueError(f"not a stream entry id: {s!r}")
    return int(a), int(b)

"""The credential interface: what a route's credential does to an outgoing request, and what it holds.

Rule: a ``Credential`` belongs to one route (it may share its source with others: one token for every
route on the same service-account file). ``apply(request)`` is given the request as it will be sent
(method, full URL, every header but the credential's, the body bytes: SigV4 signs all of them) and
returns the headers to add; it may block on IO (a token refresh, a credential chain), never on the event
loop. ``current_secrets()`` is every secret value it holds or derived so far (a static key, the access
token in use, a session token, the last signature): the redactor removes each from what a provider sends.
A credential that cannot be obtained raises ``CredentialUnavailable``: the attempt fails
``authentication``, not retried, with a message naming the route and the source, never a secret.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.schemas.errors import WorkerError

__all__ = ["Credential", "CredentialUnavailable", "OutgoingRequest"]


@dataclass(frozen=True, slots=True, repr=False)
class OutgoingRequest:
    """The request a credential is applied to. Header names are lower case; ``url`` has its query."""

    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes

    def __repr__(self) -> str:  # the body holds prompt text
        return f"OutgoingRequest(method={self.method!r}, url={self.url!r}, body=<{len(self.body)} bytes>)"


class CredentialUnavailable(WorkerError):
    """The route's credential could not be obtained (unset variable, unreadable file, refused refresh)."""

    code = "authentication"
    category = "authentication"
    retryable = False

    def __init__(self, route: str, source: str, reason: str) -> None:
        super().__init__(f"route {route!r}: no credential from {source}: {reason}")
        self.route, self.source = route, source


class Credential(abc.ABC):
    """One route's credential. ``source`` says where it comes from (never what it is), for messages."""

    route: str
    source: str

    @abc.abstractmethod
    async def apply(self, request: OutgoingRequest) -> Mapping[str, str]:
        """The headers to add to ``request``. Raises ``CredentialUnavailable``."""

    @abc.abstractmethod
    def current_secrets(self) -> list[str]:
        """Every secret value held or derived so far (may grow after ``apply``)."""

    async def aclose(self) -> None:  # noqa: B027 - most credentials hold nothing to close
        """Release what the credential holds (a client, a thread)."""

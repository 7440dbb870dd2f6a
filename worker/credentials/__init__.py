"""Route credentials: one object per route that adds its credential to each outgoing request.

Rule: a route's ``auth`` kind names the module that makes its credential (``KIND_MODULES``), imported
only when a route uses it; each such module has ``make(ctx: CredentialContext) -> Credential``. Kinds
backed by an optional extra (``google``: ``sluice-llm[google]``; ``aws-sigv4``: ``sluice-llm[aws]``) are
refused at configuration time when the extra is missing (``unavailable``). ``CredentialStore`` holds
every route's credential for one worker process and the secrets they hold, for the redactor.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from sluice.normalizer.requests.auth import AUTH_KINDS, DIALECT_AUTH, AuthKind
from sluice.worker.credentials.base import Credential, CredentialUnavailable, OutgoingRequest
from sluice.worker.extras import install_hint

if TYPE_CHECKING:
    from sluice.worker.config import Route

__all__ = [
    "AUTH_KINDS",
    "KIND_MODULES",
    "Credential",
    "CredentialContext",
    "CredentialStore",
    "CredentialUnavailable",
    "OutgoingRequest",
    "auth_kind",
    "unavailable",
]

_STATIC = "sluice.worker.credentials.static"
KIND_MODULES: Mapping[AuthKind, str] = {
    "bearer": _STATIC,
    "x-api-key": _STATIC,
    "api-key": _STATIC,
    "x-goog-api-key": _STATIC,
    "none": _STATIC,
    "google": "sluice.worker.credentials.google",
    "aws-sigv4": "sluice.worker.credentials.aws",
}
# kind -> (the module its extra provides, the extra's name)
_EXTRAS: Mapping[AuthKind, tuple[str, str]] = {"google": ("google.auth", "google"), "aws-sigv4": ("botocore", "aws")}

T = TypeVar("T")


def auth_kind(route: Route) -> AuthKind:
    """The route's ``auth``, else its dialect's own header style."""
    return cast(AuthKind, route.auth) if route.auth else DIALECT_AUTH.get(route.dialect, "bearer")


def unavailable(kind: AuthKind) -> str | None:
    """Why ``kind`` cannot be used in this installation (one line: the extra to install), or None."""
    if kind in _EXTRAS:
        module, extra = _EXTRAS[kind]
        if importlib.util.find_spec(KIND_MODULES[kind]) is None:
            return f'auth = "{kind}" is not implemented in this build of sluice'
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            return f'auth = "{kind}" needs the {extra} extra: {install_hint(extra)}'
    return None


class _Maker(Protocol):
    def __call__(self, ctx: CredentialContext) -> Credential: ...


@dataclass(slots=True)
class CredentialContext:
    """What a kind's ``make`` is given: the route (name and settings), the environment, and ``shared``,
    where credentials with the same source meet (``ctx.shared_source(key, factory)``)."""

    route_name: str
    route: Route
    env: Mapping[str, str]
    _shared: dict[object, Any]

    def shared_source(self, key: object, factory: Callable[[], T]) -> T:
        """The one object for ``key`` in this worker (made by ``factory`` the first time)."""
        if key not in self._shared:
            self._shared[key] = factory()
        value: T = self._shared[key]
        return value


@dataclass(slots=True)
class CredentialStore:
    """Every route's credential in one worker process, made on first use."""

    routes: Mapping[str, Route]
    env: Mapping[str, str]
    _made: dict[str, Credential] = field(default_factory=dict)
    _shared: dict[object, Any] = field(default_factory=dict)

    def for_route(self, name: str) -> Credential:
        cred = self._made.get(name)
        if cred is None:
            route = self.routes[name]
            module = importlib.import_module(KIND_MODULES[auth_kind(route)])
            make: _Maker = module.make
            cred = self._made[name] = make(CredentialContext(name, route, self.env, self._shared))
        return cred

    def current_secrets(self) -> list[str]:
        """The secrets of every route (made so far or not: a static key is known before first use)."""
        out: list[str] = []
        for name in self.routes:
            out += self.for_route(name).current_secrets()
        return out

    async def aclose(self) -> None:
        for cred in self._made.values():
            await cred.aclose()

"""Static keys: a route's key read from the environment variable ``api_key_env``, sent in one header.

Rule: the header style is the route's ``auth`` (``bearer``, ``x-api-key``, ``api-key``,
``x-goog-api-key``), else its dialect's; ``none`` sends nothing, as does a route without ``api_key_env``
(keyless local servers). The variable is read on each request, so a rotated key is used at once; an
unset or empty variable fails the attempt ``authentication``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from sluice.normalizer.requests.auth import HeaderStyle, auth_header
from sluice.worker.credentials import CredentialContext, auth_kind
from sluice.worker.credentials.base import Credential, CredentialUnavailable, OutgoingRequest

__all__ = ["StaticKey", "make"]


class StaticKey(Credential):
    def __init__(self, route: str, style: HeaderStyle, env_name: str | None, env: Mapping[str, str]) -> None:
        self.route, self.style, self.env_name, self._env = route, style, env_name, env
        self.source = f"environment variable {env_name}" if env_name else "no credential"

    def _value(self) -> str:
        return self._env.get(self.env_name, "") if self.env_name else ""

    async def apply(self, request: OutgoingRequest) -> Mapping[str, str]:
        if self.style == "none" or not self.env_name:
            return {}
        value = self._value()
        if not value:
            raise CredentialUnavailable(self.route, self.source, "the variable is not set")
        return auth_header(self.style, value)

    def current_secrets(self) -> list[str]:
        value = self._value()
        return [value] if value else []


def make(ctx: CredentialContext) -> Credential:
    style = cast(HeaderStyle, auth_kind(ctx.route))
    return StaticKey(ctx.route_name, style, ctx.route.api_key_env, ctx.env)

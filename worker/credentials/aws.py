"""``auth = "aws-sigv4"``: every request signed with AWS Signature Version 4 (Bedrock), service ``bedrock``.

Rule: credentials come from the standard AWS chain (environment, shared config and credentials files with
``AWS_PROFILE``, web identity, container and instance metadata) through ``botocore`` (the
``sluice-llm[aws]`` extra), resolved once per worker and shared by the routes on the same chain;
refreshable credentials are refreshed by botocore as they near expiry. Resolving, refreshing and signing
run in a worker thread (``anyio.to_thread``): the chain may call a metadata endpoint, and the event loop
never waits on it. The signature covers the method, the URL (path and query), the ``host``, the
``content-type`` and ``x-amz-*`` headers and the body's SHA-256, in the route's ``region``; the headers
added are ``authorization``, ``x-amz-date`` and, with temporary credentials, ``x-amz-security-token``.
``current_secrets`` holds the secret key, the session token, the access key id and the recent signatures,
so none of them reaches Redis or a log even when echoed. No credentials, or a chain botocore cannot
resolve, fails the attempt ``authentication`` naming the route and the chain, never a secret.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import anyio.to_thread
import botocore.auth
import botocore.awsrequest
import botocore.exceptions
import botocore.session

from sluice.worker.credentials import CredentialContext
from sluice.worker.credentials.base import Credential, CredentialUnavailable, OutgoingRequest

__all__ = ["SERVICE", "AwsChain", "SigV4", "make"]

SERVICE = "bedrock"
_SOURCE = "the AWS credential chain"
# Headers that take part in the signature besides host and x-amz-*: others (a request id, the user agent)
# may be changed by a proxy and must not break it.
_SIGNED = frozenset({"content-type"})
_RECENT_SIGNATURES = 16  # each is one request's; the redactor is rebuilt when the set changes


class AwsChain:
    """The resolved credential chain one worker shares. ``frozen()`` runs in a worker thread: botocore
    refreshes temporary credentials there when they near expiry."""

    def __init__(self, profile: str | None) -> None:
        self.profile = profile
        self._creds: Any = None
        self.secrets: set[str] = set()

    def frozen(self) -> Any:
        if self._creds is None:
            session = botocore.session.Session(profile=self.profile)
            self._creds = session.get_credentials()
            if self._creds is None:
                raise _Failed("no credentials found (environment, shared files, web identity, metadata)")
        frozen = self._creds.get_frozen_credentials()
        self.secrets.update(s for s in (frozen.secret_key, frozen.token, frozen.access_key) if s)
        return frozen


class _Failed(Exception):
    """The chain gave no credentials (the message is safe to show)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


class SigV4(Credential):
    def __init__(self, route: str, region: str, chain: AwsChain) -> None:
        self.route, self.region, self.chain = route, region, chain
        self.source = _SOURCE + (f" (profile {chain.profile})" if chain.profile else "")
        self.signatures: deque[str] = deque(maxlen=_RECENT_SIGNATURES)

    async def apply(self, request: OutgoingRequest) -> Mapping[str, str]:
        try:
            return await anyio.to_thread.run_sync(self._sign, request)
        except _Failed as exc:
            raise CredentialUnavailable(self.route, self.source, str(exc)) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise CredentialUnavailable(self.route, self.source, _first_line(exc)) from None

    def _sign(self, request: OutgoingRequest) -> dict[str, str]:
        frozen = self.chain.frozen()
        headers = {k: v for k, v in request.headers.items() if k in _SIGNED or k.startswith("x-amz-")}
        aws = botocore.awsrequest.AWSRequest(method=request.method, url=request.url, data=request.body, headers=headers)
        botocore.auth.SigV4Auth(frozen, SERVICE, self.region).add_auth(aws)
        added = {k.lower(): str(v) for k, v in aws.headers.items() if k.lower() not in headers}
        signature = added.get("authorization", "").rpartition("Signature=")[2]
        if signature:
            self.signatures.append(signature)
        return added

    def current_secrets(self) -> list[str]:
        return [*self.chain.secrets, *self.signatures]


def make(ctx: CredentialContext) -> Credential:
    region = ctx.route.region
    if not region:
        raise CredentialUnavailable(ctx.route_name, _SOURCE, 'auth = "aws-sigv4" needs the route\'s region')
    profile = ctx.env.get("AWS_PROFILE") or None
    chain = ctx.shared_source(("aws", profile), lambda: AwsChain(profile))
    return SigV4(ctx.route_name, region, chain)

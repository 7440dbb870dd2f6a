"""Who may read a request through the relay: per-deployment secrets and signed per-request tokens.

Rule: nothing is served without a token. A token is either one of the deployment's secrets (a backend
service's credential: every request, internal reasoning included) or a signed token
``sl1.<payload>.<signature>`` naming one request, an expiry and whether internal reasoning may be shown,
signed with HMAC-SHA256 under a deployment secret (the first secret signs, every secret verifies, so
secrets rotate without breaking tokens in flight). A missing token is ``401``; a token that is not
valid for this request now (bad signature, expired, another request, malformed) is ``403``. A request
carries one credential or none: more than one (two ``Authorization: Bearer`` headers, or a header beside
``?token=`` or the session cookie) is ``400 invalid_request`` whatever their validity (RFC 6750 §2:
"clients MUST NOT use more than one method"), so a valid token never rides beside a wrong one.
Comparisons are constant-time; error messages never echo the token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

import msgspec

__all__ = ["TOKEN_PREFIX", "AuthError", "Grant", "RelayAuth", "bearer_token", "one_credential", "sign_token"]

TOKEN_PREFIX = "sl1"


class AuthError(Exception):
    """Access refused: ``status`` is 400 (more than one credential: ``code`` ``invalid_request``), 401 (no
    token) or 403 (a token that does not grant this)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


_MORE_THAN_ONE = "more than one credential: send one of Authorization: Bearer, ?token= or the session cookie"


def bearer_token(authorization: list[str]) -> str | None:
    """The token of the request's ``Authorization: Bearer`` header (``authorization``: every value of
    that header), or None. Another scheme is not a relay credential; two Bearer headers are ``400``."""
    tokens = [v[7:].strip() for v in authorization if v[:7].lower() == "bearer "]
    if len(tokens) > 1:
        raise AuthError(400, _MORE_THAN_ONE, "invalid_request")
    return tokens[0] if tokens else None


def one_credential(*presented: str | None) -> str | None:
    """The one credential among ``presented`` (None: that method was not used), or None for none.
    Raises ``AuthError`` 400 ``invalid_request`` when more than one was sent, before any is checked."""
    sent = [t for t in presented if t is not None]
    if len(sent) > 1:
        raise AuthError(400, _MORE_THAN_ONE, "invalid_request")
    return sent[0] if sent else None


@dataclass(frozen=True, slots=True)
class Grant:
    request_id: str | None  # None: a deployment secret, valid for every request
    allow_internal: bool
    expires_at: int | None  # unix seconds; None for a deployment secret


class _Claims(msgspec.Struct, forbid_unknown_fields=True):
    rid: str
    exp: int
    internal: bool = False


_CLAIMS_DECODER = msgspec.json.Decoder(_Claims)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: str, signed_part: str) -> str:
    return _b64(hmac.new(secret.encode(), signed_part.encode(), hashlib.sha256).digest())


def sign_token(secret: str, request_id: str, expires_at: int, *, allow_internal: bool = False) -> str:
    """A token granting read access to one request until ``expires_at`` (unix seconds)."""
    payload = _b64(msgspec.json.encode(_Claims(rid=request_id, exp=int(expires_at), internal=allow_internal)))
    signed_part = f"{TOKEN_PREFIX}.{payload}"
    return f"{signed_part}.{_sign(secret, signed_part)}"


class RelayAuth:
    def __init__(self, secrets: list[str] | tuple[str, ...]) -> None:
        if not secrets or any(len(s) < 16 for s in secrets):
            raise ValueError("the relay needs at least one deployment secret of 16 characters or more")
        self.secrets = tuple(secrets)

    def sign(self, request_id: str, expires_at: int, *, allow_internal: bool = False) -> str:
        return sign_token(self.secrets[0], request_id, expires_at, allow_internal=allow_internal)

    def check(self, token: str | None, request_id: str, now: float) -> Grant:
        """The grant ``token`` gives for ``request_id`` at ``now``. Raises ``AuthError`` (401 / 403)."""
        grant = self.inspect(token, now)
        if grant.request_id is not None and not hmac.compare_digest(grant.request_id.encode(), request_id.encode()):
            raise AuthError(403, "the token is for another request")
        return grant

    def inspect(self, token: str | None, now: float) -> Grant:
        """What ``token`` grants at ``now``, whatever the request (a deployment secret: every request).
        Raises ``AuthError`` (401 / 403)."""
        if not token:
            raise AuthError(401, "a token is required (Authorization: Bearer <token> or ?token=)")
        # Check every secret without stopping early, so timing says nothing about which one matched.
        is_secret = False
        for s in self.secrets:
            is_secret |= hmac.compare_digest(token.encode(), s.encode())
        if is_secret:
            return Grant(request_id=None, allow_internal=True, expires_at=None)
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise AuthError(403, "the token is not valid")
        signed_part = f"{parts[0]}.{parts[1]}"
        valid = False
        for s in self.secrets:
            valid |= hmac.compare_digest(_sign(s, signed_part).encode(), parts[2].encode())
        if not valid:
            raise AuthError(403, "the token is not valid")
        try:
            claims = _CLAIMS_DECODER.decode(_unb64(parts[1]))
        except (ValueError, msgspec.DecodeError):
            raise AuthError(403, "the token is not valid") from None
        if claims.exp <= now:
            raise AuthError(403, "the token has expired")
        return Grant(request_id=claims.rid, allow_internal=claims.internal, expires_at=claims.exp)

"""How a route's credential is sent: the auth kinds, and the header each static style puts a secret in.

Rule: one table (``HEADER_STYLES``) names the header each style sends, for the builders (a dialect's own
style, ``DIALECT_AUTH``) and the worker's credentials alike. ``google`` sends an OAuth2 access token as
Bearer; ``aws-sigv4`` signs the whole request (its headers are computed, not looked up here); ``none``
sends nothing (keyless local servers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

__all__ = [
    "AUTH_KINDS",
    "DIALECT_AUTH",
    "HEADER_STYLES",
    "AuthKind",
    "HeaderStyle",
    "auth_header",
]

HeaderStyle = Literal["bearer", "x-api-key", "api-key", "x-goog-api-key", "none"]
AuthKind = Literal["bearer", "x-api-key", "api-key", "x-goog-api-key", "none", "google", "aws-sigv4"]
AUTH_KINDS: tuple[AuthKind, ...] = get_args(AuthKind)

# style -> (header name, value prefix); "none" sends no header.
HEADER_STYLES: Mapping[HeaderStyle, tuple[str, str] | None] = {
    "bearer": ("authorization", "Bearer "),
    "x-api-key": ("x-api-key", ""),
    "api-key": ("api-key", ""),
    "x-goog-api-key": ("x-goog-api-key", ""),
    "none": None,
}

# The style each dialect sends its key in when the route names none (what the providers' own APIs take).
DIALECT_AUTH: Mapping[str, HeaderStyle] = {
    "openai-chat": "bearer",
    "openai-responses": "bearer",
    "anthropic": "x-api-key",
    "gemini": "x-goog-api-key",
    "bedrock-converse": "bearer",  # a Bedrock API key; SigV4 is auth = "aws-sigv4"
}


def auth_header(style: HeaderStyle, secret: str | None) -> dict[str, str]:
    """The header carrying ``secret`` in ``style`` (none for an empty secret or the ``none`` style)."""
    spec = HEADER_STYLES[style]
    if spec is None or not secret:
        return {}
    name, prefix = spec
    return {name: prefix + secret}

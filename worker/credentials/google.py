"""``auth = "google"``: an OAuth2 access token, sent as Bearer, refreshed before it expires (Vertex AI).

Rule: the source is the service-account JSON file named by the route's ``credentials_file_env`` variable,
else Google's application-default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ADC file, the
metadata server), scope ``cloud-platform``, through ``google-auth`` (the ``sluice-llm[google]`` extra).
Routes with the same source share one token. A token is refreshed once google-auth no longer calls it
valid (from 3 min 45 s before its expiry), in a worker thread (``anyio.to_thread``), one refresh per
source at a time, so the event loop never waits on the token endpoint. The token in use and the one
before it are ``current_secrets``. A failure (no file, a file google-auth refuses, a refused or
unreachable refresh) fails the attempt ``authentication`` naming the route and the source; google-auth's
message is kept to its first line (it names the error, never the token).
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread
import google.auth
import google.auth.exceptions
import google.auth.transport
from google.auth.credentials import Credentials
from google.oauth2 import service_account

from sluice.worker.credentials import CredentialContext
from sluice.worker.credentials.base import Credential, CredentialUnavailable, OutgoingRequest

__all__ = ["SCOPES", "GoogleToken", "make"]

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_TOKEN_TIMEOUT = 30.0  # seconds for one token-endpoint exchange
_MAX_TOKEN_RESPONSE = 1 << 20


class _Failed(Exception):
    """The source could not give a token (the message is safe to show)."""


class _Response(google.auth.transport.Response):
    def __init__(self, status: int, headers: Mapping[str, str], data: bytes) -> None:
        self._status, self._headers, self._data = status, headers, data

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def data(self) -> bytes:
        return self._data


class _Transport(google.auth.transport.Request):
    """google-auth's HTTP hook over the standard library (the token exchange is one small POST; this
    keeps ``requests`` out of the extra). Runs only in a worker thread."""

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> _Response:
        req = urllib.request.Request(url, data=body, headers=dict(headers or {}), method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or _TOKEN_TIMEOUT) as resp:
                return _Response(resp.status, dict(resp.headers), resp.read(_MAX_TOKEN_RESPONSE))
        except urllib.error.HTTPError as exc:
            return _Response(exc.code, dict(exc.headers), exc.read(_MAX_TOKEN_RESPONSE))
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            raise google.auth.exceptions.TransportError(f"token endpoint unreachable ({exc})") from exc  # type: ignore[no-untyped-call]


def _first_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args and isinstance(exc.args[0], str) else type(exc).__name__
    return text.splitlines()[0][:200] if text else type(exc).__name__


class _TokenSource:
    """One source's credentials and token, shared by the routes that name it."""

    def __init__(self, source: str, file: str | None) -> None:
        self.source, self._file = source, file
        self._creds: Credentials | None = None
        self._lock: anyio.Lock | None = None
        self.tokens: deque[str] = deque(maxlen=2)  # the token in use and the one before it

    async def token(self) -> str:
        creds = self._creds
        if creds is None or not creds.valid:
            if self._lock is None:
                self._lock = anyio.Lock()
            async with self._lock:
                creds = self._creds
                if creds is None or not creds.valid:  # not refreshed meanwhile by another attempt
                    creds = self._creds = await anyio.to_thread.run_sync(self._refresh)
        token = creds.token
        if not token:
            raise _Failed("the refresh gave no token")
        if not self.tokens or self.tokens[-1] != token:
            self.tokens.append(token)
        return str(token)

    def _refresh(self) -> Credentials:
        try:
            creds = self._creds or self._load()
            creds.refresh(_Transport())  # type: ignore[no-untyped-call]  # google-auth leaves it untyped
        # TypeError / KeyError: google-auth reading a token response that is not the documented JSON
        except (google.auth.exceptions.GoogleAuthError, OSError, ValueError, TypeError, KeyError) as exc:
            raise _Failed(_first_line(exc)) from None
        return creds

    def _load(self) -> Credentials:
        if self._file is not None:
            file_creds = service_account.Credentials.from_service_account_file  # untyped in google-auth
            loaded: Credentials = file_creds(self._file, scopes=SCOPES)  # type: ignore[no-untyped-call]
            return loaded
        creds, _project = google.auth.default(scopes=SCOPES)
        return creds


class _Unset:
    """A service-account variable that is not set: every attempt fails, naming it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tokens: deque[str] = deque()

    async def token(self) -> str:
        raise _Failed("the variable is not set")


class GoogleToken(Credential):
    def __init__(self, route: str, source: _TokenSource | _Unset) -> None:
        self.route, self.source, self._source = route, source.source, source

    async def apply(self, request: OutgoingRequest) -> Mapping[str, str]:
        try:
            token = await self._source.token()
        except _Failed as exc:
            raise CredentialUnavailable(self.route, self.source, str(exc)) from None
        return {"authorization": f"Bearer {token}"}

    def current_secrets(self) -> list[str]:
        return list(self._source.tokens)


def make(ctx: CredentialContext) -> Credential:
    var = ctx.route.credentials_file_env
    if var is None:
        source: _TokenSource | _Unset = ctx.shared_source(
            ("google", None), lambda: _TokenSource("application-default credentials", None)
        )
    elif not (path := ctx.env.get(var, "")):
        source = _Unset(f"the service-account file named by {var}")
    else:
        label = f"the service-account file named by {var}"
        source = ctx.shared_source(("google", path), lambda: _TokenSource(label, path))
    return GoogleToken(ctx.route_name, source)

"""The local fake provider: a real HTTP/1.1 server on loopback speaking every dialect's endpoints.

Rule: every request is answered the way that provider would answer it (path, auth header, error body
shape, SSE framing), from a transcript file or the synthetic generator, as chosen by the requested model
name (``sluice.harness.fake.scenarios``); the scenario may also ask for transport behaviour (pacing, chunked writes,
1-byte writes) and faults (resets, stalls, error statuses, broken events). The configured API key is
compared in constant time and never logged, echoed or stored. Every request is recorded in ``stats``
(also served, without auth, at ``GET /_fake/stats``; ``?requests=0`` leaves out the per-request
records), including whether the client went away first.

Capacity (``sluice.harness.fake.limits``): optionally the fake is one account with a concurrency cap and a
requests-per-minute window, checked after the key and the scenario are accepted; past them it answers
429 (the cap: 429, 503 or 529 as configured) in the dialect's own body with ``retry-after`` (OpenAI also
``retry-after-ms`` and ``x-ratelimit-*-requests``, Anthropic ``anthropic-ratelimit-requests-*``,
Gemini ``RetryInfo`` and ``QuotaFailure`` in the body). The counters report the peak of admitted
requests in flight, the requests received and the 429s sent. ``hold=NAME`` keeps an admitted request
open until ``release(NAME)`` (or ``POST /_fake/release/NAME``), so a test holds streams without sleeping.

Endpoints (``base_url`` has no path; clients append the provider's own): ``POST /v1/chat/completions``
and ``POST /v1/responses`` (``Authorization: Bearer``), ``POST /v1/messages`` (``x-api-key`` and a
required ``anthropic-version``), ``POST /v1beta/models/{model}:streamGenerateContent?alt=sse``
(``x-goog-api-key`` or ``?key=``), ``POST /model/{model}/converse-stream`` (Bedrock: a SigV4 signature
recomputed with the test key pair of ``sluice.harness.fake.sigv4``, or a Bedrock API key as Bearer; answered
in AWS event-stream framing). A wrong or missing key is 401 in that provider's error shape (403 for a
refused signature, as AWS answers); any other path is 404.

The clouds: Azure OpenAI's paths, ``/openai/v1/chat/completions`` and ``/openai/v1/responses`` (model in
the body) and ``/openai/deployments/{deployment}/chat/completions?api-version=...`` (the deployment is the
model; ``api-version`` required), with the key in ``api-key`` or as Bearer; Vertex AI's
``/v1/projects/{p}/locations/{l}/publishers/google/models/{model}:streamGenerateContent?alt=sse`` (gemini)
and ``.../publishers/anthropic/models/{model}:streamRawPredict`` (anthropic: the body carries
``anthropic_version: "vertex-2023-10-16"`` and no ``model``), authorized only by a Bearer access token the
fake's own OAuth2 token endpoint issued (``POST /_fake/oauth/token``, the ``token_uri`` of a test
service-account file; tokens live ``token_lifetime`` seconds). Vertex errors are Google's shape.

Plain asyncio streams and a small HTTP/1.1 implementation keep one process able to serve ~1,000 paced
streams: requests with ``Content-Length`` (or chunked) bodies, keep-alive, chunked SSE responses, one
HTTP chunk per event (or ``chunk=N`` bytes of it), drained after every write so a slow reader slows the
sender instead of growing a buffer. A client going away is seen at once, even while a stream sleeps.
Why not starlette + uvicorn: ``reset=N`` needs the socket (an RST, which an ASGI app cannot send), and
under uvicorn the fake's CPU per event is 1.6x (docs/benchmarks.md, "The fake provider").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import math
import os
import re
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import msgspec

from sluice.harness.fake.limits import CONCURRENCY_STATUSES, Limiter, ProviderLimits, Refusal
from sluice.harness.fake.render import (
    STAMP_PLACEHOLDER,
    Script,
    Tagged,
    error_body,
    inject,
    reframe,
    render_tagged,
    split_events,
)
from sluice.harness.fake.scenarios import GATE_NAME, Scenario, ScenarioError, build_script, parse_scenario
from sluice.harness.fake.sigv4 import verify_sigv4

__all__ = [
    "DEFAULT_EXAMPLES",
    "OTLP_SINK",
    "FakeProvider",
    "FakeStats",
    "ProviderLimits",
    "RequestRecord",
    "configure_parser",
    "endpoint_path",
    "limits_from_args",
    "main",
    "run_from_args",
    "serve_fake_provider",
]

DEFAULT_EXAMPLES = Path(__file__).resolve().parent / "examples"
_MAX_HEAD = 64 * 1024
_MAX_BODY = 8 << 20
_READ = 64 * 1024
_RST_GRACE = 0.05  # let the peer read the last events before the RST discards what it has not read
OTLP_SINK = "/_fake/otlp"  # OTLP/HTTP base path: POST {OTLP_SINK}/v1/traces and /v1/metrics are accepted
_PH = STAMP_PLACEHOLDER.encode()
_RELEASE = "/_fake/release/"
TOKEN_PATH = "/_fake/oauth/token"  # the OAuth2 token endpoint google-auth refreshes against
VERTEX_VERSION = "vertex-2023-10-16"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    402: "Payment Required",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Site Overloaded",
}
_ENC = msgspec.json.Encoder()


def endpoint_path(dialect: str, model: str = "synthetic") -> str:
    """The path (and query) a client of ``dialect`` posts to; Gemini names the model in it."""
    if dialect == "openai-chat":
        return "/v1/chat/completions"
    if dialect == "openai-responses":
        return "/v1/responses"
    if dialect == "anthropic":
        return "/v1/messages"
    if dialect == "gemini":
        return f"/v1beta/models/{model}:streamGenerateContent?alt=sse"
    if dialect == "bedrock-converse":
        return f"/model/{quote(model, safe='')}/converse-stream"
    raise ValueError(f"unknown dialect {dialect!r}")


_BEDROCK_PATH = re.compile(r"/model/(?P<model>[^/]+)/converse-stream")
_GEMINI_PATH = re.compile(r"/v1(?:beta)?/models/(?P<model>[^/]+?):streamGenerateContent")
_PATHS = {
    "/v1/chat/completions": "openai-chat",
    "/v1/responses": "openai-responses",
    "/v1/messages": "anthropic",
    "/openai/v1/chat/completions": "openai-chat",  # Azure OpenAI's v1 API
    "/openai/v1/responses": "openai-responses",
}
_AZURE_DEPLOYMENT = re.compile(r"/openai/deployments/(?P<model>[^/]+)/chat/completions")
_VERTEX_PATH = re.compile(
    r"/v1(?:beta1)?/projects/[^/]+/locations/[^/]+/publishers/(?P<publisher>google|anthropic)/models/"
    r"(?P<model>[^/]+?):(?P<method>streamGenerateContent|streamRawPredict)"
)
_VERTEX_DIALECTS = {("google", "streamGenerateContent"): "gemini", ("anthropic", "streamRawPredict"): "anthropic"}


# -- statistics --------------------------------------------------------------------------------------


class RequestRecord(msgspec.Struct, kw_only=True):
    n: int
    method: str
    path: str
    dialect: str | None = None
    scenario: str | None = None
    request_id: str | None = None  # the x-sluice-request-id header, when sent
    status: int = 0
    fault: bool = False  # a fault of the scenario applied to this request (see times=K)
    limited: str | None = None  # refused by the fake's own limits: "concurrency" | "rate"
    received_at: float
    first_byte_at: float | None = None  # the first response byte (the status line)
    ended_at: float | None = None
    events_sent: int = 0
    bytes_sent: int = 0  # response body payload bytes (without HTTP chunk framing)
    # open | completed (the whole response was written) | disconnected (the client went away first) |
    # reset (we sent RST) | aborted (server shutdown)
    outcome: str = "open"
    disconnected: bool = False
    disconnected_at: float | None = None


class FakeStats:
    """What the fake provider saw. Timestamps are unix seconds (``time.time()``)."""

    def __init__(self, keep: int = 100_000, limits: ProviderLimits | None = None) -> None:
        self.requests: deque[RequestRecord] = deque(maxlen=keep)  # the most recent, oldest first
        self.limiter = Limiter(limits or ProviderLimits())  # in_flight / peak_in_flight even without limits
        self.total_requests = 0
        self.provider_requests = 0  # requests to a provider endpoint (not the stats or release endpoints)
        self.responses_429 = 0  # every 429 sent: the limits' and injected ones (status=429)
        self.open_connections = 0
        self.max_open_connections = 0
        self.active_streams = 0
        self.max_active_streams = 0
        self.unauthorized = 0
        self.not_found = 0
        self.disconnects = 0
        self.completed = 0
        self.otlp_exports = 0  # POSTs to the OTLP sink (a benchmarked worker's telemetry)
        self.tokens_issued = 0  # access tokens the OAuth2 token endpoint gave out
        self._changed = asyncio.Event()

    @property
    def counters(self) -> dict[str, int]:
        return {
            "total_requests": self.total_requests,
            "open_connections": self.open_connections,
            "max_open_connections": self.max_open_connections,
            "active_streams": self.active_streams,
            "max_active_streams": self.max_active_streams,
            "unauthorized": self.unauthorized,
            "not_found": self.not_found,
            "disconnects": self.disconnects,
            "completed": self.completed,
            "otlp_exports": self.otlp_exports,
            "tokens_issued": self.tokens_issued,
            "provider_requests": self.provider_requests,
            "responses_429": self.responses_429,
            **self.limiter.statistics(),
        }

    def find(self, *, request_id: str | None = None, scenario: str | None = None) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if (request_id is None or r.request_id == request_id) and (scenario is None or r.scenario == scenario)
        ]

    async def wait_until(self, predicate: Callable[[FakeStats], bool]) -> None:
        """Wait until ``predicate(stats)`` holds, re-checked whenever a request ends (the server sees a
        client's disconnect slightly after the client closes). Bound it with ``asyncio.timeout``."""
        while not predicate(self):
            await self._changed.wait()

    def _touch(self) -> None:
        self._changed.set()  # wakes every waiter, which then waits on the new event
        self._changed = asyncio.Event()

    def snapshot(self, records: bool = True) -> dict[str, Any]:
        lim = self.limiter.limits
        limits = {
            "max_concurrency": lim.max_concurrency,
            "requests_per_minute": lim.requests_per_minute,
            "window_s": lim.window_s,
            "concurrency_status": lim.concurrency_status,
        }
        out: dict[str, Any] = {"counters": self.counters, "limits": limits}
        if records:
            out["requests"] = list(self.requests)
        return out


# -- HTTP/1.1 ----------------------------------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request(msgspec.Struct):
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes


class _Conn:
    """One client connection: our own read buffer, so bytes read while watching for a disconnect during
    a response are never lost to the next request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()

    async def fill(self) -> bool:
        data = await self.reader.read(_READ)
        if not data:
            return False
        self.buf += data
        return True

    async def read_request(self) -> _Request | None:
        """None at a clean EOF between requests. Raises ``_BadRequest``."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD:
                raise _BadRequest(431, "request head too large")
            if not await self.fill():
                if self.buf:
                    raise _BadRequest(400, "connection closed inside a request head")
                return None
        head = bytes(self.buf[:end]).decode("latin-1")
        del self.buf[: end + 4]
        line, *lines = head.split("\r\n")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "malformed request line")
        headers: dict[str, str] = {}
        for h in lines:
            name, colon, value = h.partition(":")
            if not colon or not name or name != name.strip():
                raise _BadRequest(400, "malformed header line")
            key = name.lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest(400, "bad content-length") from None
            if not 0 <= length <= _MAX_BODY:
                raise _BadRequest(413, "request body too large")
            body = await self._read_exactly(length)
        return _Request(parts[0], parts[1], parts[2], headers, body)

    async def _read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise _BadRequest(400, "connection closed inside a request body")
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def _read_line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD or not await self.fill():
                raise _BadRequest(400, "bad chunked request body")
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            try:
                size = int((await self._read_line()).split(b";")[0], 16)
            except ValueError:
                raise _BadRequest(400, "bad chunk size") from None
            if size == 0:
                while await self._read_line():  # trailers
                    pass
                return bytes(body)
            if len(body) + size > _MAX_BODY:
                raise _BadRequest(413, "request body too large")
            body += await self._read_exactly(size)
            if await self._read_line():
                raise _BadRequest(400, "bad chunk terminator")


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


# -- the server ----------------------------------------------------------------------------------------


class _Body(msgspec.Struct):
    model: Any = None
    stream: Any = None


_BODY = msgspec.json.Decoder(_Body)


class FakeProvider:
    """The running server (yielded by ``serve_fake_provider``)."""

    def __init__(
        self,
        api_key: str,
        examples_dir: Path,
        limits: ProviderLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not api_key:
            raise ValueError("the fake provider needs an API key to check")
        self._key = api_key.encode()
        self.examples_dir = examples_dir
        self.stats = FakeStats(limits=limits)
        self._clock = clock  # the limits' clock (a test may step it); records keep wall time
        self._gates: dict[str, asyncio.Event] = {}
        self.host = ""
        self.port = 0
        self._times: dict[str, int] = {}
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._closing = False
        self._server: asyncio.Server | None = None
        self.token_lifetime = 3600  # seconds an issued access token is valid (expires_in)
        self._tokens: dict[bytes, float] = {}  # issued access token -> expiry (self._clock)

    def __repr__(self) -> str:  # never show the key
        return f"FakeProvider({self.base_url!r})"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def url(self, dialect: str, model: str = "synthetic") -> str:
        return self.base_url + endpoint_path(dialect, model)

    def issued_tokens(self) -> list[str]:
        """Every access token the token endpoint gave out (tests check none of them is stored)."""
        return [t.decode() for t in self._tokens]

    def release(self, gate: str) -> None:
        """Open gate ``gate``: every request held by ``hold=gate`` goes on, and later ones do not wait."""
        self._gates.setdefault(gate, asyncio.Event()).set()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, backlog=4096, limit=_READ)
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

    async def aclose(self) -> None:
        """Stop listening and end every connection. Connections are aborted rather than their tasks
        cancelled: each handler then sees EOF and returns normally (asyncio's start_server callback
        mishandles a cancelled handler task on Python 3.11)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in self._conns.values():
            writer.transport.abort()
        if self._conns:
            _, pending = await asyncio.wait(list(self._conns), timeout=5)
            for task in pending:  # pragma: no cover - a handler that ignored the abort
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    # -- connections --

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closing:
            writer.transport.abort()
            return
        self._conns[task] = writer
        st = self.stats
        st.open_connections += 1
        st.max_open_connections = max(st.max_open_connections, st.open_connections)
        conn = _Conn(reader, writer)
        try:
            while not writer.is_closing():
                try:
                    req = await conn.read_request()
                except _BadRequest as exc:
                    writer.write(_plain(exc.status, str(exc)))
                    await writer.drain()
                    break
                if req is None:
                    break
                keep = await self._respond(conn, req)
                if not keep or req.headers.get("connection", "").lower() == "close" or req.version == "HTTP/1.0":
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            st.open_connections -= 1
            self._conns.pop(task, None)
            if not writer.is_closing():
                writer.close()

    async def _respond(self, conn: _Conn, req: _Request) -> bool:
        """Answer one request; False when the connection must not be reused."""
        st = self.stats
        url = urlsplit(req.target)
        if req.method == "POST" and url.path.startswith(OTLP_SINK + "/v1/"):
            # An OTLP/HTTP collector that accepts and drops (a benchmarked worker exporting its telemetry);
            # not a provider request, so not in the records.
            st.otlp_exports += 1
            conn.writer.write(_head(200, [("content-type", "application/x-protobuf"), ("content-length", "0")]))
            await conn.writer.drain()
            return True
        if req.method == "POST" and url.path == TOKEN_PATH:
            return await self._issue_token(conn, req)
        st.total_requests += 1
        rec = RequestRecord(
            n=st.total_requests,
            method=req.method,
            path=url.path,
            received_at=time.time(),
            request_id=req.headers.get("x-sluice-request-id"),
        )
        st.requests.append(rec)
        if req.method == "GET" and url.path == "/_fake/stats":
            records = parse_qs(url.query).get("requests") != ["0"]
            return await self._send_json(conn, rec, 200, _ENC.encode(st.snapshot(records)))
        if req.method == "POST" and url.path.startswith(_RELEASE):
            gate = url.path.removeprefix(_RELEASE)
            if not GATE_NAME.fullmatch(gate):
                return await self._send_json(conn, rec, 400, error_body("openai-chat", 400, "bad gate name"))
            self.release(gate)
            return await self._send_json(conn, rec, 200, b"{}")
        dialect, model, cloud = _route(url.path)
        if _AZURE_DEPLOYMENT.fullmatch(url.path) and not parse_qs(url.query).get("api-version"):
            body = error_body("openai-chat", 404, "Resource not found")  # what Azure says without api-version
            return await self._send_json(conn, rec, 404, body)
        if dialect is None or req.method != "POST":
            st.not_found += 1
            body = error_body(dialect or "openai-chat", 404, f"no route for {req.method} {url.path}")
            return await self._send_json(conn, rec, 404, body)
        st.provider_requests += 1
        rec.dialect = dialect
        if dialect == "bedrock-converse" and (refused := _sigv4_refusal(req)) is not None:
            st.unauthorized += 1
            return await self._send_json(conn, rec, 403, error_body(dialect, 403, refused))
        if not self._authorized(dialect, req, url.query, cloud):
            st.unauthorized += 1
            if cloud == "vertex":
                body = error_body("gemini", 401, _VERTEX_UNAUTHENTICATED)
            else:
                body = error_body(dialect, 401, _AUTH_MESSAGES[dialect])
            return await self._send_json(conn, rec, 401, body)
        if dialect == "anthropic" and cloud != "vertex" and not req.headers.get("anthropic-version"):
            body = error_body(dialect, 400, "anthropic-version: header is required")
            return await self._send_json(conn, rec, 400, body)
        try:
            if cloud == "vertex" and dialect == "anthropic":
                _check_vertex_body(req.body)
            elif dialect not in _MODEL_IN_PATH:
                body_model = _read_model(req.body)
                model = model or body_model  # an Azure deployment path names the model itself
            if dialect == "gemini" and parse_qs(url.query).get("alt") != ["sse"]:
                raise ScenarioError("the fake provider streams only with ?alt=sse")
            rec.scenario = model
            scenario = parse_scenario(model)
            rec.scenario = scenario.raw  # decoded, when the model name was an encoded scenario
        except ScenarioError as exc:
            return await self._send_json(conn, rec, 400, error_body(dialect, 400, str(exc)))
        # Admission comes before a fault is counted (times=K): a refused request never reached the model.
        if (refusal := st.limiter.admit(self._clock())) is not None:
            status, body, headers = _refusal_response(dialect, scenario.model or "fake-model", refusal)
            rec.limited = refusal.limit
            return await self._send_json(conn, rec, status, body, headers)
        st._touch()  # a test may wait for requests to be in flight
        try:
            return await self._admitted(conn, rec, dialect, scenario)
        finally:
            st.limiter.release()
            st._touch()

    async def _admitted(self, conn: _Conn, rec: RequestRecord, dialect: str, scenario: Scenario) -> bool:
        """Serve an admitted request: an injected status, or the stream (a missing transcript is 404)."""
        count = self._times[scenario.raw] = self._times.get(scenario.raw, 0) + 1
        if scenario.faulty and scenario.times and count > scenario.times:
            scenario = scenario.without_faults()
        rec.fault = scenario.faulty
        if scenario.status:
            extra = [("retry-after", scenario.retry_after)] if scenario.retry_after is not None else []
            message = f"fake provider: injected HTTP {scenario.status}"
            delay = float(scenario.retry_after) if scenario.retry_after is not None else None
            body = error_body(dialect, scenario.status, message, retry_delay_s=delay)
            return await self._send_json(conn, rec, scenario.status, body, extra)
        try:
            events = self._plan(dialect, scenario)
        except FileNotFoundError:
            body = error_body(dialect, 404, f"no transcript {scenario.transcript!r} for {dialect}")
            return await self._send_json(conn, rec, 404, body)
        return await self._stream(conn, rec, dialect, scenario, events)

    async def _issue_token(self, conn: _Conn, req: _Request) -> bool:
        """The OAuth2 token endpoint (RFC 6749 5.1): any JWT-bearer grant gets a fresh access token."""
        form = parse_qs(req.body.decode("ascii", "replace"))
        if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"] or not form.get("assertion"):
            body = _ENC.encode({"error": "unsupported_grant_type", "error_description": "jwt-bearer only"})
            status = 400
        else:
            self.stats.tokens_issued += 1
            token = f"ya29.fake-{self.stats.tokens_issued}-{os.urandom(24).hex()}"
            self._tokens[token.encode()] = self._clock() + self.token_lifetime
            body = _ENC.encode({"access_token": token, "expires_in": self.token_lifetime, "token_type": "Bearer"})
            status = 200
        head = _head(status, [("content-type", "application/json"), ("content-length", str(len(body)))])
        conn.writer.write(head + body)
        await conn.writer.drain()
        return True

    def _authorized(self, dialect: str, req: _Request, query: str, cloud: str = "") -> bool:
        h = req.headers
        if dialect == "bedrock-converse" and h.get("authorization", "").startswith(_SIGV4):
            return True  # checked by _sigv4_refusal
        if cloud == "vertex":  # only an access token this fake issued, unexpired
            scheme, _, token = h.get("authorization", "").partition(" ")
            expiry = self._tokens.get(token.strip().encode()) if scheme.lower() == "bearer" else None
            return expiry is not None and self._clock() < expiry
        if cloud == "azure" and "api-key" in h:
            given = h["api-key"]
        elif dialect in ("openai-chat", "openai-responses", "bedrock-converse"):
            scheme, _, token = h.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else ""
        elif dialect == "anthropic":
            given = h.get("x-api-key", "")
        else:
            given = h.get("x-goog-api-key") or (parse_qs(query).get("key") or [""])[0]
        return hmac.compare_digest(given.encode(), self._key)

    def _plan(self, dialect: str, sc: Scenario) -> list[Tagged]:
        """The events to send, faults included. Raises ``FileNotFoundError`` for a missing transcript."""
        if sc.kind == "transcript":
            suffix = ".eventstream" if dialect == "bedrock-converse" else ".sse"
            raw = (self.examples_dir / dialect / f"{sc.transcript}{suffix}").read_bytes()
            pieces = _split_frames(raw) if dialect == "bedrock-converse" else split_events(raw)
            events: list[Tagged] = [("event", p) for p in pieces[:-1]]
            events += [("terminal", p) for p in pieces[-1:]]  # only the last one can be "the" terminal
            script = Script(model=sc.model or "fake-model", blocks=())
        else:
            script = build_script(sc, created=int(time.time()))
            events = render_tagged(dialect, script)
        return inject(
            dialect,
            script,
            events,
            malformed_json=sc.malformed_json,
            invalid_utf8=sc.invalid_utf8,
            truncate_tool=sc.truncate_tool,
            drop_terminal=sc.drop_terminal,
            error_after=sc.error_after,
            error_kind=sc.error,
        )

    async def _send_json(
        self,
        conn: _Conn,
        rec: RequestRecord,
        status: int,
        body: bytes,
        extra: Sequence[tuple[str, str]] = (),
    ) -> bool:
        ctype = "application/json; charset=UTF-8" if rec.dialect == "gemini" else "application/json"
        head = _head(status, [("content-type", ctype), ("content-length", str(len(body))), *extra])
        rec.status = status
        self.stats.responses_429 += status == 429
        rec.first_byte_at = rec.ended_at = time.time()
        rec.bytes_sent = len(body)
        rec.outcome = "completed"
        self.stats._touch()
        conn.writer.write(head + body)
        await conn.writer.drain()
        return True

    # -- streaming --

    async def _stream(self, conn: _Conn, rec: RequestRecord, dialect: str, sc: Scenario, events: list[Tagged]) -> bool:
        st = self.stats
        st.active_streams += 1
        st.max_active_streams = max(st.max_active_streams, st.active_streams)
        outcome = "aborted"
        try:
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._send_events(conn, rec, dialect, sc, events))
                watcher = tg.create_task(self._watch(conn))
                sender.add_done_callback(lambda _: watcher.cancel())
                watcher.add_done_callback(lambda t: t.cancelled() or sender.cancel())
            outcome = "disconnected" if sender.cancelled() else sender.result()
        finally:
            self._finish(rec, "aborted" if self._closing and outcome == "disconnected" else outcome)
        return outcome == "completed"

    def _finish(self, rec: RequestRecord, outcome: str) -> None:
        """Record how a stream ended, once. Called before the last byte is written, so a client that has
        read the whole response always finds its record finished."""
        if rec.outcome != "open":
            return
        st = self.stats
        st.active_streams -= 1
        rec.outcome = outcome
        rec.ended_at = time.time()
        if outcome == "disconnected":
            st.disconnects += 1
            rec.disconnected = True
            rec.disconnected_at = rec.disconnected_at or rec.ended_at
        elif outcome == "completed":
            st.completed += 1
        st._touch()

    async def _watch(self, conn: _Conn) -> None:
        """Returns when the client closes its side: the only signal of a client that went away while we
        sleep (between paced events, or stalled after the headers)."""
        try:
            while await conn.fill():
                if len(conn.buf) > _MAX_HEAD + _MAX_BODY:
                    return
        except (ConnectionError, OSError):  # a reset is going away too
            return

    async def _send_events(
        self, conn: _Conn, rec: RequestRecord, dialect: str, sc: Scenario, events: list[Tagged]
    ) -> str:
        w = conn.writer
        try:
            if sc.hold:
                await self._gates.setdefault(sc.hold, asyncio.Event()).wait()
            if sc.first_byte_ms:
                await asyncio.sleep(sc.first_byte_ms / 1000)
            ctype = _EVENTSTREAM if dialect == "bedrock-converse" else "text/event-stream; charset=utf-8"
            headers = [
                ("content-type", ctype),
                ("transfer-encoding", "chunked"),
                ("cache-control", "no-cache"),
                ("connection", "keep-alive"),
                (_REQUEST_ID_HEADER.get(dialect, "x-request-id"), f"req_fake{rec.n:08d}"),
            ]
            w.write(_head(200, headers))
            rec.status = 200
            rec.first_byte_at = time.time()
            await w.drain()
            if sc.stall_headers:
                await asyncio.Event().wait()  # until the client goes away or the server stops
            writer = _BodyWriter(w, rec, sc)
            if sc.reset == 0:
                return await self._reset(w, rec)
            stamps: list[bytes] = []
            for i, (tag, data) in enumerate(events):
                if i and sc.pace_ms:
                    await asyncio.sleep(sc.pace_ms / 1000)
                if sc.stamp and _PH in data:
                    if dialect == "bedrock-converse":  # the stamp goes into the payload; the CRCs follow
                        data = reframe(data, functools.partial(_stamp, tag=tag, stamps=stamps))
                    else:
                        data = _stamp(data, tag, stamps)
                await writer.write(data)
                rec.events_sent += 1
                if sc.endless_line:
                    await writer.endless()
                if sc.reset is not None and rec.events_sent >= sc.reset:
                    return await self._reset(w, rec)
            if sc.endless_line:  # no events at all: the line starts at once
                await writer.endless()
            self._finish(rec, "completed")
            w.write(b"0\r\n\r\n")
            await w.drain()
            return "completed"
        except (ConnectionError, OSError):
            rec.disconnected_at = time.time()
            return "disconnected"

    async def _reset(self, w: asyncio.StreamWriter, rec: RequestRecord) -> str:
        await w.drain()
        await asyncio.sleep(_RST_GRACE)
        self._finish(rec, "reset")
        sock = w.get_extra_info("socket")
        if sock is not None:
            # SO_LINGER with a zero timeout: close() sends RST instead of FIN (the peer sees ECONNRESET).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()
        return "reset"


class _BodyWriter:
    """Writes body bytes as HTTP chunks: whole events, ``chunk=N`` bytes at a time, or one byte every
    ``byte_ms``; drains after every write so a slow reader slows us down instead of growing a buffer."""

    def __init__(self, w: asyncio.StreamWriter, rec: RequestRecord, sc: Scenario) -> None:
        self.w = w
        self.rec = rec
        self.sc = sc
        self.started = False

    async def write(self, data: bytes) -> None:
        sc = self.sc
        size = 1 if sc.byte_ms else sc.chunk or len(data)
        for i in range(0, len(data), size or 1):
            if sc.byte_ms and self.started:
                await asyncio.sleep(sc.byte_ms / 1000)
            piece = data[i : i + size]
            self.w.write(_frame(piece))
            await self.w.drain()
            self.started = True
            self.rec.bytes_sent += len(piece)

    async def endless(self) -> None:
        """A data line that never ends, until the client goes away."""
        await self.write(b'data: {"endless": "')
        filler = b"x" * 65536
        while True:
            await self.write(filler)


def _stamp(data: bytes, tag: str, stamps: list[bytes]) -> bytes:
    if tag == "text":  # a delta: the send time, remembered for the summary events that repeat the text
        stamp = f"⏱{time.time_ns() // 1000:016d}|".encode()
        stamps.append(stamp)
        return data.replace(_PH, stamp, 1)
    # A summary (Responses .done / completed) repeats the deltas: the same stamps, in order.
    parts = data.split(_PH)
    out = [parts[0]]
    for i, part in enumerate(parts[1:]):
        out += [stamps[i] if i < len(stamps) else _PH, part]
    return b"".join(out)


def _route(path: str) -> tuple[str | None, str, str]:
    """(dialect, the model the path names, the cloud: "", "azure" or "vertex")."""
    if dialect := _PATHS.get(path):
        return dialect, "", "azure" if path.startswith("/openai/") else ""
    if m := _GEMINI_PATH.fullmatch(path):
        return "gemini", unquote(m.group("model")), ""
    if m := _AZURE_DEPLOYMENT.fullmatch(path):
        return "openai-chat", unquote(m.group("model")), "azure"
    if m := _BEDROCK_PATH.fullmatch(path):
        return "bedrock-converse", unquote(m.group("model")), ""
    if m := _VERTEX_PATH.fullmatch(path):
        dialect = _VERTEX_DIALECTS.get((m.group("publisher"), m.group("method")))
        return dialect, unquote(m.group("model")), "vertex"
    return None, "", ""


class _VertexBody(msgspec.Struct):
    anthropic_version: Any = None
    model: Any = None
    stream: Any = None


def _check_vertex_body(body: bytes) -> None:
    """Claude on Vertex: the version in the body, the model only in the path."""
    try:
        parsed = msgspec.json.decode(body, type=_VertexBody)
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"the request body is not a JSON object ({exc})") from None
    if parsed.anthropic_version != VERTEX_VERSION:
        raise ScenarioError(f"anthropic_version: {VERTEX_VERSION!r} is required on Vertex AI")
    if parsed.model is not None:
        raise ScenarioError("model: not allowed in the body on Vertex AI (it is in the path)")
    if parsed.stream is not True:
        raise ScenarioError("the fake provider only streams: set stream: true")


_SIGV4 = "AWS4-HMAC-SHA256 "
_EVENTSTREAM = "application/vnd.amazon.eventstream"
_MODEL_IN_PATH = frozenset({"gemini", "bedrock-converse"})
_REQUEST_ID_HEADER = {"anthropic": "request-id", "bedrock-converse": "x-amzn-requestid"}


def _sigv4_refusal(req: _Request) -> str | None:
    """Why a SigV4-signed request is refused (None: not signed, or signed right)."""
    if not req.headers.get("authorization", "").startswith(_SIGV4):
        return None
    url = f"http://{req.headers.get('host', '')}{req.target}"
    return verify_sigv4(req.method, url, req.headers, req.body)


def _split_frames(raw: bytes) -> list[bytes]:
    """A recorded event-stream body, one piece per frame (a cut or broken tail kept as its last piece)."""
    pieces: list[bytes] = []
    at = 0
    while len(raw) - at >= 12:
        total = int.from_bytes(raw[at : at + 4], "big")
        if total < 16 or at + total > len(raw):
            break
        pieces.append(raw[at : at + total])
        at += total
    if at < len(raw):
        pieces.append(raw[at:])
    return pieces


def _read_model(body: bytes) -> str:
    try:
        parsed = _BODY.decode(body)
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"the request body is not a JSON object ({exc})") from None
    if not isinstance(parsed.model, str) or not parsed.model:
        raise ScenarioError("model: a non-empty string is required")
    if parsed.stream is not True:
        raise ScenarioError("the fake provider only streams: set stream: true")
    return parsed.model


_VERTEX_UNAUTHENTICATED = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other "
    "valid authentication credential."
)
_AUTH_MESSAGES = {
    "openai-chat": "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys.",
    "openai-responses": "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys.",
    "anthropic": "invalid x-api-key",
    "gemini": "API key not valid. Please pass a valid API key.",
    "bedrock-converse": "The security token included in the request is invalid.",
}


def _refusal_response(dialect: str, model: str, r: Refusal) -> tuple[int, bytes, list[tuple[str, str]]]:
    """The answer to a request past the limits, as that provider words and heads it."""
    headers = [("retry-after", r.retry_after_header)]
    openai = dialect in ("openai-chat", "openai-responses")
    if openai:  # the OpenAI SDKs read retry-after-ms first
        headers.append(("retry-after-ms", str(math.ceil(r.retry_after_s * 1000))))
    if r.limit == "concurrency":
        message = {
            429: f"fake provider: the concurrency limit of {r.limit_value} open requests is reached",
            503: "The server is overloaded or not ready yet.",
            529: "Overloaded",
        }[r.status]
        if dialect == "gemini" and r.status != 429:
            message = "The model is overloaded. Please try again later."
        return r.status, error_body(dialect, r.status, message, retry_delay_s=r.retry_after_s), headers
    wait, n = r.retry_after_text, r.limit_value
    if openai:
        message = (
            f"Rate limit reached for {model} in organization org-fake on requests per min (RPM): "
            f"Limit {n}, Used {n}, Requested 1. Please try again in {wait}s."
        )
        headers += [
            ("x-ratelimit-limit-requests", str(r.limit_value)),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", f"{wait}s"),
        ]
    elif dialect == "anthropic":
        message = f"This request would exceed the rate limit for your organization of {n} requests per minute."
        reset = datetime.fromtimestamp(math.ceil(time.time() + r.retry_after_s), UTC)
        headers += [
            ("anthropic-ratelimit-requests-limit", str(r.limit_value)),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", reset.strftime("%Y-%m-%dT%H:%M:%SZ")),
        ]
    elif dialect == "bedrock-converse":
        message = "Too many requests, please wait before trying again."
    else:
        message = "Resource has been exhausted (e.g. check quota)."
    body = error_body(
        dialect, 429, message, retry_delay_s=r.retry_after_s, quota_id="GenerateRequestsPerMinutePerProjectPerModel"
    )
    return 429, body, headers


def _plain(status: int, message: str) -> bytes:
    body = message.encode()
    head = _head(status, [("content-type", "text/plain"), ("content-length", str(len(body))), ("connection", "close")])
    return head + body


@asynccontextmanager
async def serve_fake_provider(
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str = "sluice-fake-key",
    examples_dir: Path | str | None = None,
    limits: ProviderLimits | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[FakeProvider]:
    """Run the fake provider for the duration of the block (port 0: a free port, see ``.port``).
    ``limits``: its own capacity (default none); ``clock``: the seconds the RPM window is measured in."""
    examples = Path(examples_dir) if examples_dir is not None else DEFAULT_EXAMPLES
    server = FakeProvider(api_key, examples, limits=limits, clock=clock)
    await server.start(host, port)
    try:
        yield server
    finally:
        await server.aclose()


# -- the command line ------------------------------------------------------------------------------------


def configure_parser(p: argparse.ArgumentParser) -> None:
    from sluice.harness.fake.scenarios import SCENARIO_HELP

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = SCENARIO_HELP + (f"\n{p.epilog}" if p.epilog else "")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8089, help="port to listen on; 0 picks a free one (default 8089)")
    p.add_argument(
        "--api-key",
        default=None,
        help="the key clients must send (default: $SLUICE_FAKE_API_KEY); never printed",
    )
    p.add_argument("--examples-dir", default=str(DEFAULT_EXAMPLES), help="transcripts: DIR/<dialect>/<name>.sse")
    g = p.add_argument_group("capacity (the fake as one account; past a limit it answers 429 with retry-after)")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests in flight at once; past it 429 (or --concurrency-status) with retry-after "
        "(default: no cap)",
    )
    g.add_argument(
        "--requests-per-minute",
        type=int,
        default=None,
        metavar="N",
        help="at most N admitted requests in any --rate-window seconds; past it 429 with retry-after "
        "(default: no limit)",
    )
    g.add_argument(
        "--rate-window", type=float, default=60.0, metavar="S", help="the RPM window in seconds (default 60)"
    )
    g.add_argument(
        "--concurrency-status",
        type=int,
        default=429,
        choices=CONCURRENCY_STATUSES,
        help="the status past the cap: 429 rate limit, 503 or 529 overloaded (default 429)",
    )
    g.add_argument(
        "--concurrency-retry-after",
        type=float,
        default=1.0,
        metavar="S",
        help="the retry-after past the cap, seconds (default 1)",
    )


def limits_from_args(args: argparse.Namespace) -> ProviderLimits:
    """The capacity flags as ``ProviderLimits``. Raises ``ValueError`` naming the flag's value."""
    return ProviderLimits(
        max_concurrency=args.max_concurrency,
        requests_per_minute=args.requests_per_minute,
        window_s=args.rate_window,
        concurrency_status=args.concurrency_status,
        concurrency_retry_after=args.concurrency_retry_after,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; prints the base URL on one line once listening."""
    key = args.api_key or os.environ.get("SLUICE_FAKE_API_KEY", "")
    if not key:
        print("sluice fake-provider: no API key: pass --api-key or set SLUICE_FAKE_API_KEY", file=sys.stderr)
        return 2
    try:
        limits = limits_from_args(args)
    except ValueError as exc:
        print(f"sluice fake-provider: {exc}", file=sys.stderr)
        return 2
    _raise_fd_limit()
    try:
        asyncio.run(_serve_forever(args.host, args.port, key, Path(args.examples_dir), limits))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"sluice fake-provider: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


async def _serve_forever(host: str, port: int, key: str, examples: Path, limits: ProviderLimits) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with serve_fake_provider(host, port, key, examples, limits) as fake:
        print(fake.base_url, flush=True)
        await stop.wait()


def _raise_fd_limit() -> None:
    # A thousand concurrent streams need more than the usual soft limit of 1,024 descriptors.
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m sluice.harness.fake.provider``: the same as ``sluice fake-provider``."""
    parser = argparse.ArgumentParser(prog="sluice fake-provider", description="the local fake LLM provider")
    configure_parser(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

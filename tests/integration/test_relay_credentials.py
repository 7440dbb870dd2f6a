"""One credential per request (RFC 6750 §2: "clients MUST NOT use more than one method"): every
combination of ``Authorization: Bearer``, ``?token=`` and the session cookie, each valid or not, on SSE,
the AI SDK format and the WebSocket, against a running relay. More than one is ``400 invalid_request``
whatever their validity; exactly one is judged on its own (200 / 101, else 403); none is 401."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import pytest
import websockets

from sluice.relay import serve_relay, sign_token
from tests.integration.conftest import cleanup
from tests.integration.test_relay import SECRET, Attempt, config_for, events_url, write_request

pytestmark = pytest.mark.asyncio

RID = "cred1"
METHODS = ("bearer", "query", "cookie")
TWO = {"error": "more than one credential: send one of Authorization: Bearer, ?token= or the session cookie"}
INVALID_REQUEST = {**TWO, "code": "invalid_request"}


def _tokens() -> dict[bool, str]:
    """A token for this request (valid) and one signed for another request (alone: 403)."""
    exp = int(time.time()) + 600
    return {True: sign_token(SECRET, RID, exp), False: sign_token(SECRET, "another", exp)}


def _request(sent: dict[str, bool], tokens: dict[bool, str]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The headers and query of a request carrying the credentials in ``sent`` (method -> valid)."""
    headers: list[tuple[str, str]] = []
    query: dict[str, str] = {}
    if "bearer" in sent:
        headers.append(("Authorization", f"Bearer {tokens[sent['bearer']]}"))
    if "query" in sent:
        query["token"] = tokens[sent["query"]]
    if "cookie" in sent:
        headers.append(("Cookie", f"sluice_session={tokens[sent['cookie']]}"))
    return headers, query


def _cases() -> list[dict[str, bool]]:
    """Every subset of the three methods, with every validity of each."""
    out: list[dict[str, bool]] = []
    for n in range(len(METHODS) + 1):
        for methods in itertools.combinations(METHODS, n):
            for valid in itertools.product((True, False), repeat=n):
                out.append(dict(zip(methods, valid, strict=True)))
    return out


def _expected(sent: dict[str, bool], ok: int) -> int:
    if len(sent) > 1:
        return 400
    if not sent:
        return 401
    return ok if next(iter(sent.values())) else 403


async def _ws(url: str, headers: list[tuple[str, str]]) -> tuple[int, dict[str, str] | None, str | None]:
    """The handshake's status, its JSON body when refused and its WWW-Authenticate header."""
    try:
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.recv()
            return 101, None, None
    except websockets.InvalidStatus as exc:
        body = json.loads(exc.response.body) if exc.response.body else None
        return exc.response.status_code, body, exc.response.headers.get("www-authenticate")


async def test_every_combination_of_credentials(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, RID, [Attempt(RID, 1).block("text", ["hi"]).done()])
    tokens = _tokens()
    cases = _cases()
    assert len(cases) == 27 and sum(len(c) > 1 for c in cases) == 20
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, RID)
            ws_url = relay.url.replace("http", "ws") + f"/v1/requests/{RID}/ws"
            seen: list[tuple[str, dict[str, bool], int]] = []
            for sent in cases:
                headers, query = _request(sent, tokens)
                for fmt in ("sse", "ai-sdk"):
                    params = {**query, "format": "ai-sdk"} if fmt == "ai-sdk" else query
                    got = await client.get(url, params=params, headers=headers)
                    seen.append((fmt, sent, got.status_code))
                    if got.status_code == 400:
                        assert got.json() == INVALID_REQUEST
                        assert got.headers["www-authenticate"] == 'Bearer error="invalid_request"'
                    elif got.status_code == 200:
                        assert got.text.strip() and "hi" in got.text
                    head = await client.head(url, params=params, headers=headers)
                    seen.append((f"{fmt} HEAD", sent, head.status_code))
                ws_query = f"?token={query['token']}" if "token" in query else ""
                status, body, challenge = await _ws(ws_url + ws_query, headers)
                seen.append(("ws", sent, status))
                if status == 400:
                    assert body == INVALID_REQUEST and challenge == 'Bearer error="invalid_request"'
            expected = [
                (fmt, sent, _expected(sent, 101 if fmt == "ws" else 200))
                for sent in cases
                for fmt in ("sse", "sse HEAD", "ai-sdk", "ai-sdk HEAD", "ws")
            ]
            assert sorted(seen, key=repr) == sorted(expected, key=repr)
    finally:
        await cleanup(redis_client, key_prefix)


async def test_two_bearer_headers_are_two_credentials(redis_url, key_prefix, redis_client) -> None:
    """Two Authorization headers, even both valid, on the streams, the session and the metrics; a header
    of another scheme is no relay credential, and an emptied session cookie is no session."""
    await write_request(redis_client, key_prefix, RID, [Attempt(RID, 1).done()])
    valid = _tokens()[True]
    twice = [("Authorization", f"Bearer {valid}"), ("Authorization", f"Bearer {SECRET}")]
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, RID)
            for target in (url, f"{url}?format=ai-sdk"):
                got = await client.get(target, headers=twice)
                assert (got.status_code, got.json()) == (400, INVALID_REQUEST)
            session = await client.post(f"{relay.url}/v1/requests/{RID}/session", headers=twice)
            assert (session.status_code, session.json()) == (400, INVALID_REQUEST)
            assert "set-cookie" not in session.headers
            scrape = await client.get(f"{relay.url}/metrics", headers=twice)
            assert (scrape.status_code, scrape.json()) == (400, INVALID_REQUEST)
            ws = relay.url.replace("http", "ws") + f"/v1/requests/{RID}/ws"
            assert (await _ws(ws, twice))[:2] == (400, INVALID_REQUEST)
            other_scheme = [("Authorization", "Basic dXNlcjpwYXNz")]
            assert (await client.get(url, params={"token": valid}, headers=other_scheme)).status_code == 200
            emptied = [("Cookie", "sluice_session=")]
            assert (await client.get(url, params={"token": valid}, headers=emptied)).status_code == 200
    finally:
        await cleanup(redis_client, key_prefix)

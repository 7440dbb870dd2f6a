"""Browser access: allowed origins (CORS for HTTP, the Origin check for WebSockets; same origin only by
default) and the refresh path (a short-lived token exchanged for a session cookie scoped to one request)."""

from __future__ import annotations

import time

import httpx
import pytest
import websockets

from sluice.relay import serve_relay, sign_token
from tests.integration.conftest import cleanup
from tests.integration.test_relay import AUTH, SECRET, Attempt, config_for, events_url, write_request

pytestmark = pytest.mark.asyncio

APP = "https://app.example"
EVIL = "https://evil.example"


async def _ws_status(url: str, headers: dict[str, str]) -> int:
    try:
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.recv()
            return 101
    except websockets.InvalidStatus as exc:
        return exc.response.status_code


async def test_origins_default_to_same_origin_only(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "c1", [Attempt("c1", 1).block("text", ["hi"]).done()])
    try:
        async with serve_relay(config_for(redis_url, key_prefix)) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "c1")
            own = f"http://127.0.0.1:{relay.port}"
            same = await client.get(url, headers={**AUTH, "Origin": own})
            assert same.status_code == 200 and "access-control-allow-origin" not in same.headers
            other = await client.get(url, headers={**AUTH, "Origin": APP})
            assert other.status_code == 403 and other.json() == {"error": "origin not allowed"}
            assert "access-control-allow-origin" not in other.headers
            preflight = await client.options(url, headers={"Origin": APP, "Access-Control-Request-Method": "GET"})
            assert preflight.status_code == 403
            no_origin = await client.get(url, headers=AUTH)  # servers and curl send none
            assert no_origin.status_code == 200
            ws = relay.url.replace("http", "ws") + "/v1/requests/c1/ws"
            assert await _ws_status(ws, {**AUTH, "Origin": APP}) == 403
            assert await _ws_status(ws, {**AUTH, "Origin": own}) == 101
            assert await _ws_status(ws, AUTH) == 101
            mux = relay.url.replace("http", "ws") + "/v1/ws"
            with pytest.raises(websockets.InvalidStatus) as denied:
                async with websockets.connect(mux, additional_headers={"Origin": EVIL}):
                    pass
            assert denied.value.response.status_code == 403
    finally:
        await cleanup(redis_client, key_prefix)


async def test_configured_origins_get_cors(redis_url, key_prefix, redis_client) -> None:
    await write_request(redis_client, key_prefix, "c2", [Attempt("c2", 1).block("text", ["hi"]).done()])
    try:
        config = config_for(redis_url, key_prefix, allowed_origins=(APP + ":443",))  # normalized: default port
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            url = events_url(relay.url, "c2")
            preflight = await client.options(
                url,
                headers={
                    "Origin": APP,
                    "Access-Control-Request-Method": "GET",
                    "Access-Control-Request-Headers": "authorization, last-event-id",
                },
            )
            assert preflight.status_code == 204
            h = preflight.headers
            assert h["access-control-allow-origin"] == APP and h["access-control-allow-credentials"] == "true"
            allowed = {x.strip() for x in h["access-control-allow-headers"].split(",")}
            assert {"authorization", "last-event-id"} <= allowed
            assert "GET" in h["access-control-allow-methods"] and h["vary"] == "Origin"
            got = await client.get(url, headers={**AUTH, "Origin": APP})
            assert got.status_code == 200 and got.headers["access-control-allow-origin"] == APP
            assert "retry-after" in got.headers["access-control-expose-headers"]
            # refusals carry CORS too, so the page can read why (401 here)
            refused = await client.get(url, headers={"Origin": APP})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP
            module = await client.get(relay.url + "/static/sluice.js", headers={"Origin": APP})
            assert module.headers["access-control-allow-origin"] == APP  # importable cross-origin
            assert (await client.get(url, headers={**AUTH, "Origin": EVIL})).status_code == 403
            ws = relay.url.replace("http", "ws") + "/v1/requests/c2/ws"
            assert await _ws_status(ws, {**AUTH, "Origin": APP}) == 101
            assert await _ws_status(ws, {**AUTH, "Origin": EVIL}) == 403
        async with serve_relay(config_for(redis_url, key_prefix, allowed_origins=("*",))) as relay:
            async with httpx.AsyncClient() as client:
                anyone = await client.get(events_url(relay.url, "c2"), headers={**AUTH, "Origin": EVIL})
            assert anyone.status_code == 200 and anyone.headers["access-control-allow-origin"] == EVIL
    finally:
        await cleanup(redis_client, key_prefix)


def _cookie(resp: httpx.Response) -> tuple[str, dict[str, str]]:
    value, *attrs = [p.strip() for p in resp.headers["set-cookie"].split(";")]
    flags = {a.split("=", 1)[0].lower(): (a.split("=", 1)[1] if "=" in a else "") for a in attrs}
    return value, flags


async def test_a_short_lived_token_is_exchanged_for_a_session_cookie(redis_url, key_prefix, redis_client) -> None:
    """The page's URL token expires; its reconnects then ride on the HttpOnly cookie it got for it, which
    is scoped to that one request's endpoints."""
    await write_request(redis_client, key_prefix, "s1", [Attempt("s1", 1).block("text", ["hi"]).done()])
    await write_request(redis_client, key_prefix, "s2", [Attempt("s2", 1).done()])
    now = int(time.time())
    fresh, expired = sign_token(SECRET, "s1", now + 30), sign_token(SECRET, "s1", now - 1)
    try:
        config = config_for(redis_url, key_prefix, session_ttl=600)
        async with serve_relay(config) as relay, httpx.AsyncClient() as client:
            session_url = f"{relay.url}/v1/requests/s1/session"
            assert (await client.post(session_url)).status_code == 401
            denied = await client.post(session_url, headers={"Authorization": f"Bearer {expired}"})
            assert denied.status_code == 403 and "set-cookie" not in denied.headers
            assert (await client.get(session_url)).status_code == 405  # no token in a URL here
            made = await client.post(session_url, headers={"Authorization": f"Bearer {fresh}"})
            assert made.status_code == 200 and now + 600 <= made.json()["expires_at"] <= now + 602
            value, flags = _cookie(made)
            assert value.startswith("sluice_session=sl1.") and fresh not in value
            assert flags == {
                "max-age": "600",
                "path": "/v1/requests/s1/",
                "httponly": "",
                "samesite": "Strict",
                "secure": "",
            }
            cookie = {"Cookie": value}
            url = events_url(relay.url, "s1")
            # the URL's token has expired: alone it is refused, the cookie alone serves the stream (both
            # together are two credentials: refused, see test_relay_credentials)
            assert (await client.get(url, params={"token": expired})).status_code == 403
            with_cookie = await client.get(url, headers=cookie)
            assert with_cookie.status_code == 200 and "event: end" in with_cookie.text
            # the session grants this request only
            assert (await client.get(events_url(relay.url, "s2"), headers=cookie)).status_code == 403
            # signing out clears it
            out = await client.delete(session_url)
            assert out.status_code == 204 and _cookie(out)[0] == "sluice_session=" and _cookie(out)[1]["max-age"] == "0"
        lax = config_for(redis_url, key_prefix, cookie_secure=False, cookie_samesite="Lax")
        async with serve_relay(lax) as relay, httpx.AsyncClient() as client:
            made = await client.post(f"{relay.url}/v1/requests/s1/session", headers=AUTH)
            flags = _cookie(made)[1]
            assert "secure" not in flags and flags["samesite"] == "Lax"
    finally:
        await cleanup(redis_client, key_prefix)

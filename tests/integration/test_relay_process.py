"""``sluice relay`` as a process: prints its URL, serves, and on SIGTERM ends client streams cleanly."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from tests.integration.conftest import cleanup
from tests.integration.test_relay import (
    AUTH,
    SECRET,
    Attempt,
    Received,
    events_url,
    publish,
    read_sse,
    stored,
    wait_until,
)

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
ENTRY = (
    "import argparse, resource, sys\n"
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # a low soft limit: the relay raises it\n"
    "from sluice.relay.cli import configure_parser, run_from_args\n"
    "p = argparse.ArgumentParser()\n"
    "configure_parser(p)\n"
    "sys.exit(run_from_args(p.parse_args(sys.argv[1:])))\n"
)


async def test_process_serves_and_stops_on_sigterm(redis_url, key_prefix, redis_client) -> None:
    a = Attempt("proc", 1).block("text", ["a", "b", "c"]).done()
    await publish(redis_client, key_prefix, "proc", 1, a.events[:4])  # running: the stream stays open
    env = {**os.environ, "SLUICE_RELAY_SECRETS": SECRET, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", ENTRY, "--port", "0", "--redis-url", redis_url, "--key-prefix", key_prefix]
    proc = await anyio.open_process(argv, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        records: list[dict] = []
        err = b""
        with anyio.fail_after(10):  # JSON log records only; the one saying it listens names the URL
            while not any(r["msg"].startswith("listening on ") for r in records):
                err += await proc.stderr.receive()
                *lines, _partial = err.split(b"\n")
                records = [json.loads(line) for line in lines]
        listening = next(r for r in records if r["msg"].startswith("listening on "))
        assert listening["logger"] == "sluice.relay" and listening["url"].startswith("http://127.0.0.1:")
        url = listening["url"]
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/healthz")).json() == {"ok": True}
            assert (await client.get(events_url(url, "proc") + "?token=not-a-token")).status_code == 403
            metrics = (await client.get(url + "/metrics", headers=AUTH)).text
            values = dict(ln.split() for ln in metrics.splitlines() if not ln.startswith("#"))
            soft = int(values["sluice_relay_fd_soft_limit"])
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            assert soft == (hard if hard != resource.RLIM_INFINITY else 1_048_576) and soft > 256
            got = []
            async with anyio.create_task_group() as tg:
                reading = Received(0)

                async def follow() -> None:
                    got.append(await read_sse(client, events_url(url, "proc"), headers=AUTH, into=reading))

                tg.start_soon(follow)
                await wait_until(lambda: len(reading.contract) == 4)  # following: the four events written
                proc.send_signal(signal.SIGTERM)
            assert got[0].contract == await stored(redis_client, key_prefix, "proc")
            assert not got[0].ended  # not final: a client resumes elsewhere
        with anyio.fail_after(10):
            assert await proc.wait() == 0
        async for chunk in proc.stderr:
            err += chunk
        assert SECRET.encode() not in err
        records = [json.loads(line) for line in err.splitlines()]  # every line is a JSON record
        access = [r for r in records if r["logger"] == "sluice.relay.access"]
        # the refused request, then the stream the shutdown ended (probes that answer 2xx are logged at debug)
        assert [(r["method"], r["path"], r["status"]) for r in access] == [
            ("GET", "/v1/requests/proc/events", 403),
            ("GET", "/v1/requests/proc/events", 200),
        ]
        assert access[1]["bytes"] > 0 and access[1]["ms"] > 0 and "completed" not in access[1]
        assert b"not-a-token" not in err  # the query string (a token) is never logged
        out = b""
        async for chunk in proc.stdout:
            out += chunk
        assert out == b""  # nothing outside the log records
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()
        await cleanup(redis_client, key_prefix)

"""What a relay costs per client, measured: ``python -m sluice.relay.measure --clients 1000``.

Rule: the relay runs as its own process, started the way an operator starts it (``sluice relay``, with
the usual soft descriptor limit of 1,024 unless told otherwise), and the clients run in this process over
plain sockets; every number is read from the relay process (descriptors, RSS, CPU, its connections to
Redis) while all clients hold a stream, and every client must receive the whole log. Writes its request
logs under a fresh key prefix and deletes them afterwards. Needs ``psutil`` (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis

from sluice.schemas.keys import Keys

__all__ = ["main"]

SECRET = "measure-secret-" + "0" * 16
_ENTRY = (
    "import argparse, resource, sys\n"
    "soft = int(sys.argv[1]); hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))\n"
    "from sluice.relay.cli import configure_parser, run_from_args\n"
    "p = argparse.ArgumentParser(); configure_parser(p)\n"
    "sys.exit(run_from_args(p.parse_args(sys.argv[2:])))\n"
)


def _event(rid: str, seq: int, kind: str, **fields: Any) -> bytes:
    doc = {"type": kind, "stream_id": f"{rid}:1", "request_id": rid, "seq": seq, "ts": seq, "raw": [seq], **fields}
    return msgspec.json.encode(doc)


def _log(rid: str, deltas: int) -> list[tuple[str, bytes]]:
    block = {"id": "b_0", "index": 0, "kind": "text"}
    out = [("stream.start", _event(rid, 1, "stream.start", provider="p", dialect="anthropic", model="m", attempt=1))]
    out.append(("block.start", _event(rid, 2, "block.start", block=block)))
    for i in range(deltas):
        out.append(
            ("block.delta", _event(rid, 3 + i, "block.delta", block=block, delta={"kind": "text", "text": f"t{i} "}))
        )
    n = 3 + deltas
    out.append(("block.stop", _event(rid, n, "block.stop", block=block)))
    out.append(
        ("stream.done", _event(rid, n + 1, "stream.done", stop_reason="stop", provider_stop_reason=None, usage=None))
    )
    return out


async def _publish(r: aioredis.Redis, keys: Keys, rid: str, events: list[tuple[str, bytes]], first: int) -> None:
    rk = keys.request(rid)
    async with r.pipeline(transaction=False) as p:
        for k, (kind, data) in enumerate(events, first):
            p.xadd(rk.events, {"type": kind, "event": data}, id=f"1-{k}")
        p.hset(rk.status, mapping={"request_id": rid, "attempt": 1, "state": "running"})
        await p.execute()


async def _sse_client(host: str, port: int, rid: str, joined: asyncio.Event, counter: list[int]) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"GET /v1/requests/{rid}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode()
    )
    events = 0
    first = True
    try:
        while line := await reader.readline():
            if line.startswith(b"id: "):
                events += 1
                if first:
                    first = False
                    counter[0] += 1
                    if counter[0] == counter[1]:
                        joined.set()
            elif line.startswith(b"event: end"):
                break
    finally:
        writer.close()
    return events


async def _mux_client(host: str, port: int, rids: list[str], joined: asyncio.Event, counter: list[int]) -> int:
    import websockets

    events = 0
    pending = set(rids)
    started: set[str] = set()
    async with websockets.connect(f"ws://{host}:{port}/v1/ws", max_size=None) as ws:
        await ws.send(json.dumps({"type": "auth", "token": SECRET}))
        for rid in rids:
            await ws.send(json.dumps({"type": "subscribe", "request_id": rid}))
        async for raw in ws:
            m = json.loads(raw)
            rid = m.get("request_id")
            if "id" in m:
                events += 1
                if rid not in started:
                    started.add(rid)
                    counter[0] += 1
                    if counter[0] == counter[1]:
                        joined.set()
            elif m.get("event") == "end":
                pending.discard(rid)
                if not pending:
                    break
    return events


def _start_relay(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """``sluice relay`` as its own process, and the URL it prints once listening."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().split()[-1]


def _redis_connections(proc: Any, redis_port: int) -> int:
    return sum(1 for c in proc.net_connections(kind="tcp") if c.raddr and c.raddr.port == redis_port)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    keys = Keys(f"relaymeasure:{uuid.uuid4().hex[:8]}")
    redis_port = urlsplit(args.redis_url).port or 6379
    r = aioredis.Redis.from_url(args.redis_url)
    rids = [f"m{i}" for i in range(args.requests)]
    logs = {rid: _log(rid, args.deltas) for rid in rids}
    for rid in rids:
        await _publish(r, keys, rid, logs[rid][:3], 1)  # live: started, a few events, no terminal
    env = {**os.environ, "SLUICE_RELAY_SECRETS": SECRET}
    argv = [
        sys.executable,
        "-c",
        _ENTRY,
        str(args.soft_limit),
        "--port",
        "0",
        "--redis-url",
        args.redis_url,
        "--key-prefix",
        keys.prefix,
        "--max-clients",
        str(args.clients + 100),
        "--log-level",
        "WARNING",
        "--max-streams-per-socket",
        str(max(64, args.clients // max(1, args.sockets) + 1)),
    ]
    proc, url = await asyncio.to_thread(_start_relay, argv, env)
    try:
        host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 0
        ps = psutil.Process(proc.pid)
        base = {"fds": ps.num_fds(), "rss_kib": ps.memory_info().rss // 1024}
        joined = asyncio.Event()
        counter = [0, args.clients]
        started = time.monotonic()
        if args.mode == "sse":
            tasks = [
                asyncio.create_task(_sse_client(host, port, rids[k % len(rids)], joined, counter))
                for k in range(args.clients)
            ]
        else:
            per = max(1, args.clients // args.sockets)
            groups = [[rids[(s * per + k) % len(rids)] for k in range(per)] for s in range(args.sockets)]
            # one subscription per request per socket: distinct requests on each socket
            groups = [list(dict.fromkeys(g)) for g in groups]
            counter[1] = sum(len(g) for g in groups)
            tasks = [asyncio.create_task(_mux_client(host, port, g, joined, counter)) for g in groups]
        await asyncio.wait_for(joined.wait(), timeout=120)
        join_s = time.monotonic() - started
        cpu0 = ps.cpu_times()
        held = {
            "fds": ps.num_fds(),
            "rss_kib": ps.memory_info().rss // 1024,
            "redis_connections": _redis_connections(ps, redis_port),
        }
        t0 = time.monotonic()
        for rid in rids:
            await _publish(r, keys, rid, logs[rid][3:], 4)
            await r.hset(keys.request(rid).status, "state", "completed")
        counts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        elapsed = time.monotonic() - t0
        cpu1 = ps.cpu_times()
        delivered = sum(counts)
        expected = counter[1] * len(logs[rids[0]])
        proc.terminate()
        _, stderr = await asyncio.to_thread(proc.communicate, None, 20)
        return {
            "mode": args.mode,
            "clients": counter[1],
            "requests": args.requests,
            "sockets": args.sockets,
            "events_per_request": len(logs[rids[0]]),
            "soft_limit_at_start": args.soft_limit,
            "relay_before_clients": base,
            "relay_with_clients": held,
            "fds_per_stream": round((held["fds"] - base["fds"]) / counter[1], 3),
            "rss_kib_per_stream": round((held["rss_kib"] - base["rss_kib"]) / counter[1], 2),
            "join_seconds": round(join_s, 2),
            "fan_out_seconds": round(elapsed, 2),
            "relay_cpu_us_per_delivered_event": round(
                ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) * 1e6 / max(1, delivered - counter[1]), 2
            ),
            "events_delivered": delivered,
            "events_expected": expected,
            "complete": delivered == expected,
            "relay_errors_logged": stderr.decode().count('"levelname": "ERROR"') + stderr.decode().count("Traceback"),
        }
    finally:
        if proc.poll() is None:
            proc.kill()
        async for key in r.scan_iter(match=f"{keys.prefix}:*", count=1000):
            await r.delete(key)
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.relay.measure", description=__doc__)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--requests", type=int, default=1, help="requests the clients spread over")
    p.add_argument("--deltas", type=int, default=50)
    p.add_argument("--mode", choices=("sse", "mux"), default="sse")
    p.add_argument("--sockets", type=int, default=10, help="with --mode mux: WebSockets the clients share")
    p.add_argument("--soft-limit", type=int, default=1024, help="the relay's soft RLIMIT_NOFILE at start")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the clients' side needs one per connection
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``sluice bench archive``: the archiver's throughput (requests/s, MB/s) and its CPU per archived entry.

Rule: N synthetic finished requests (a status hash, ``--entries`` raw and as many normalized entries of
realistic sizes, one terminal entry each) are written under a private key prefix of the Redis at
``$REDIS_URL`` (default 127.0.0.1:6379), one archiver (``--concurrency``) drains them into a temporary
local directory with ``once``, and the wall time and this process's CPU time are measured around it; the
keys and the directory are removed afterwards. Numbers are measurements, never assertions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import anyio
import msgspec
from rich.console import Console
from rich.table import Table

__all__ = ["run_archive", "seed_finished_requests"]


async def seed_finished_requests(client: Any, n: int, entries: int, *, tag: str = "bench") -> int:
    """Write the requests; returns the bytes of field values stored (the archived input)."""
    keys = client.keys
    size = 0
    now = int(time.time() * 1000)
    for i in range(n):
        rid = f"{tag}-{i:06d}"
        rk = keys.request(rid)
        status = {
            "state": "completed",
            "route": "bench",
            "model": "synthetic",
            "attempt": "1",
            "finished_at": str(now),
            "raw_count": str(entries + 1),
            "event_count": str(entries),
            "result_hash": "0" * 64,
            "usage": '{"input_tokens":1200,"output_tokens":800}',
            "metadata": '{"tenant":"acme"}',
        }
        async with client.redis.pipeline(transaction=False) as p:
            p.hset(rk.status, mapping=status)
            p.xadd(rk.raw, {"kind": "http", "data": '{"status":200,"headers":{}}'}, id="1-0")
            for j in range(1, entries + 1):
                data = msgspec.json.encode(
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "word " * 12}}
                )
                p.xadd(
                    rk.raw,
                    {
                        "kind": "sse",
                        "event": "content_block_delta",
                        "data": data,
                        "offset": str(j * 180),
                        "ts": str(now),
                    },
                    id=f"1-{j}",
                )
                ev = msgspec.json.encode(
                    {
                        "type": "block.delta",
                        "stream_id": f"{rid}:1",
                        "request_id": rid,
                        "seq": j,
                        "ts": now,
                        "index": 0,
                        "text": "word " * 12,
                        "raw": [j],
                    }
                )
                p.xadd(rk.events, {"event": ev}, id=f"1-{j}")
                size += len(data) + len(ev) + 40
            p.xadd(
                keys.shard_for(rid).terminal,
                {"request_id": rid, "status": "completed", "attempt": "1", "metadata": "{}"},
            )
            await p.execute()
    return size


def run_archive(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from sluice.archive.archiver import Archiver
    from sluice.archive.store import LocalStore
    from sluice.client import SluiceClient

    n = args.requests or (200 if args.quick else 2000)
    entries = args.entries or (50 if args.quick else 200)
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"sluice-bench:archive-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix="sluice-bench-archive-")

    async def go() -> dict[str, Any]:
        async with SluiceClient(url, key_prefix=prefix) as client:
            try:
                stored = await seed_finished_requests(client, n, entries)
                archiver = Archiver(client, LocalStore(root), concurrency=args.concurrency, lag_interval=3600)
                cpu0, t0 = time.process_time(), time.perf_counter()
                stats = await archiver.run(once=True)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            finally:
                async for key in client.redis.scan_iter(match=f"{prefix}:*", count=1000):
                    await client.redis.delete(key)
        return {
            "requests": n,
            "entries_per_request": entries * 2 + 1,
            "archived": stats.archived,
            "wall_s": wall,
            "cpu_s": cpu,
            "requests_per_s": stats.archived / wall,
            "input_mb_per_s": stored / wall / 1e6,
            "written_mb_per_s": stats.bytes / wall / 1e6,
            "compression_ratio": stored / stats.bytes if stats.bytes else 0.0,
            "cpu_us_per_entry": cpu / stats.events * 1e6 if stats.events else 0.0,
            "concurrency": args.concurrency,
        }

    try:
        result = anyio.run(go)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table(title="archiver (Redis -> local directory)")
    for col in ("requests", "req/s", "input MB/s", "written MB/s", "ratio", "CPU µs/entry"):
        table.add_column(col, justify="right")
    table.add_row(
        str(result["archived"]),
        f"{result['requests_per_s']:.0f}",
        f"{result['input_mb_per_s']:.1f}",
        f"{result['written_mb_per_s']:.1f}",
        f"{result['compression_ratio']:.1f}x",
        f"{result['cpu_us_per_entry']:.1f}",
    )
    console.print(table)
    return result

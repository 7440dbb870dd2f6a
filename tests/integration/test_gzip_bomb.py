"""A misbehaving upstream: asked for ``accept-encoding: identity``, it answers ``content-encoding: gzip``
with 200 KB that inflate to 200 MB (one endless SSE line). Twenty such streams at once through a worker
process: each ends ``failed`` / ``limit_exceeded`` (the line limit), and the worker's peak RSS stays
bounded because the body is inflated only as fast as the normalizer takes it."""

from __future__ import annotations

import asyncio
import signal
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio

from tests.integration.conftest import cleanup, client_for, make_config, spawn_worker, write_config_file

pytestmark = pytest.mark.asyncio
STREAMS = 20
INFLATED_MB = 200


def _bomb() -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"a" * (1 << 20)
    return z.compress(b"data: ") + b"".join(z.compress(block) for _ in range(INFLATED_MB)) + z.flush()


class BombServer:
    def __init__(self) -> None:
        self.body = _bomb()
        self.requests: list[bytes] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            length = next((int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.requests.append(head)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(self.body) + self.body + b"\r\n0\r\n\r\n"
            )
            await writer.drain()
            await reader.read()  # until the worker hangs up
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest_asyncio.fixture
async def bomb() -> AsyncIterator[BombServer]:
    srv = BombServer()
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    srv.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield srv


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc")
@pytest.mark.parametrize("http_client", ["wire", "httpx"])
async def test_twenty_gzip_bombs_end_limit_exceeded_with_bounded_memory(
    http_client, bomb, redis_url, key_prefix, redis_client, tmp_path
) -> None:
    path = tmp_path / "sluice.toml"
    cfg = write_config_file(path, redis_url, key_prefix, bomb.url, model="m", http_client=http_client)
    log = tmp_path / "worker.log"
    proc = spawn_worker(cfg, log)
    try:
        with anyio.fail_after(30):
            while b"worker started" not in log.read_bytes():  # noqa: ASYNC110 - a process's log, nothing to await
                await anyio.sleep(0.05)
        baseline = _peak_rss_mib(proc.pid)
        async with client_for(make_config(redis_url, key_prefix, bomb.url)) as client:
            job = {"route": "anthropic", "request": {"messages": [{"role": "user", "content": "x"}]}}
            rids = [await client.enqueue(job) for _ in range(STREAMS)]
            results = [await client.result(rid, timeout=60) for rid in rids]
        peak = _peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(proc.wait)
        await cleanup(redis_client, key_prefix)
    assert len(bomb.requests) == STREAMS
    assert all(b"accept-encoding: identity" in head.lower() for head in bomb.requests)
    for r in results:
        assert r.status == "failed" and r.error is not None and r.error.category == "limit_exceeded", r
    # Each stream holds at most the 1 MiB line limit plus a 32 KiB read; inflating whole would be 200 MiB each.
    assert peak - baseline < 64, (baseline, peak)

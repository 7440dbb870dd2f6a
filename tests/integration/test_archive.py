"""``sluice archive`` against requests the real worker wrote: every finished request (every dialect, failed
and interrupted ones too) lands in a local directory byte-exact, once; a redelivery rewrites nothing; two
archivers share one feed; a failing destination is retried until it recovers; an archiver SIGKILLed
between its write and its ack loses and duplicates nothing."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sluice.archive import Archiver, LocalStore, read_archived
from sluice.archive.archiver import GATE_ENV, fetch_request
from sluice.archive.reader import same_request
from sluice.archive.record import decode_index
from sluice.archive.store import DestinationError
from sluice.client import SluiceClient
from sluice.client.terminals import Terminal
from sluice.normalizer.pricing import Prices, format_cost
from tests.integration.conftest import DIALECTS

# ruff: noqa: F811
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

# (route, model, expected state): every dialect completed, plus failed and interrupted endings.
REQUESTS = [(d, "synthetic;deltas=8;tools=1;reasoning=2;chunk=7", "completed") for d in DIALECTS] + [
    ("anthropic", "synthetic;deltas=6;error_after=3", "failed"),
    ("openai-chat", "synthetic;deltas=4;drop_terminal=1", "interrupted"),
    ("gemini", "synthetic;deltas=4;drop_terminal=1", "interrupted"),
    ("openai-responses", "synthetic;deltas=20;reset=3", "interrupted"),
    ("anthropic", "synthetic;deltas=5;invalid_utf8=3", "failed"),
    ("anthropic", "synthetic;status=401", "failed"),
]


def _finish_all(service: Service, tag: str) -> list[str]:
    rids = [service.enqueue(route, model, f"{tag}-{i}") for i, (route, model, _) in enumerate(REQUESTS)]
    for rid, (_, _, state) in zip(rids, REQUESTS, strict=True):
        assert service.wait_state(rid)["state"] == state, rid
    return rids


def _client(service: Service) -> SluiceClient:
    return SluiceClient(service.redis_url, key_prefix=service.prefix)


def _terminal(service: Service, rid: str) -> Terminal:
    stream = service.keys.terminal
    for entry_id, fields in service.r.xrange(stream):
        if fields[b"request_id"].decode() == rid:
            return Terminal.from_entry(stream, entry_id.decode(), fields)
    raise AssertionError(f"no terminal entry for {rid}")


def _pending(service: Service, group: str = "sluice-archive") -> int:
    return int(service.r.xpending(service.keys.terminal, group)["pending"])


def _files(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


def test_archive_once_writes_every_request_byte_exact(service: Service, tmp_path: Path) -> None:
    rids = _finish_all(service, "arch")
    code, out, err = service.cli("archive", "--to", str(tmp_path), "--once")
    assert (code, err) == (0, ""), out
    assert f"archived {len(rids)} request(s)" in out
    assert _pending(service) == 0
    store = LocalStore(tmp_path)

    async def check() -> None:
        async with _client(service) as client:
            for rid in rids:
                archived = await read_archived(store, rid)
                live = await fetch_request(client, _terminal(service, rid))
                assert live is not None
                assert same_request(archived, live) is None
                assert archived.raw == live.raw and archived.events == live.events  # bytes exact, order kept
                assert archived.status == live.status

    anyio.run(check)
    logs = sorted(p.name for p in tmp_path.glob("log/date=*/*.jsonl.gz"))
    assert logs == sorted(f"{rid}.a{service.status(rid)['attempt']}.jsonl.gz" for rid in rids)
    rows = [decode_index(p.read_bytes()) for p in tmp_path.glob("index/date=*/*.json")]
    assert sorted((r.request_id, r.status) for r in rows) == sorted(
        (rid, state) for rid, (_, _, state) in zip(rids, REQUESTS, strict=True)
    )
    # Nothing new: a second pass archives nothing and rewrites nothing.
    before = _files(tmp_path)
    code, out, _ = service.cli("archive", "--to", str(tmp_path), "--once")
    assert code == 0 and "archived 0 request(s)" in out, out
    assert _files(tmp_path) == before


def test_a_redelivered_entry_rewrites_nothing(service: Service, tmp_path: Path) -> None:
    rid = service.enqueue("anthropic", "synthetic;deltas=5", "redeliver")
    service.wait_state(rid)
    store = LocalStore(tmp_path)

    async def go() -> list[str]:
        async with _client(service) as client:
            archiver = Archiver(client, store)
            t = _terminal(service, rid)
            first = await archiver.archive_one(t)
            snap = _files(tmp_path)
            second = await archiver.archive_one(t)
            assert _files(tmp_path) == snap
            return [first, second]

    assert anyio.run(go) == ["archived", "already"]


def test_two_archivers_share_one_feed(service: Service, tmp_path: Path) -> None:
    rids = [service.enqueue(DIALECTS[i % len(DIALECTS)], "synthetic;deltas=3", f"two-{i}") for i in range(24)]
    for rid in rids:
        service.wait_state(rid)
    store = LocalStore(tmp_path)

    async def go() -> tuple[Any, Any]:
        async with _client(service) as ca, _client(service) as cb:
            a = Archiver(ca, store, consumer="a", concurrency=2)
            b = Archiver(cb, store, consumer="b", concurrency=2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(a.run, once=True))
                tg.start_soon(functools.partial(b.run, once=True))
            return a.stats, b.stats

    sa, sb = anyio.run(lambda: go())
    # Each request was written by exactly one of them, and each got a share (the group splits entries).
    assert set(sa.outcomes) | set(sb.outcomes) == set(rids)
    assert sa.archived + sb.archived == len(rids) and not set(sa.outcomes) & set(sb.outcomes)
    assert sa.archived > 0 and sb.archived > 0
    assert _pending(service) == 0
    assert len(list(tmp_path.glob("id/*.json"))) == len(rids)


class FlakyStore(LocalStore):
    """Fails its first ``fail`` writes, then works: a destination that is down and comes back."""

    def __init__(self, root: Path, fail: int) -> None:
        super().__init__(root)
        self.fail = fail
        self.attempts = 0

    async def put(self, name: str, data: bytes) -> None:
        self.attempts += 1
        if self.fail > 0:
            self.fail -= 1
            raise DestinationError("injected: the destination is down")
        await super().put(name, data)


def test_a_failing_destination_is_retried_until_it_recovers(service: Service, tmp_path: Path) -> None:
    rids = [service.enqueue("openai-chat", "synthetic;deltas=3", f"flaky-{i}") for i in range(3)]
    for rid in rids:
        service.wait_state(rid)
    store = FlakyStore(tmp_path, fail=4)

    async def go() -> Any:
        async with _client(service) as client:
            return await Archiver(client, store, concurrency=1).run(once=True)

    stats = anyio.run(go)
    assert stats.destination_errors == 4
    assert stats.archived == 3 and _pending(service) == 0
    assert store.attempts == 4 + 3 * 3  # object, index row, pointer per request

    async def check() -> None:
        for rid in rids:
            await read_archived(LocalStore(tmp_path), rid)

    anyio.run(check)


def test_sigkill_between_write_and_ack_loses_and_duplicates_nothing(service: Service, tmp_path: Path) -> None:
    rid = service.enqueue("gemini", "synthetic;deltas=4", "killed")
    service.wait_state(rid)
    gate = tmp_path / "gate"
    gate.mkdir()
    dest = tmp_path / "archive"
    env = dict(os.environ, **{GATE_ENV: str(gate), "REDIS_URL": service.redis_url, "SLUICE_KEY_PREFIX": service.prefix})
    cmd = [sys.executable, "-m", "sluice.cli.main", "archive", "--to", str(dest), "--consumer", "doomed"]
    errlog = tmp_path / "archiver.log"
    with errlog.open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while not (gate / f"written-{rid}").exists():
            assert proc.poll() is None, errlog.read_text()
            assert time.monotonic() < deadline, "the archiver never wrote"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Written, not acked: the entry is pending at the dead archiver, the pointer is there.
    assert service.r.xpending(service.keys.terminal, "sluice-archive")["consumers"][0]["name"] == b"doomed"
    assert _pending(service) == 1
    before = _files(dest)
    assert len([n for n in before if n.startswith("log/")]) == 1
    # Another archiver takes the entry over, finds it archived, acks it, and writes nothing.
    store = LocalStore(dest)

    async def go() -> Any:
        async with _client(service) as client:
            return await Archiver(client, store, consumer="heir", claim_idle_ms=50).run(once=True)

    stats = anyio.run(go)
    assert stats.outcomes == {rid: "already"} and stats.archived == 0
    assert _pending(service) == 0
    assert _files(dest) == before


def test_audit_from_the_archive_matches_audit_from_redis_for_every_ending(service: Service, tmp_path: Path) -> None:
    rids = _finish_all(service, "aud")
    assert service.cli("archive", "--to", str(tmp_path), "--once")[0] == 0
    from_redis = {rid: service.cli("audit", rid) for rid in rids}
    # Redis retention ran out: the archive alone must prove every request.
    for key in service.r.scan_iter(match=f"{service.prefix}:{{req:*", count=1000):
        service.r.delete(key)
    for rid in rids:
        code, out, err = service.cli("audit", "--archive", str(tmp_path), rid)
        assert (code, out, err) == from_redis[rid]
        assert code == 0 and out.startswith(f"audit {rid}: OK\n") and "ts differs" not in out, out
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), "--since", "1h", "--quiet")
    assert code == 0, out
    assert out.endswith(
        f"audited {len(rids)} archived request(s) finished in the last 1h: {len(rids)} ok, 0 mismatched, "
        "0 damaged archive object(s)\n"
    )


def test_a_damaged_archive_object_is_reported_as_such(service: Service, tmp_path: Path) -> None:
    import gzip

    from sluice.archive.proof import index_name
    from sluice.archive.record import decode_pointer, decode_record, encode_json, encode_record, sha256_hex

    rids = [service.enqueue("anthropic", "synthetic;deltas=6", f"dmg-{i}") for i in range(4)]
    for rid in rids:
        service.wait_state(rid)
    assert service.cli("archive", "--to", str(tmp_path), "--once")[0] == 0

    def obj(rid: str) -> Path:
        return tmp_path / decode_pointer((tmp_path / f"id/{rid}.json").read_bytes()).object

    truncated, altered, missing, rewritten = rids
    data = obj(truncated).read_bytes()
    obj(truncated).write_bytes(data[: len(data) // 2])
    text = gzip.decompress(obj(altered).read_bytes()).replace(b"synthetic", b"synthetiC", 1)
    obj(altered).write_bytes(gzip.compress(text, mtime=0))
    obj(missing).unlink()
    # A consistent rewrite (valid object, pointer and index row updated) of a raw entry: the archive is whole, the
    # normalizer's replay is what disagrees, and that is reported as a mismatch.
    req = decode_record(obj(rewritten).read_bytes())
    entry_id, fields = req.raw[1]
    fields = {**fields, b"data": fields[b"data"].replace(b"message_start", b"message_stop")}
    req.raw[1] = (entry_id, fields)
    new = encode_record(req)
    obj(rewritten).write_bytes(new)
    ptr = decode_pointer((tmp_path / f"id/{rewritten}.json").read_bytes())
    fixed = type(ptr)(
        request_id=ptr.request_id, attempt=ptr.attempt, object=ptr.object, sha256=sha256_hex(new), bytes=len(new)
    )
    (tmp_path / f"id/{rewritten}.json").write_bytes(encode_json(fixed))
    row = tmp_path / index_name(ptr.object)
    row.write_bytes(
        encode_json(msgspec.structs.replace(decode_index(row.read_bytes()), sha256=fixed.sha256, bytes=len(new)))
    )

    code, out, _ = service.cli("audit", "--archive", str(tmp_path), truncated)
    assert code == 1 and out.startswith(f"audit {truncated}: ARCHIVE TRUNCATED\n"), out
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), altered)
    assert code == 1 and out.startswith(f"audit {altered}: ARCHIVE ALTERED\n"), out
    code, out, err = service.cli("audit", "--archive", str(tmp_path), missing)
    assert code == 2 and f"request {missing} is not in the archive" in err, err
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), rewritten)
    assert code == 1 and out.startswith(f"audit {rewritten}: MISMATCH\n") and "first divergence" in out, out
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), "--since", "1h")
    assert code == 1
    lines = out.splitlines()
    assert any(line.startswith(f"TRUNCATED {truncated}") for line in lines), out
    assert any(line.startswith(f"ALTERED   {altered}") for line in lines), out
    assert any(line.startswith(f"MISSING   {missing}") for line in lines), out
    assert any(line.startswith(f"MISMATCH  {rewritten}") for line in lines), out
    assert lines[-1].endswith("0 ok, 1 mismatched, 3 damaged archive object(s)")
    # --verify compares with what Redis still holds: the same three damaged/missing, one that differs.
    code, out, _ = service.cli("archive", "--to", str(tmp_path), "--verify")
    assert code == 1
    assert out.splitlines()[-1] == ("verified: 0 ok, 1 not archived, 1 differs, 2 damaged, 0 expired in Redis"), out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_bucket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """moto's standalone S3-compatible server on a free port, with one bucket; the store's standard
    environment variables point obstore at it (no credentials in any sluice config)."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    import urllib.request

    port = _free_port()
    log = (tmp_path / "moto.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
                time.sleep(0.05)
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/arch", method="PUT")).close()
        for k, v in {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        yield "s3://arch/sluice"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_archive_to_an_s3_compatible_server_and_audit_from_it(service: Service, s3_bucket: str) -> None:
    rids = [service.enqueue(d, "synthetic;deltas=5;tools=1", f"s3-{d}") for d in DIALECTS]
    for rid in rids:
        service.wait_state(rid)
    code, out, err = service.cli("archive", "--to", s3_bucket, "--once")
    assert (code, err) == (0, ""), out
    assert f"archived {len(rids)} request(s)" in out
    for rid in rids:
        code, out, _ = service.cli("audit", "--archive", s3_bucket, rid)
        assert code == 0 and out.startswith(f"audit {rid}: OK\n"), out
    code, out, _ = service.cli("archive", "--to", s3_bucket, "--verify")
    assert code == 0 and out.splitlines()[-1].startswith(f"verified: {len(rids)} ok, 0 not archived"), out


def test_status_and_the_worker_warn_as_the_lag_nears_retention(
    service: Service, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    import logging

    from sluice.worker.observability import archive_watch
    from sluice.worker.observability.archive_watch import check_archive_lag
    from sluice.worker.pipeline.context import Deps
    from tests.integration.conftest import make_config

    rid = service.enqueue("anthropic", "synthetic;deltas=2", "lag-1")
    service.wait_state(rid)
    code, out, _ = service.cli("archive", "--status")
    assert code == 0 and "(no archiver group yet: every entry is unarchived)" in out, out  # young: below half
    code, out, _ = service.cli("archive", "--to", str(tmp_path), "--once")
    if True:
        assert code == 0
        code, out, _ = service.cli("archive", "--status")
        assert code == 0 and out.splitlines()[-1].startswith("archive lag 0.0s of retention 86400s"), out
        # A terminal entry the archivers have not read, published 10 s ago, against a 15 s retention.
        old = int(time.time() * 1000) - 10_000
        from sluice.schemas.keys import Keys

        stale = Keys(f"{service.prefix}-stale")  # a fresh terminal stream, so an old entry id is allowed
        service.r.xadd(stale.terminal, {"request_id": "ancient"}, id=f"{old}-0")
        service.r.xgroup_create(stale.terminal, "sluice-archive", id="0")
        cfg = make_config(
            redis_url, key_prefix, "http://127.0.0.1:1", retention_seconds=15, archive_group="sluice-archive"
        )

        async def check(config: Any) -> int | None:
            async with _client(service) as c:
                deps = Deps(config, c.redis, None, stale, "w-lag", None)  # type: ignore[arg-type]
                archive_watch._next_check.clear()
                return await check_archive_lag(deps.redis, deps.keys, deps.config, deps.consumer)

        with caplog.at_level(logging.WARNING, logger="sluice.worker"):
            lag = anyio.run(check, cfg)
        assert lag is not None and lag >= 10_000
        assert [r.getMessage() for r in caplog.records if r.name == "sluice.worker"] == [
            "the archive lag nears retention_seconds: finished requests may expire before they are archived"
        ]
        caplog.clear()
        calm = make_config(
            redis_url, key_prefix, "http://127.0.0.1:1", retention_seconds=100, archive_group="sluice-archive"
        )
        with caplog.at_level(logging.WARNING, logger="sluice.worker"):
            assert (anyio.run(check, calm) or 0) >= 10_000
        assert not [r for r in caplog.records if r.name == "sluice.worker"]
        service.r.delete(stale.terminal)


def test_status_names_the_retention_it_holds_the_lag_against(
    service: Service, redis_url: str, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --config the live workers' retention_seconds (they record it), with it the file's; with
    neither, a refusal instead of the built-in 24 h."""
    from sluice.schemas.keys import Keys
    from sluice.worker.pipeline.membership import announce
    from tests.integration.conftest import make_config

    code, out, _ = service.cli("archive", "--status")  # the service's own worker: the default retention
    assert code == 0, out
    assert out.splitlines()[-1].endswith("; retention_seconds from the live workers' configuration (1 worker(s)))")
    conf = tmp_path / "short.toml"
    conf.write_text("retention_seconds = 600\n")
    code, out, _ = service.cli("archive", "--status", "--config", str(conf))
    assert code == 0 and f"of retention 600s (0.0%; retention_seconds from {conf})" in out.splitlines()[-1], out
    # A fleet whose workers run with a retention shorter than the default: the lag is held against theirs.
    fleet = f"{key_prefix}-short"
    monkeypatch.setenv("SLUICE_KEY_PREFIX", fleet)

    async def join(name: str, retention: int) -> None:
        async with _client(service) as c:
            cfg = make_config(redis_url, fleet, "http://127.0.0.1:1", retention_seconds=retention)
            await announce(c.redis, Keys(fleet), name, cfg, check=False)

    try:
        code, out, err = service.cli("archive", "--status")
        assert (code, out) == (2, "")
        assert err == (
            "sluice archive: no retention_seconds known: give --config (the workers' file), or run this while a "
            "worker of the key prefix is up (it records its retention)\n"
        )
        anyio.run(join, "w-a", 900)
        code, out, _ = service.cli("archive", "--status")
        assert "of retention 900s (0.0%; retention_seconds from the live workers' configuration" in out, out
        anyio.run(join, "w-b", 300)
        code, out, _ = service.cli("archive", "--status")
        assert "of retention 300s (0.0%; retention_seconds the shortest of the live workers' (300, 900))" in out
    finally:
        service.r.delete(Keys(fleet).workers)


@pytest.mark.server  # starts its own server
def test_the_archiver_rides_out_a_redis_restart(tmp_path: Path) -> None:
    """A private Redis restarted empty under a running archiver: its feed re-creates the group and the
    requests finished after the restart are archived too."""
    from sluice.bench.archive import seed_finished_requests
    from sluice.harness.embedded_redis import embedded_redis, free_port

    port = free_port()
    store = LocalStore(tmp_path)

    async def wait_for(archiver: Archiver, n: int) -> None:
        with anyio.fail_after(30):
            while archiver.stats.archived < n:  # noqa: ASYNC110 - counted after the pointer is written
                await anyio.sleep(0.02)

    async def go() -> Any:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(embedded_redis(port=port))
            async with SluiceClient(server.url, key_prefix="arch-restart") as client:
                await seed_finished_requests(client, 3, 5, tag="before")
                archiver = Archiver(client, store, consumer="survivor", lag_interval=0.1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(archiver.run)
                    await wait_for(archiver, 3)
                    await anyio.to_thread.run_sync(stack.close)  # stopped: its data is gone
                    stack.enter_context(embedded_redis(port=port))  # back, empty, on the same port
                    async with SluiceClient(server.url, key_prefix="arch-restart") as producer:
                        await seed_finished_requests(producer, 2, 5, tag="after")
                    await wait_for(archiver, 5)
                    tg.cancel_scope.cancel()
                return archiver.stats

    stats = anyio.run(go)
    assert stats.archived == 5 and stats.lost == 0
    assert sorted(p.name for p in tmp_path.glob("id/*.json")) == sorted(
        [f"before-{i:06d}.json" for i in range(3)] + [f"after-{i:06d}.json" for i in range(2)]
    )


def test_bad_destinations_are_one_line_errors(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_ARCHIVE_URL", raising=False)
    code, _, err = service.cli("archive", "--once")
    assert (code, err) == (2, "sluice archive: give --to DIRECTORY|URL (or set SLUICE_ARCHIVE_URL)\n")
    code, _, err = service.cli("archive", "--to", "bogus://x", "--once")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("sluice archive: cannot open the archive destination bogus://x ("), err


def test_every_terminal_shard_is_archived(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    from sluice.bench.archive import seed_finished_requests

    async def go() -> Any:
        async with SluiceClient(redis_url, key_prefix=key_prefix, job_shards=3) as client:
            keys = await client.connect()
            try:
                await seed_finished_requests(client, 12, 3, tag="sharded")
                lengths = [await client.redis.xlen(s.terminal) for s in keys.shards]
                stats = await Archiver(client, LocalStore(tmp_path)).run(once=True)
                return lengths, stats
            finally:
                async for key in client.redis.scan_iter(match=f"{key_prefix}:*", count=1000):
                    await client.redis.delete(key)

    lengths, stats = anyio.run(go)
    assert sum(lengths) == 12 and all(lengths), lengths  # the requests spread over the three shards
    assert stats.archived == 12
    assert len(list(tmp_path.glob("id/*.json"))) == 12


@pytest.mark.asyncio
async def test_bedrock_requests_archive_byte_exact_and_audit_from_the_archive(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """The dialect added since: binary event-stream frames in the raw log (``kind`` ``frame``) survive the
    archive byte for byte, and completed, failed and interrupted requests audit from it."""
    from sluice.cli.audit import audit_archived
    from sluice.harness.fake.provider import serve_fake_provider
    from tests.integration.conftest import API_KEY, client_for, running_worker
    from tests.integration.test_bedrock_worker import bedrock_config, job

    cases = {
        "synthetic;tools=1;reasoning=2": "completed",
        "synthetic;error_after=3;error=rate_limit": "failed",
        "synthetic;drop_terminal=1": "interrupted",
    }
    async with serve_fake_provider(api_key=API_KEY) as fake:
        config = bedrock_config(redis_url, key_prefix, fake.base_url)
        async with running_worker(config), client_for(config) as client:
            rids = {model: await client.enqueue(job("bedrock-key", model)) for model in cases}
            for model, rid in rids.items():
                assert (await client.result(rid, timeout=30)).status == cases[model]
            live = {
                rid: await fetch_request(client, _terminal_of(await client.redis.xrange(client.keys.terminal), rid))
                for rid in rids.values()
            }
            stats = await Archiver(client, LocalStore(tmp_path)).run(once=True)
            assert stats.archived == len(cases)
            async for key in client.redis.scan_iter(match=f"{key_prefix}:*", count=1000):
                await client.redis.delete(key)
    store = LocalStore(tmp_path)
    for rid, snapshot in live.items():
        archived = await read_archived(store, rid)
        assert snapshot is not None and archived.raw == snapshot.raw
        assert any(f.get(b"kind") == b"frame" for _, f in archived.raw)
        audit = await audit_archived(store, rid)
        assert audit.ok, (rid, audit.problems, [(a.problem, a.divergence) for a in audit.attempts])


def _terminal_of(entries: list[Any], rid: str) -> Terminal:
    for entry_id, fields in entries:
        if fields[b"request_id"].decode() == rid:
            return Terminal.from_entry("terminal", entry_id.decode(), fields)
    raise AssertionError(rid)


# -- the index rows, proven ------------------------------------------------------------------------------

ROW_PRICES = Prices(input="3", output="15", cache_read="0.3", cache_write="3.75", currency="EUR")
PRICED = {"prices": {"anthropic": ROW_PRICES}, "prices_version": "rows-2026-12"}
# (field, its edited value): a billing row's every figure an analyst's query reads.
EDITS: list[tuple[str, object]] = [
    ("input_tokens", 1),
    ("output_tokens", 10_000),
    ("cost", "0.000001"),
    ("status", "failed"),
    ("prices_version", "rows-2027-01"),
    ("usage_reported", False),
    ("currency", "USD"),
]


def _row_path(root: Path, rid: str) -> Path:
    from sluice.archive.proof import index_name
    from sluice.archive.record import decode_pointer

    return root / index_name(decode_pointer((root / f"id/{rid}.json").read_bytes()).object)


def _edit_row(root: Path, rid: str, **changes: object) -> None:
    """An analyst's row rewritten in place, valid JSON of the row's own shape: only the figure differs."""
    from sluice.archive.record import decode_index, encode_json

    path = _row_path(root, rid)
    path.write_bytes(encode_json(msgspec.structs.replace(decode_index(path.read_bytes()), **changes)))


def _priced_config(service: Service, tmp: Path) -> Path:
    """The worker's prices as an operator's file gives them to ``--config``."""
    from tests.integration.conftest import write_config_file

    path = write_config_file(
        tmp / "sluice.toml", service.redis_url, service.prefix, service.base_url, prices_version="rows-2026-12"
    )
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in msgspec.structs.asdict(ROW_PRICES).items() if v is not None)
    path.write_text(path.read_text() + f"[prices.anthropic]\n{table}\n")
    return path


@pytest.mark.parametrize("service", [PRICED], indirect=True)
def test_an_edited_index_row_is_altered_for_audit_and_verify(service: Service, tmp_path: Path) -> None:
    from sluice.archive.record import decode_index

    archive = tmp_path / "archive"
    rids = [service.enqueue("anthropic", "synthetic;deltas=4", f"row-{i}") for i in range(len(EDITS) + 1)]
    for rid in rids:
        assert service.wait_state(rid)["state"] == "completed"
    assert service.cli("archive", "--to", str(archive), "--once")[0] == 0
    rows = {rid: decode_index(_row_path(archive, rid).read_bytes()) for rid in rids}
    assert all(r.cost and r.prices_version == "rows-2026-12" and r.output_tokens for r in rows.values()), rows
    config = str(_priced_config(service, tmp_path))
    # Untouched, every row is proven: audit and verify pass, with and without the prices.
    for extra in ([], ["--config", config]):
        code, out, _ = service.cli("audit", "--archive", str(archive), "--since", "1h", "--quiet", *extra)
        assert code == 0 and out.endswith(f"{len(rids)} ok, 0 mismatched, 0 damaged archive object(s)\n"), out
        code, out, _ = service.cli("archive", "--to", str(archive), "--verify", *extra)
        assert (code, out.splitlines()[-1]) == (
            0,
            f"verified: {len(rids)} ok, 0 not archived, 0 differs, 0 damaged, 0 expired in Redis",
        ), out

    edited = dict(zip(rids, EDITS, strict=False))
    for rid, (field, value) in edited.items():
        assert getattr(rows[rid], field) != value
        _edit_row(archive, rid, **{field: value})
    untouched = rids[-1]
    for rid, (field, _) in edited.items():
        code, out, _ = service.cli("audit", "--archive", str(archive), rid)
        head, finding, *rest = out.splitlines()
        assert (code, head, rest) == (1, f"audit {rid}: ARCHIVE ALTERED", []), out
        assert finding.startswith(f"  request {rid}: index row index/date=") and f": {field} is " in finding, out
    code, out, _ = service.cli("audit", "--archive", str(archive), untouched)
    assert code == 0 and out.startswith(f"audit {untouched}: OK\n"), out
    code, out, _ = service.cli("audit", "--archive", str(archive), "--since", "1h", "--quiet")
    lines = out.splitlines()
    assert code == 1 and lines[-1].endswith(f"1 ok, 0 mismatched, {len(edited)} damaged archive object(s)"), out
    assert len(lines) == len(edited) + 1  # one line per edited row, the untouched one quiet (it is OK)
    for rid, (field, _) in edited.items():
        assert any(x.startswith(f"ALTERED   {rid}  ") and f": {field} is " in x for x in lines), (field, out)
    code, out, _ = service.cli("archive", "--to", str(archive), "--verify")
    lines = out.splitlines()
    assert (
        code == 1
        and lines[-1] == f"verified: 1 ok, 0 not archived, 0 differs, {len(edited)} damaged, 0 expired in Redis"
    )
    for rid, (field, _) in edited.items():
        assert any(x.startswith(f"damaged       {rid}  ") and f": {field} is " in x for x in lines), (field, out)


@pytest.mark.parametrize("service", [PRICED], indirect=True)
def test_a_consistent_rewrite_of_the_billing_figures_is_found_in_the_log_or_the_prices(
    service: Service, tmp_path: Path
) -> None:
    """Object, pointer and row rewritten together (every hash right): the tokens are recomputed from the
    archived log, so a rewritten usage is found; a rewritten cost only the prices can find (``--config``)."""
    from sluice.archive.record import (
        Names,
        decode_pointer,
        decode_record,
        encode_json,
        encode_record,
        index_row,
        sha256_hex,
    )

    archive = tmp_path / "archive"
    usage_rid, cost_rid = (service.enqueue("anthropic", "synthetic;deltas=4", f"rw-{i}") for i in range(2))
    for rid in (usage_rid, cost_rid):
        service.wait_state(rid)
    assert service.cli("archive", "--to", str(archive), "--once")[0] == 0

    def rewrite(rid: str, status: dict[bytes, bytes]) -> None:
        ptr_path = archive / f"id/{rid}.json"
        ptr = decode_pointer(ptr_path.read_bytes())
        req = decode_record((archive / ptr.object).read_bytes())
        req = type(req)(req.request_id, req.attempt, req.terminal, {**req.status, **status}, req.raw, req.events)
        data = encode_record(req)
        (archive / ptr.object).write_bytes(data)
        ptr = msgspec.structs.replace(ptr, sha256=sha256_hex(data), bytes=len(data))
        ptr_path.write_bytes(encode_json(ptr))
        row_path = _row_path(archive, rid)
        names = Names(ptr.object, row_path.relative_to(archive).as_posix(), ptr_path.relative_to(archive).as_posix())
        row_path.write_bytes(encode_json(index_row(req, names, ptr.sha256, ptr.bytes)))

    usage = json.loads(service.status(usage_rid)["usage"])
    rewrite(usage_rid, {b"usage": json.dumps({**usage, "output_tokens": 1}).encode()})
    rewrite(cost_rid, {b"cost": b"0.000001"})
    code, out, _ = service.cli("audit", "--archive", str(archive), usage_rid)
    want = f"  request {usage_rid}: the archived status's output_tokens is 1, its log says {usage['output_tokens']}"
    assert (code, out.splitlines()) == (1, [f"audit {usage_rid}: ARCHIVE ALTERED", want]), out
    # Without prices the cost is bound to the archived status only, which says the same: it passes.
    code, out, _ = service.cli("audit", "--archive", str(archive), cost_rid)
    assert code == 0 and out.startswith(f"audit {cost_rid}: OK\n"), out
    config = str(_priced_config(service, tmp_path))
    for argv in (["audit", "--archive", str(archive), cost_rid], ["archive", "--to", str(archive), "--verify"]):
        code, out, _ = service.cli(*argv, "--config", config)
        assert code == 1, out
        line = next(
            x for x in out.splitlines() if cost_rid in x and "cost '0.000001' EUR, prices rows-2026-12 make " in x
        )
        assert "of the archived log's usage" in line, out


def test_a_missing_index_row_is_altered(service: Service, tmp_path: Path) -> None:
    """The archiver writes the row before the pointer, so a pointer without its row is damage. ``audit
    --since`` lists the rows, so it cannot see one that is gone: the request's own audit and --verify do."""
    gone, kept = (service.enqueue("openai-chat", "synthetic;deltas=3", f"gone-{i}") for i in range(2))
    for rid in (gone, kept):
        service.wait_state(rid)
    assert service.cli("archive", "--to", str(tmp_path), "--once")[0] == 0
    row = _row_path(tmp_path, gone)
    row.unlink()
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), gone)
    name = row.relative_to(tmp_path).as_posix()
    assert (code, out.splitlines()) == (
        1,
        [
            f"audit {gone}: ARCHIVE ALTERED",
            f"  request {gone}: index row {name} is missing (the archiver writes it before the pointer)",
        ],
    ), out
    code, out, _ = service.cli("archive", "--to", str(tmp_path), "--verify")
    assert (
        code == 1 and out.splitlines()[-1] == "verified: 1 ok, 0 not archived, 0 differs, 1 damaged, 0 expired in Redis"
    )
    assert f"damaged       {gone}  archive object altered: request {gone}: index row {name} is missing" in out, out
    code, out, _ = service.cli("audit", "--archive", str(tmp_path), "--since", "1h", "--quiet")
    assert code == 0 and out.endswith(
        "audited 1 archived request(s) finished in the last 1h: 1 ok, 0 mismatched, 0 damaged archive object(s)\n"
    )


@pytest.mark.parametrize("service", [PRICED], indirect=True)
def test_reprice_writes_each_cost_beside_the_original_and_reports_by_route_and_day(
    service: Service, tmp_path: Path
) -> None:
    from sluice.archive.record import decode_index
    from sluice.archive.reprice import Repriced

    archive = tmp_path / "archive"
    rids = [service.enqueue("anthropic", "synthetic;deltas=4", f"rp-{i}") for i in range(3)]
    rids.append(service.enqueue("openai-chat", "synthetic;deltas=4", "rp-unpriced"))
    for rid in rids:
        assert service.wait_state(rid)["state"] == "completed"
    assert service.cli("archive", "--to", str(archive), "--once")[0] == 0
    index_before = {p: p.read_bytes() for p in (archive / "index").rglob("*.json")}
    rows = {rid: decode_index(_row_path(archive, rid).read_bytes()) for rid in rids}
    # Half the input and output prices, in the same currency.
    prices = tmp_path / "discount.toml"
    prices.write_text(
        'prices_version = "discount-2027"\n[prices.anthropic]\ninput = "1.5"\noutput = "7.5"\n'
        'cache_read = "0.15"\ncache_write = "1.875"\ncurrency = "EUR"\n'
    )
    code, out, err = service.cli("reprice", "--archive", str(archive), "--prices", str(prices), "--since", "1h")
    assert (code, err) == (0, ""), (out, err)
    assert {p: p.read_bytes() for p in (archive / "index").rglob("*.json")} == index_before  # never over it
    docs = {
        d.request_id: d
        for d in (msgspec.json.decode(p.read_bytes(), type=Repriced) for p in (archive / "reprice").rglob("*.json"))
    }
    assert sorted(docs) == sorted(rids)
    old_sum, new_sum = 0, 0
    for rid in rids[:3]:
        d, row = docs[rid], rows[rid]
        assert (d.original_cost, d.original_prices_version) == (row.cost, "rows-2026-12")
        assert (d.prices_version, d.currency) == ("discount-2027", "EUR")
        assert Decimal(d.cost) * 2 == Decimal(row.cost)  # every price halved: the cost halves exactly
        old_sum, new_sum = old_sum + Decimal(row.cost), new_sum + Decimal(d.cost)
    assert docs["rp-unpriced"].cost == "" and docs["rp-unpriced"].prices_version == ""
    day = rows[rids[0]].date
    lines = out.splitlines()
    assert lines[0] == "repriced under discount-2027 (4 archived request(s) finished in the last 1h):"
    row_line = next(x for x in lines if x.startswith(f"{day}  anthropic "))
    assert row_line.split() == [
        day,
        "anthropic",
        "3",
        "3",
        format_cost(old_sum),
        format_cost(new_sum),
        "-" + format_cost(old_sum - new_sum),
    ]
    # The same table again writes the same bytes.
    before = _files(archive / "reprice")
    assert service.cli("reprice", "--archive", str(archive), "--prices", str(prices), "--since", "1h")[0] == 0
    assert {k: v[1] for k, v in _files(archive / "reprice").items()} == {k: v[1] for k, v in before.items()}
    # A bad price file is one line, exit 2.
    prices.write_text('[prices.anthropic]\ninput = "-1"\noutput = "1"\n')
    code, _, err = service.cli("reprice", "--archive", str(archive), "--prices", str(prices))
    assert (code, err.strip()) == (
        2,
        "sluice reprice: prices.anthropic.input must be a non-negative decimal number, not '-1'",
    )

"""What an operator or a backend developer meets first, each through the real entry point (the CLI in-process,
the client, a real worker and Redis): exit codes that say how a followed request ended, a queued request
that says it is waiting, cancel of a finished request, dead letters deleted and purged, unreadable files,
the relay's port taken, the client's typed errors and status, and the fake provider's scenario help."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sluice.client import InvalidJob, RedisUnavailable, ResultTimeout, SluiceClient, UnknownRequest
from sluice.harness.fake.scenarios import KEYS, SCENARIO_HELP
from sluice.schemas.events import Usage
from sluice.schemas.jobs import Job
from sluice.schemas.status import Status

# The harness fixtures are imported by name, so test arguments shadow them (F811) on purpose.
# ruff: noqa: F811
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]


def _client(service: Service) -> SluiceClient:
    return SluiceClient(service.redis_url, key_prefix=service.prefix)


# -- enqueue --follow / tail ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "code", "state"),
    [
        ("synthetic;deltas=2", 0, "completed"),
        ("synthetic;status=400", 3, "failed"),
        ("synthetic;deltas=3;drop_terminal=1", 4, "interrupted"),
    ],
)
def test_enqueue_follow_exits_by_how_the_request_ended(service: Service, model: str, code: int, state: str) -> None:
    got, out, _ = service.cli("enqueue", "--route", "anthropic", "--prompt", "hi", "--model", model, "--follow")
    rid = out.splitlines()[0]
    assert (got, service.status(rid)["state"]) == (code, state)


def test_tail_of_a_queued_request_says_it_waits(service: Service) -> None:
    rid = "queued-1"
    service.r.hset(service.keys.request(rid).status, mapping={"state": "queued", "request_id": rid})
    env = {**os.environ, "REDIS_URL": service.redis_url, "SLUICE_KEY_PREFIX": service.prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli.main", "tail", rid, "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # blocks until tail has looked at the status
        assert first == f"sluice tail: request {rid} is queued: waiting for a worker to pick it up\n"
        service.enqueue("anthropic", "synthetic;deltas=2", rid)  # now a worker takes it; tail follows to the end
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and err == ""
    assert out.splitlines()[-1].startswith('{"type":"stream.done"')


# -- cancel -----------------------------------------------------------------------------------------------------


def test_cancel_of_a_finished_request_is_false_and_writes_nothing(service: Service) -> None:
    service.enqueue("anthropic", "synthetic;deltas=2", "done-1")
    before = service.wait_state("done-1")

    async def go() -> tuple[bool, bool]:
        async with _client(service) as c:
            return await c.cancel("done-1"), await c.cancel("never-heard-of")

    assert anyio.run(go) == (False, False)
    after = service.status("done-1")
    # (published flips after the terminal-stream entry, independently of the cancel)
    assert {**after, "published": ""} == {**before, "published": ""} and "cancel" not in after
    assert service.r.xlen(service.keys.control) == 0
    code, out, _ = service.cli("cancel", "done-1")
    assert code == 0 and out == "request done-1 already finished (completed): nothing to cancel\n"


# -- the client -------------------------------------------------------------------------------------------------


def test_the_client_raises_only_sluice_errors_for_ids_and_jobs_it_cannot_hold(service: Service) -> None:
    """A lone surrogate, a homoglyph id, a request nested past what JSON encoding holds: each one typed line."""
    rule = "1-128 ASCII letters, digits and - _ . :"
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    deep: dict[str, Any] = {}
    for _ in range(5_000):
        deep = {"x": deep}

    async def go() -> None:
        async with _client(service) as c:
            with pytest.raises(InvalidJob) as info:
                await c.enqueue({"route": "anthropic", "request_id": "req-\udc80", "request": hi})
            assert str(info.value) == "invalid job: text that is not valid Unicode (surrogates not allowed: '\\udc80')"
            with pytest.raises(InvalidJob) as info:
                await c.enqueue({"route": "anthropic", "request_id": "r\u0435q-1", "request": hi})  # Cyrillic е
            assert str(info.value) == f"invalid job: request_id must be {rule}"
            job = msgspec.convert({"route": "anthropic", "request_id": "r\u0435q-1", "request": hi}, Job)
            with pytest.raises(InvalidJob) as info:
                await c.enqueue(job)  # a Job built by hand gets the same rule
            assert str(info.value) == f"invalid job: request_id must be {rule}"
            with pytest.raises(InvalidJob) as info:
                await c.enqueue({"route": "anthropic", "request": {**hi, "extra": deep}})
            assert str(info.value) == "invalid job: it nests too deeply to encode"
            with pytest.raises(InvalidJob) as info:
                await c.enqueue({"route": "anthropic", "request": hi, "tenant": "acme", "budget_key": ""})
            assert str(info.value) == "invalid job: budget_key must be 1-128 bytes, not 0"
            for bad in ("req-\udc80", "r\u0435q-1", "", "x" * 129):
                assert await c.status_record(bad) == {}
                assert await c.cancel(bad) is False
                assert await c.read_attempt(bad, 1) == []
                unknown = f"no request can have the id {bad!a}: request ids are {rule}"
                with pytest.raises(UnknownRequest) as info:
                    await c.status(bad)
                assert str(info.value) == unknown
                with pytest.raises(UnknownRequest) as info:
                    await c.result(bad, timeout=30)  # at once, not after the timeout
                assert str(info.value) == unknown
                with pytest.raises(UnknownRequest) as info:
                    async for _ in c.events(bad):
                        pass
                assert str(info.value) == unknown
            assert service.r.xlen(c.keys.jobs) == 0  # nothing was enqueued

    anyio.run(go)


def test_client_raises_its_own_typed_errors_and_returns_a_typed_status(service: Service) -> None:
    async def go() -> Status:
        async with _client(service) as c:
            with pytest.raises(InvalidJob, match=r"route"):
                await c.enqueue({"route": 5, "request": {"messages": []}})
            with pytest.raises(InvalidJob, match="request_id"):
                await c.enqueue(
                    {
                        "route": "anthropic",
                        "request_id": "no spaces",
                        "request": {"messages": [{"role": "user", "content": "hi"}]},
                    }
                )
            with pytest.raises(UnknownRequest):
                await c.status("never-heard-of")
            with pytest.raises(UnknownRequest):
                await c.result("never-heard-of", timeout=0.2)
            service.r.hset(c.keys.request("stuck").status, mapping={"state": "queued", "request_id": "stuck"})
            with pytest.raises(ResultTimeout, match="still queued"):
                await c.result("stuck", timeout=0.2)
            rid = await c.enqueue(
                {
                    "route": "anthropic",
                    "model": "synthetic;deltas=3",
                    "request": {"messages": [{"role": "user", "content": "hi"}]},
                }
            )
            await c.result(rid, timeout=30)
            return await c.status(rid)

    st = anyio.run(go)
    assert st.state == "completed" and st.terminal and st.attempt == 1 and st.epoch >= 1
    assert isinstance(st.usage, Usage) and st.error is None and st.stop_reason == "stop"
    assert st.event_count is not None and st.last_seq == st.event_count and st.route == "anthropic"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def unreachable() -> None:
        async with SluiceClient(f"redis://:pw-secret@127.0.0.1:{port}/0") as c:
            await c.status("x")

    with pytest.raises(RedisUnavailable) as info:
        anyio.run(unreachable)
    assert f"redis://:***@127.0.0.1:{port}/0" in str(info.value) and "pw-secret" not in str(info.value)


def test_a_failed_status_carries_the_typed_error(service: Service) -> None:
    service.enqueue("anthropic", "synthetic;status=401", "auth-1")
    service.wait_state("auth-1")

    async def go() -> Status:
        async with _client(service) as c:
            return await c.status("auth-1")

    st = anyio.run(go)
    assert st.state == "failed" and st.error is not None and st.error.category == "authentication"


# -- dead letters -------------------------------------------------------------------------------------------------


def test_dlq_delete_and_purge(service: Service) -> None:
    ids = [service.r.xadd(service.keys.dead_letters, {"entry_id": f"1-{i}", "reason": "r"}).decode() for i in range(3)]
    code, _, err = service.cli("dlq", "delete", ids[0], "9-9")
    assert code == 2 and err == "sluice dlq: no dead-letter entry 9-9 (see `sluice dlq list`): nothing deleted\n"
    assert service.r.xlen(service.keys.dead_letters) == 3
    assert service.cli("dlq", "delete", ids[0]) == (0, "deleted 1 dead-letter entry\n", "")
    code, _, err = service.cli("dlq", "purge")
    assert code == 2 and "deletes all 2 dead-letter entries; run again with --yes" in err
    assert service.cli("dlq", "purge", "--yes") == (0, "purged 2 dead-letter entries\n", "")
    assert not service.r.exists(service.keys.dead_letters)


# -- one-line errors --------------------------------------------------------------------------------------------


def _unreadable(tmp_path: Path) -> str:
    """A path that is a file yet cannot be read: mode 000 for a normal user; root reads anything, so for
    root a file whose reads fail (EIO)."""
    if os.geteuid() != 0:
        p = tmp_path / "locked.sse"
        p.write_bytes(b"data: x\n\n")
        p.chmod(0)
        return str(p)
    return "/proc/self/mem"


@pytest.mark.parametrize(
    ("argv", "what"),
    [(["normalize", "--dialect", "anthropic"], "file"), (["frames"], "file"), (["enqueue"], "job file")],
)
def test_unreadable_files_are_one_line(service: Service, tmp_path: Path, argv: list[str], what: str) -> None:
    path = _unreadable(tmp_path)
    code, _, err = service.cli(*argv, path)
    assert code == 2 and err.startswith(f"sluice {argv[0]}: cannot read {what} {path}: ") and err.count("\n") == 1


def test_relay_with_its_port_taken_is_one_line_not_a_traceback() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**os.environ, "SLUICE_RELAY_SECRETS": "s" * 40}
        proc = subprocess.run(
            [sys.executable, "-m", "sluice.cli.main", "relay", "--port", str(port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"sluice relay: cannot listen on 127.0.0.1:{port}: Address already in use\n"


# -- help ---------------------------------------------------------------------------------------------------------


def test_fake_provider_help_has_the_whole_scenario_grammar(service: Service) -> None:
    code, out, _ = service.cli("fake-provider", "--help")
    assert code == 0 and SCENARIO_HELP.splitlines()[0] in out
    for key in KEYS:
        assert f"{key}=" in SCENARIO_HELP, key

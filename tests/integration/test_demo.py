"""`sluice demo` through its real entry point: real Redis, real sockets, a real child redis-server.

It must finish in seconds with every job ending as announced, print the summary and the inspect commands,
and leave nothing behind: no process of its session alive, the fake provider's and the embedded Redis's
ports closed. With REDIS_URL it must keep to a fresh key prefix; with --keep it must leave a Redis that
the printed commands reach, and say how to stop it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis
from rich.cells import cell_len
from rich.text import Text

from sluice.cli.demo import _MULTIBYTE, JobView, _tail, demo_jobs
from sluice.schemas.events import decode_event
from sluice.schemas.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
SLUICE = str(Path(sys.executable).parent / "sluice")
JOBS = demo_jobs(5)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SLUICE_DEMO_API_KEY")}
    return {**env, **extra}


def _bare_shell() -> dict[str, str]:
    """A new shell's environment: the venv's bin is not on PATH."""
    return {**_env(), "PATH": "/usr/bin:/bin"}


def _run_demo(
    *args: str, env: dict[str, str], timeout: float = 90
) -> tuple[subprocess.CompletedProcess[str], set[int], float]:
    """Run ``sluice demo`` in its own session; returns the result, every pid seen in that session while it
    ran, and the seconds it took."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [SLUICE, "demo", "--pace-ms", "5", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: set[int] = set()
    deadline = started + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= _session_pids(proc.pid)
        time.sleep(0.05)
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen, time.monotonic() - started


def _session_pids(sid: int) -> set[int]:
    pids = set()
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                pids.add(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return pids


def _port_open(url: str) -> bool:
    u = urlsplit(url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=0.5):
            return True
    except OSError:
        return False


def _header(out: str) -> dict[str, str]:
    m = re.search(r"Redis (\S+) \((\w+)\) · fake provider (\S+) · worker \S+ · key prefix (\S+)", out)
    assert m, out
    return {"redis": m.group(1), "where": m.group(2), "fake": m.group(3), "prefix": m.group(4)}


def _assert_summary(out: str) -> None:
    summary = out[out.index("sluice demo: summary") :]
    for job in JOBS:
        reason = job.expect_reason if job.expect_status == "completed" else f"error: {job.expect_reason}"
        row = rf"^\s*{re.escape(job.route)}\s+{re.escape(job.shows)}\s+{job.expect_status}\s+{re.escape(reason)}\s"
        assert re.search(row, summary, re.M), (job.name, summary)
    assert f"{len(JOBS)} requests in" in summary and "all as expected" in summary


@pytest.mark.server  # starts its own server
def test_demo_with_embedded_redis_runs_to_completion_and_leaves_nothing_running() -> None:
    done, seen, seconds = _run_demo(env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    header = _header(out)
    assert header["where"] == "embedded" and header["prefix"] == "sluice"
    # nothing of its session survives it: the embedded redis-server was one of them
    assert len(seen) >= 2, "the embedded redis-server runs as a child process"
    assert not [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not _port_open(header["fake"]) and not _port_open(header["redis"])
    _assert_summary(out)
    # plain output (not a TTY): the multi-byte text arrived whole, the failure kept the text before it
    assert f"openai-chat            text: {_MULTIBYTE}\n" in out
    assert re.search(r"^anthropic-overloaded\s+text \(never closed\): Once upon a time", out, re.M)
    assert re.search(r"^anthropic-overloaded\s+failed \(overloaded\)", out, re.M)
    for job in JOBS:
        assert re.search(rf"^{re.escape(job.name)}\s+queued as demo-[0-9a-f]+-{re.escape(job.name)} ", out, re.M)
    # the inspect commands, and the honest note that this Redis is gone
    rid = re.search(rf"  {re.escape(SLUICE)} tail (demo-\S+-anthropic) --redis-url (\S+)", out)
    assert rid and rid.group(2) == header["redis"]
    assert f"  {SLUICE} audit {rid.group(1)} --redis-url {header['redis']}" in out
    assert "The embedded Redis stopped with the demo" in out and "--keep" in out
    assert seconds < 30, f"the demo took {seconds:.1f} s"


def test_demo_on_your_own_redis_keeps_to_a_fresh_prefix(redis_url: str) -> None:
    done, _, _ = _run_demo(env=_env(REDIS_URL=redis_url))
    assert done.returncode == 0, done.stdout + done.stderr
    header = _header(done.stdout)
    prefix = header["prefix"]
    assert header["where"] == "yours" and header["redis"] == redis_url
    assert re.fullmatch(r"sluice-demo-[0-9a-f]{8}", prefix)
    r = redis.Redis.from_url(redis_url)
    try:
        rids = re.search(r"request ids: ([^)]+)\)", done.stdout).group(1).split(", ")  # type: ignore[union-attr]
        assert len(rids) == len(JOBS)
        for job, rid in zip(JOBS, rids, strict=True):
            status = r.hgetall(Keys(prefix).request(rid).status)
            assert status[b"state"].decode() == job.expect_status, (rid, status)
        # the printed command works as printed, through the real entry point
        line = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith(f"{SLUICE} status"))
        cmd = shlex.split(line.split("#")[0])
        shown = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=_bare_shell())
        assert shown.returncode == 3, shown.stderr  # the exit table: the request ended failed
        assert '"state": "failed"' in shown.stdout
        assert f"--scan --pattern '{prefix}:*'" in done.stdout  # how to remove its keys
    finally:
        for key in r.scan_iter(match=f"{prefix}:*", count=1000):
            r.delete(key)
        r.close()


@pytest.mark.server  # starts its own server
def test_demo_keep_leaves_a_reachable_redis_and_says_how_to_stop_it() -> None:
    done, _, _ = _run_demo("--keep", env=_env())
    m = re.search(r"Stop it with:\n  kill (\d+) && rm -rf (\S+)", done.stdout)
    assert m, done.stdout + done.stderr
    pid, workdir = int(m.group(1)), Path(m.group(2))
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert psutil.pid_exists(pid) and psutil.Process(pid).name() in ("redis-server", "valkey-server")
        header = _header(done.stdout)
        assert _port_open(header["redis"]) and not _port_open(header["fake"])
        # printed with the full path of this installation's sluice: it runs from a new shell without the venv
        line = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith(f"{SLUICE} audit"))
        cmd = shlex.split(line.split("#")[0])
        audited = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=_bare_shell())
        assert audited.returncode == 0, audited.stdout + audited.stderr
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        psutil.wait_procs([psutil.Process(pid)], timeout=10) if psutil.pid_exists(pid) else None
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not workdir.exists()


def _wait_streaming(head: str, timeout: float = 30.0) -> None:
    """Until the demo's requests have left the queue and one is streaming (its events in the demo's Redis)."""
    header, rids = _header(head), re.findall(r"queued as (\S+)", head)
    keys = Keys(header["prefix"])
    r = redis.Redis.from_url(header["redis"])
    try:
        deadline = time.monotonic() + timeout
        while True:
            states = [r.hget(keys.request(rid).status, "state") for rid in rids]
            streaming = [rid for rid in rids if r.xlen(keys.request(rid).events) >= 2]
            if b"queued" not in states and None not in states and streaming:
                return
            assert time.monotonic() < deadline, states
            time.sleep(0.02)
    finally:
        r.close()


@pytest.mark.server  # starts its own server
def test_interrupted_demo_stops_everything_and_exits_130() -> None:
    proc = subprocess.Popen(
        [SLUICE, "demo", "--pace-ms", "400"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        head, seen = [], _session_pids(proc.pid)
        while sum("queued as" in line for line in head) < len(JOBS):  # plain output: every job is enqueued
            line = proc.stdout.readline()
            assert line, "the demo ended before it enqueued its jobs"
            head.append(line)
            seen |= _session_pids(proc.pid)
        _wait_streaming("".join(head))  # interrupted mid-stream (400 ms between events)
        seen |= _session_pids(proc.pid)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(head) + rest
    assert proc.returncode == 130, out + err
    assert "interrupted" in out
    assert len(seen) >= 2, "the embedded redis-server runs as a child process"
    assert not [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    header = _header(out)
    assert not _port_open(header["fake"]) and not _port_open(header["redis"])


@pytest.mark.parametrize("bad", ["redis://127.0.0.1:1/0"])
def test_unreachable_redis_is_one_clear_line(bad: str) -> None:
    done = subprocess.run(
        [SLUICE, "demo"], capture_output=True, text=True, timeout=60, check=False, env=_env(REDIS_URL=bad)
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"sluice demo: Redis unreachable at {bad}"


def test_live_view_tail_counts_wide_characters_twice() -> None:
    text = Text("abc")
    text.append("日本語🙂", style="dim")
    tail = _tail(text, 6)
    assert tail.plain == "…語🙂"  # 1 + 2 + 2 cells; one more character would not fit
    assert cell_len(tail.plain) <= 6
    assert tail.spans and tail.spans[-1].style == "dim"  # styles survive, the ellipsis does not dim the rest
    assert tail.style == ""
    assert _tail(text, 20) is text


def test_job_view_folds_the_contract_events() -> None:
    job = next(j for j in JOBS if j.name == "openai-responses")
    view = JobView(job, "r1", queued_ms=1000)
    base = '"stream_id":"r1:1","request_id":"r1"'
    lines = [
        f'{{"type":"stream.start",{base},"seq":1,"ts":1010,"provider":"openai","dialect":"openai-responses",'
        '"model":"m","attempt":1}',
        f'{{"type":"block.start",{base},"seq":2,"ts":1020,"block":{{"id":"b_0","index":0,"kind":"text"}}}}',
        f'{{"type":"block.delta",{base},"seq":3,"ts":1042,"block":{{"id":"b_0","index":0,"kind":"text"}},'
        '"delta":{"kind":"text","text":"Grüße 🙂"}}',
        f'{{"type":"block.stop",{base},"seq":4,"ts":1050,"block":{{"id":"b_0","index":0,"kind":"text"}}}}',
        f'{{"type":"block.start",{base},"seq":5,"ts":1060,"block":{{"id":"b_1","index":1,"kind":"tool_call",'
        '"name":"get_weather","call_id":"c1"}}',
        f'{{"type":"block.delta",{base},"seq":6,"ts":1070,"block":{{"id":"b_1","index":1,"kind":"tool_call"}},'
        '"delta":{"kind":"json_text","text":"{\\"city\\": \\"Paris\\"}"}}',
        f'{{"type":"block.stop",{base},"seq":7,"ts":1080,"block":{{"id":"b_1","index":1,"kind":"tool_call"}},'
        '"arguments":{"city":"Paris"}}',
        f'{{"type":"stream.done",{base},"seq":8,"ts":1090,"stop_reason":"tool_use","provider_stop_reason":"completed",'
        '"usage":null}',
    ]
    closed = [view.apply(decode_event(line)) for line in lines]
    assert [b.kind if b else None for b in closed] == [None, None, None, "text", None, None, "tool_call", None]
    assert view.state == "completed" and view.stop_reason == "tool_use" and view.as_expected
    assert view.events == 8 and view.first_token_ms == 42  # ts of the first delta - enqueue time
    assert [(b.kind, b.name, b.text) for b in view.blocks] == [
        ("text", None, "Grüße 🙂"),
        ("tool_call", "get_weather", '{"city": "Paris"}'),
    ]

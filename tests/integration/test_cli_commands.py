"""The operator commands through the real entry point against a real Redis and a real worker:
enqueue, status, cancel, tail (plain, --json, --raw, --after), dlq list / requeue, and their error paths."""

from __future__ import annotations

import json
import socket
import time

import msgspec
import pytest

from sluice.schemas.events import BlockDelta, StreamDone, decode_event

# The harness fixtures are imported by name, so test arguments shadow them (F811) on purpose.
# ruff: noqa: F811
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

HELLO = "synthetic;text=Hello%20world;deltas=2"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens there


# -- enqueue / status / tail ---------------------------------------------------------------------------------


def test_enqueue_flags_status_and_tail_json(service: Service) -> None:
    code, out, err = service.cli(
        "enqueue",
        "--route",
        "anthropic",
        "--prompt",
        "Привет",
        "--model",
        "synthetic;deltas=5;tools=1",
        "--request-id",
        "cli-1",
        "--metadata",
        "tenant=acme",
    )
    assert (code, out, err) == (0, "cli-1\n", "")
    service.wait_state("cli-1")

    code, out, err = service.cli("status", "cli-1")
    assert code == 0 and err == ""
    st = json.loads(out)
    assert st["state"] == "completed" and st["request_id"] == "cli-1" and st["route"] == "anthropic"
    assert st["stop_reason"] == "tool_use" and st["metadata"] == {"tenant": "acme"}
    assert st["attempt"] == 1 and st["visible"] is True and st["published"] == 1  # numbers and flags, typed
    assert st["event_count"] == len(service.events("cli-1")) and st["usage"]["output_tokens"] > 0
    assert list(st) == sorted(st)

    code, out, err = service.cli("tail", "cli-1", "--json")
    assert code == 0 and err == ""
    lines = out.splitlines()
    stored = service.events("cli-1")
    # byte for byte what the events stream holds, in order, ending with the terminal
    assert lines == [msgspec.json.encode(ev).decode() for _, ev in stored]
    assert isinstance(decode_event(lines[-1]), StreamDone)

    code, out, _ = service.cli("tail", "cli-1", "--json", "--after", "1-3")
    assert [decode_event(x).seq for x in out.splitlines()] == [ev.seq for _, ev in stored[3:]]


def test_enqueue_job_file_follow_plain(service: Service, tmp_path) -> None:
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "route": "openai-chat",
                "model": HELLO,
                "request_id": "cli-2",
                "request": {"messages": [{"role": "user", "content": "hi"}]},
            }
        )
    )
    code, out, err = service.cli("enqueue", str(job), "--follow")
    # said when the command finds it still queued (the worker may have taken it already)
    assert code == 0 and err in ("", "sluice enqueue: request cli-2 is queued: waiting for a worker to pick it up\n")
    lines = out.splitlines()
    assert lines[:4] == ["cli-2", "[attempt 1 · openai (openai-chat) · model fake-model]", "[text]", "Hello world"]
    assert lines[4].startswith("[completed: stop · seq 6 · attempt 1 · ") and len(lines) == 5
    assert "\x1b[" not in out  # not a terminal: no escape codes

    # enqueuing the same request id again runs nothing and says so
    code, out, err = service.cli("enqueue", str(job))
    assert code == 0 and out == "cli-2\n" and "known already" in err
    assert len(service.r.xrange(service.keys.terminal)) == 1


def test_tail_plain_shows_tool_call_and_reasoning(service: Service) -> None:
    service.enqueue("anthropic", "synthetic;deltas=2;reasoning=2;tools=1", "cli-3")
    service.wait_state("cli-3")
    code, out, _ = service.cli("tail", "cli-3")
    assert code == 0
    markers = [line for line in out.splitlines() if line.startswith("[")]
    assert markers[0].startswith("[attempt 1 · anthropic (anthropic)")
    assert markers[1:4] == ["[reasoning]", "[text]", markers[3]]
    assert markers[3].startswith("[tool_call get_weather · ")
    assert markers[4].startswith("[completed: tool_use · ")
    args_line = out.splitlines()[out.splitlines().index(markers[3]) + 1]
    assert json.loads(args_line)["call"] == 0  # the argument text, streamed whole


def test_tail_raw_lists_every_provider_event(service: Service) -> None:
    service.enqueue("gemini", "synthetic;deltas=4", "cli-4")
    service.wait_state("cli-4")
    code, out, _ = service.cli("tail", "cli-4", "--raw")
    assert code == 0
    docs = [json.loads(x) for x in out.splitlines()]
    stored = service.r.xrange(service.keys.request("cli-4").raw)
    assert [d["position"] for d in docs] == [i.decode() for i, _ in stored]
    assert docs[0]["kind"] == "http" and json.loads(docs[0]["data"])["status"] == 200
    assert all(d["kind"] == "sse" and isinstance(d["offset"], int) and isinstance(d["ts"], int) for d in docs[1:])
    assert [d["data"] for d in docs[1:]] == [f[b"data"].decode() for _, f in stored[1:]]

    code, out, _ = service.cli("tail", "cli-4", "--raw", "--after", "1-2")
    assert [json.loads(x)["position"] for x in out.splitlines()] == [i.decode() for i, _ in stored[3:]]


def test_cancel_a_running_request(service: Service) -> None:
    service.enqueue("anthropic", "synthetic;deltas=400;pace_ms=25", "cli-5")
    service.wait_state("cli-5", ("running",))
    deadline = 200
    while not any(isinstance(ev, BlockDelta) for _, ev in service.events("cli-5")) and deadline:
        time.sleep(0.02)
        deadline -= 1
    code, out, err = service.cli("cancel", "cli-5", "--wait")
    assert code == 4 and err == ""  # the exit table: the request ended interrupted
    assert out.splitlines() == [
        "cancel requested for cli-5 (was running)",
        "request cli-5 ended interrupted / cancelled",
    ]
    code, out, _ = service.cli("cancel", "cli-5")
    assert code == 0 and out == "request cli-5 already finished (interrupted): nothing to cancel\n"


# -- dead letters ------------------------------------------------------------------------------------------------


def _wait_dlq(service: Service, n: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
    for _ in range(1500):
        entries = service.r.xrange(service.keys.dead_letters)
        if len(entries) >= n:
            return entries
        time.sleep(0.02)
    raise AssertionError("dead letters did not arrive")


def test_dlq_list_and_requeue(service: Service) -> None:
    k = service.keys
    service.r.xadd(k.jobs, {"other": b"x"})
    service.r.xadd(k.jobs, {"job": b"{not json"})
    service.enqueue("nowhere", "synthetic", "dl-1")
    entries = _wait_dlq(service, 3)
    service.wait_state("dl-1")
    ids = {f[b"reason"].decode(): i.decode() for i, f in entries}
    no_payload = next(v for r, v in ids.items() if "no 'job' field" in r)
    not_json = next(v for r, v in ids.items() if "not valid JSON" in r)
    route = next(v for r, v in ids.items() if "unknown route" in r)

    code, out, err = service.cli("dlq", "list")
    assert code == 0 and err == ""
    rows = out.splitlines()
    assert rows[0].split() == ["ID", "REQUEST_ID", "AT", "JOB", "REASON"]
    assert len(rows) == 4
    assert any(r.startswith(route) and " dl-1 " in r and r.endswith("unknown route 'nowhere'") for r in rows)
    code, out, _ = service.cli("dlq", "list", "--json")
    docs = [json.loads(x) for x in out.splitlines()]
    assert [d["id"] for d in docs] == [i.decode() for i, _ in entries]
    assert {d["id"]: d["has_job"] for d in docs}[no_payload] is False

    code, out, err = service.cli("dlq", "requeue", no_payload)
    assert code == 2 and out == "" and "has no job payload" in err and no_payload in err
    code, out, err = service.cli("dlq", "requeue", not_json)
    assert code == 2 and "still invalid" in err and "not valid JSON" in err
    code, out, err = service.cli("dlq", "requeue", "9-9")
    assert code == 2 and err.strip() == "sluice dlq: no dead-letter entry 9-9 (see `sluice dlq list`)"

    # the failed request runs again as attempt 2 (the route is still unknown: it is dead-lettered again)
    assert service.status("dl-1")["attempt"] == "1"
    code, out, err = service.cli("dlq", "requeue", route)
    assert code == 0 and err == ""
    assert out.startswith(f"requeued dead-letter {route} as job entry ") and out.endswith(
        "(request dl-1, was failed)\n"
    )
    entries = _wait_dlq(service, 3)  # the requeued entry went, a new one for dl-1 came
    assert route not in [i.decode() for i, _ in entries]
    assert [f[b"request_id"] for _, f in entries if b"request_id" in f] == [b"dl-1"]
    for _ in range(500):
        if service.status("dl-1").get("attempt") == "2" and service.status("dl-1")["state"] == "failed":
            break
        time.sleep(0.02)
    st = service.status("dl-1")
    assert st["attempt"] == "2" and st["state"] == "failed" and st["requeued_from"] == route
    assert [i for i, _ in service.events("dl-1")] == ["1-1", "1-2", "2-1", "2-2"]


def test_dlq_requeue_runs_a_job_that_never_ran(service: Service) -> None:
    job = msgspec.json.encode(
        {"route": "anthropic", "model": HELLO, "request": {"messages": [{"role": "user", "content": "x"}]}}
    )
    dl = service.r.xadd(
        service.keys.dead_letters, {"entry_id": "1-1", "reason": "delivered 6 times", "at": "1", "job": job}
    ).decode()
    code, out, err = service.cli("dlq", "requeue", dl)
    assert code == 0 and err == "" and out.startswith(f"requeued dead-letter {dl} as job entry ")
    assert service.r.xlen(service.keys.dead_letters) == 0
    rid = json.loads(service.r.xrange(service.keys.jobs)[-1][1][b"job"])["request_id"]
    assert service.wait_state(rid)["state"] == "completed"


def test_dlq_requeue_refuses_a_running_request(service: Service) -> None:
    service.r.hset(service.keys.request("busy-1").status, mapping={"state": "running", "worker": "w-9"})
    job = msgspec.json.encode(
        {"route": "anthropic", "request_id": "busy-1", "request": {"messages": [{"role": "user", "content": "x"}]}}
    )
    dl = service.r.xadd(service.keys.dead_letters, {"reason": "delivered 6 times", "job": job}).decode()
    code, _, err = service.cli("dlq", "requeue", dl)
    assert code == 2 and err.strip() == "sluice dlq: request busy-1 is running (worker w-9): not requeued"
    assert service.r.xlen(service.keys.dead_letters) == 1 and service.r.xlen(service.keys.jobs) == 0


# -- error paths ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["status", "nope-1"], ["tail", "nope-1"], ["tail", "nope-1", "--raw"], ["cancel", "nope-1"], ["audit", "nope-1"]],
)
def test_unknown_request(service: Service, argv: list[str]) -> None:
    code, out, err = service.cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith(f"sluice {argv[0]}: unknown request nope-1") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "r1"],
        ["tail", "r1"],
        ["cancel", "r1"],
        ["audit", "r1"],
        ["audit", "--since", "5m"],
        ["dlq", "list"],
        ["dlq", "requeue", "1-1"],
        ["enqueue", "--route", "anthropic", "--prompt", "x"],
    ],
)
def test_redis_unreachable_names_the_url(service: Service, argv: list[str]) -> None:
    url = f"redis://operator:s3cret@127.0.0.1:{_closed_port()}/0"
    code, out, err = service.cli(*argv, "--redis-url", url)
    assert code == 2 and out == ""
    masked = url.replace("s3cret", "***")
    assert err.startswith(f"sluice {argv[0]}: Redis unreachable at {masked} (") and err.count("\n") == 1
    assert "s3cret" not in err


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"route": 5, "request": {"messages": [{"role": "user", "content": "x"}]}},
            "invalid job: Expected `str`, got `int` - at `$.route`",
        ),
        (
            {"route": "a", "request": {"messages": [{"role": "robot", "content": "x"}]}},
            "at `$.request.messages[0].role`",
        ),
        (
            {"route": "a", "base_url": "http://x", "request": {"messages": [{"role": "user", "content": "x"}]}},
            "invalid job: Object contains unknown field `base_url`",
        ),
        (
            {"route": "a", "request": {"messages": [{"role": "user", "content": "x"}], "host": "h"}},
            "Object contains unknown field `host` - at `$.request`",
        ),
        ({"request": {"messages": [{"role": "user", "content": "x"}]}}, "Object missing required field `route`"),
        (
            {"route": "a", "request_id": "bad id!", "request": {"messages": [{"role": "user", "content": "x"}]}},
            "request_id must be",
        ),
    ],
)
def test_bad_job_file_names_the_field(service: Service, tmp_path, doc: dict, message: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    code, out, err = service.cli("enqueue", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"sluice enqueue: {path}: ") and message in err and err.count("\n") == 1
    assert service.r.xlen(service.keys.jobs) == 0


def test_enqueue_input_errors(service: Service, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (["enqueue", str(bad)], f"sluice enqueue: {bad}: job is not valid JSON"),
        (["enqueue", str(tmp_path / "missing.json")], f"sluice enqueue: no such job file: {tmp_path / 'missing.json'}"),
        (["enqueue", str(tmp_path)], f"sluice enqueue: job file {tmp_path} is a directory, not a regular file"),
        (["enqueue"], "sluice enqueue: give a job file, or --route and --prompt"),
        (
            ["enqueue", "--route", "anthropic", "--prompt", "x", "--metadata", "novalue"],
            "sluice enqueue: --metadata 'novalue': expected KEY=VALUE",
        ),
        (
            ["tail", "r1", "--after", "five"],
            "sluice tail: --after 'five': expected a position <attempt>-<seq>, e.g. 1-5",
        ),
        (["audit"], "sluice audit: give a REQUEST_ID or --since DURATION (not both)"),
        (["audit", "--since", "10 parsecs"], "sluice audit: bad duration '10 parsecs'"),
    ]
    for argv, message in cases:
        code, out, err = service.cli(*argv)
        assert code == 2 and out == "", argv
        assert err.startswith(message) and err.count("\n") == 1, (argv, err)
    assert service.r.xlen(service.keys.jobs) == 0


def test_bad_config_file(service: Service, tmp_path) -> None:
    cfg = tmp_path / "sluice.toml"
    cfg.write_text("routes = 5\n")
    code, out, err = service.cli("status", "r1", "--config", str(cfg))
    assert code == 2 and out == "" and err.startswith(f"sluice status: {cfg}: Expected `object`")
    code, out, err = service.cli("status", "r1", "--config", str(tmp_path / "none.toml"))
    assert code == 2 and err == f"sluice status: no such config file: {tmp_path / 'none.toml'}\n"

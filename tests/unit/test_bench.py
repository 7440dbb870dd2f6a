"""The benchmark harness's pure pieces at tiny sizes: the synthetic corpus, the floor, the correctness checks
that guard every timed path, the timing itself (real clocks, no fakes), the SDK drivers when installed,
the latency stamp, the percentiles, the profile summary and the RESP packing. No speed is asserted."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import random
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest
from rich.console import Console

from sluice.bench.consumer import parse_stamp, percentiles
from sluice.bench.e2e import E2EOptions, _cpu, mean_event_size, scenario_model, summarize_pyspy
from sluice.bench.main import e2e_table
from sluice.bench.normalizer import (
    BenchCheckFailed,
    check_floor,
    check_sdk,
    check_sluice,
    floor_stream,
    frame_floor_stream,
    measure,
    run_dialect,
    sluice_stream,
)
from sluice.bench.sdk import SDK_NAMES, sdk_driver
from sluice.bench.synth import build_corpus, chunk_body, make_script, synth_stream
from sluice.harness.fake.render import DIALECTS, STAMP_PLACEHOLDER, Script, Text, ToolCall, reframe, render
from sluice.normalizer.eventstream import encode_frame
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import BlockDelta, encode_event

SMALL = 60_000


# -- the corpus ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_corpus_is_deterministic_and_chunks_rebuild_each_body(dialect: str) -> None:
    a = build_corpus(dialect, SMALL, seed=3)
    b = build_corpus(dialect, SMALL, seed=3)
    assert [s.body for s in a.streams] == [s.body for s in b.streams]
    assert [s.chunks for s in a.streams] == [s.chunks for s in b.streams]
    assert a.bytes >= SMALL
    for s in a.streams:
        assert b"".join(s.chunks) == s.body
        assert all(1 <= len(c) <= 4096 for c in s.chunks)
    assert build_corpus(dialect, SMALL, seed=4).streams[0].body != a.streams[0].body


def test_corpus_event_count_matches_what_sluice_frames() -> None:
    corpus = build_corpus("anthropic", SMALL)
    for s in corpus.streams:
        raw, _, _ = normalize_bytes(s.chunks, "anthropic", StreamInfo("s:1", "s", "", "anthropic"))
        assert len(raw) == s.sse_events


def test_script_shape_deltas_of_3_to_8_words_and_fragmented_tool_calls() -> None:
    rng = random.Random(1)
    scripts = [make_script(rng, i) for i in range(40)]
    for sc in scripts:
        text = sc.blocks[0]
        assert isinstance(text, Text) and 80 <= len(text.deltas) <= 1200
        for d in text.deltas:
            assert 3 <= len(d.split()) <= 8 + 2, d  # punctuation may add a quoted word or an aside
        for call in sc.blocks[1:]:
            assert isinstance(call, ToolCall)
            assert len(call.fragments) > 5 and all(1 <= len(f) <= 12 for f in call.fragments)
            assert json.loads(call.arguments)["call"] in (0, 1, 2)
        assert sc.stop == ("tool_use" if len(sc.blocks) > 1 else sc.stop)
    with_tools = sum(1 for sc in scripts if len(sc.blocks) > 1)
    assert 3 <= with_tools <= 30  # about a third


def test_anthropic_corpus_has_pings_and_usage() -> None:
    corpus = build_corpus("anthropic", 400_000)
    body = b"".join(s.body for s in corpus.streams)
    assert body.count(b"event: ping\n") > len(corpus.streams)  # the early one plus periodic ones
    assert body.count(b'"usage"') >= 2 * len(corpus.streams)  # message_start and message_delta


def test_chunk_body_exact_sizes() -> None:
    rng = random.Random(0)
    chunks = chunk_body(b"x" * 1000, rng, 1, 1)
    assert chunks == (b"x",) * 1000
    chunks = chunk_body(b"abcdefghij", random.Random(5), 3, 3)
    assert chunks == (b"abc", b"def", b"ghi", b"j")


def test_unknown_dialect() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        build_corpus("nope", 10)


# -- the floor ----------------------------------------------------------------------------------------------


def test_floor_splits_on_bytes_and_decodes_every_payload() -> None:
    body = (
        b'data: {"a": 1}\n\n'
        b'event: x\r\ndata: {"b":\r\ndata: 2}\r\n\r\n'  # CRLF, two data lines joined with \n
        b": comment\n\n"
        b"event: ping\nid: 7\n\n"  # no data: nothing decoded
        b'data:{"c": [3]}\n\n'  # no space after the colon
        b"data: [DONE]\n\n"
    )
    for size in (1, 2, 7, len(body)):
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        assert floor_stream(chunks) == 3


def test_floor_really_decodes() -> None:
    with pytest.raises(msgspec.DecodeError):
        floor_stream([b"data: {not json}\n\n"])


def test_frame_floor_splits_by_length_and_decodes() -> None:
    frames = [
        encode_frame({":event-type": "a", ":message-type": "event"}, b'{"a": 1}'),
        encode_frame({}, b"[2, 3]"),
        encode_frame({":message-type": "event"}, b'"x"'),
    ]
    body = b"".join(frames)
    for size in (1, 2, 13, len(body)):
        assert frame_floor_stream([body[i : i + size] for i in range(0, len(body), size)]) == 3
    with pytest.raises(msgspec.DecodeError):
        frame_floor_stream([encode_frame({}, b"{not json")])


@pytest.mark.parametrize("at", [0, 9, 14, -6, -1])  # a length, the prelude CRC, a header, the payload, the CRC
def test_frame_floor_checks_both_crcs(at: int) -> None:
    frame = bytearray(encode_frame({":event-type": "contentBlockDelta", ":message-type": "event"}, b'{"a": 1}'))
    frame[at] ^= 0x01
    with pytest.raises(ValueError, match="CRC mismatch"):
        frame_floor_stream([bytes(frame)])


def test_floor_check_against_the_corpus() -> None:
    for dialect in DIALECTS:
        for s in build_corpus(dialect, SMALL).streams:
            assert check_floor(s) == s.sse_events - (dialect == "openai-chat")


# -- the sluice path and its check -----------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_sluice_path_emits_what_the_check_counts(dialect: str) -> None:
    corpus = build_corpus(dialect, SMALL)
    for s in corpus.streams:
        n = check_sluice(dialect, s)
        assert sluice_stream(dialect, s.chunks)[0] == n
        text = s.script.blocks[0]
        assert isinstance(text, Text)
        # stream.start, block.start, one delta each, block.stop, then per tool call start+stop, stream.done;
        # tool argument fragments are deltas too (Gemini sends each call whole: one delta).
        calls = s.tool_calls
        frags = len(calls) if dialect == "gemini" else sum(len(c.fragments) for c in calls)
        assert n == 1 + 1 + len(text.deltas) + 1 + sum(2 for _ in calls) + frags + 1


def test_sluice_check_catches_wrong_output() -> None:
    s = build_corpus("anthropic", SMALL).streams[0]
    text = s.script.blocks[0]
    assert isinstance(text, Text)
    lying = dataclasses.replace(
        s, script=dataclasses.replace(s.script, blocks=(Text((*text.deltas, " extra")), *s.script.blocks[1:]))
    )
    with pytest.raises(BenchCheckFailed, match="sluice anthropic"):
        check_sluice("anthropic", lying)
    truncated = dataclasses.replace(s, chunks=s.chunks[:-1])  # the terminal never arrives
    with pytest.raises(BenchCheckFailed):
        check_sluice("anthropic", truncated)


def test_floor_check_catches_a_missing_event() -> None:
    s = build_corpus("gemini", SMALL).streams[0]
    with pytest.raises(BenchCheckFailed, match="floor"):
        check_floor(dataclasses.replace(s, sse_events=s.sse_events + 1))


# -- timing ----------------------------------------------------------------------------------------------------


def test_measure_reports_real_cpu_and_wall_time() -> None:
    calls = []

    def burn() -> int:
        calls.append(1)
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass
        return 42

    t = measure("x", "burn", burn, repeat=3)
    assert len(calls) == 4  # one warm-up, three timed
    assert t.runs == 3 and len(t.cpu_all) == 3 and len(t.wall_all) == 3
    assert t.cpu_s == min(t.cpu_all) >= 0.019
    assert t.wall_s == min(t.wall_all) >= 0.019
    assert t.output_events == 42
    assert t.per_event_us(1000) == pytest.approx(t.cpu_s / 1000 * 1e6)
    calls.clear()
    t = measure("x", "burn", burn, repeat=2, warmup=False)
    assert len(calls) == 2 and t.runs == 2 and t.output_events == 42


def test_process_cpu_counts_threads_that_exited_between_readings() -> None:
    # The e2e bench's worker CPU: a thread that starts and exits between two readings still counts, to the
    # nanosecond (a reading from tick counters could shrink between readings and read a short run negative).
    me = psutil.Process()

    def burn() -> None:
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass

    readings = [_cpu(me)]
    for _ in range(3):
        before = time.process_time()
        t = threading.Thread(target=burn)
        t.start()
        t.join()
        spent = time.process_time() - before
        readings.append(_cpu(me))
        assert readings[-1] - readings[-2] >= spent >= 0.03
    assert readings == sorted(readings)


def test_process_cpu_of_a_process_that_is_gone_raises_no_such_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ps = psutil.Process(child.pid)
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        _cpu(ps)


def test_run_dialect_without_sdk_gives_rows_from_the_timings() -> None:
    corpus = build_corpus("gemini", SMALL)
    r = run_dialect(corpus, repeat=1, with_sdk=False)
    assert set(r.paths) == {"sluice", "floor"}
    assert r.sse_events == corpus.sse_events and r.bytes == corpus.bytes
    assert r.contract_events == sum(check_sluice("gemini", s) for s in corpus.streams)
    row = r.row("sluice")
    assert row is not None
    t = r.paths["sluice"]
    assert row["mb_per_s"] == pytest.approx(corpus.bytes / 1e6 / t.wall_s)
    assert row["us_per_event"] == pytest.approx(t.cpu_s / corpus.sse_events * 1e6)
    assert r.ratio("sluice", "floor") == pytest.approx(t.cpu_s / r.paths["floor"].cpu_s)
    assert r.ratio("sdk", "sluice") is None
    doc = r.to_json()
    assert doc["ratios"]["sdk_over_sluice"] is None
    assert doc["paths"]["floor"]["output_events"] == corpus.sse_events  # Gemini has no [DONE]


# -- the SDK drivers (skipped when the bench extra is not installed) ------------------------------------------------


@pytest.mark.parametrize("dialect", sorted(SDK_NAMES))
def test_sdk_driver_accumulates_the_same_message(dialect: str) -> None:
    if importlib.util.find_spec("anthropic" if dialect == "anthropic" else "openai") is None:
        pytest.skip("the SDK is not installed (bench extra)")
    driver = sdk_driver(dialect)
    assert driver is not None
    rng = random.Random(2)
    script = make_script(rng, 0)
    calls = (
        ToolCall("get_weather", "c1", ('{"city": "Par', 'is", "note": "a\\', 'nb"}')),
        ToolCall("noop", "c2", ("{}",)),
    )
    streams = [
        synth_stream(dialect, dataclasses.replace(script, blocks=(script.blocks[0], *calls), stop="tool_use"), rng),
        *build_corpus(dialect, 100_000).streams,
    ]
    for s in streams:
        assert check_sdk(driver, SDK_NAMES[dialect], s) > 0
    s = streams[0]
    lying = dataclasses.replace(s, script=dataclasses.replace(s.script, blocks=(Text(("other",)),)))
    with pytest.raises(BenchCheckFailed):
        check_sdk(driver, SDK_NAMES[dialect], lying)


def test_no_sdk_path_for_gemini() -> None:
    assert sdk_driver("gemini") is None


# -- end-to-end helpers -------------------------------------------------------------------------------------------


def test_latency_stamp_round_trips_through_sluice() -> None:
    # What the fake provider does with stamp=1: it writes the send time over the placeholder's zeros.
    us = 1_760_000_123_456_789
    stamp = f"⏱{us:016d}|"
    assert len(stamp) == len(STAMP_PLACEHOLDER)
    for dialect in DIALECTS:
        script = Script(model="m", blocks=(Text((STAMP_PLACEHOLDER + "Hello", STAMP_PLACEHOLDER + " world")),))
        ph, st = STAMP_PLACEHOLDER.encode(), stamp.encode()
        pieces = render(dialect, script)
        if dialect == "bedrock-converse":  # a frame's CRCs cover its payload: stamp it as the fake does
            body = b"".join(reframe(p, lambda b, ph=ph, st=st: b.replace(ph, st)) for p in pieces)
        else:
            body = b"".join(pieces).replace(ph, st)
        _, events, _ = normalize_bytes([body], dialect, StreamInfo("s:1", "s", "", dialect))
        deltas = [e for e in events if isinstance(e, BlockDelta)]
        assert [parse_stamp(encode_event(e)) for e in deltas] == [us, us], dialect
    assert parse_stamp(b'{"text": "no stamp"}') is None
    assert parse_stamp("⏱00012|".encode()) is None  # too short: not a stamp


def test_percentiles_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]
    p = percentiles(values)
    assert p["p50"] == 50 and p["p90"] == 90 and p["p99"] == 99 and p["p99.9"] == 100
    assert p["max"] == 100 and p["mean"] == 50.5 and p["count"] == 100
    assert percentiles([7.0])["p99"] == 7.0
    assert percentiles([]) == {}


def test_scenario_model_and_event_size() -> None:
    opts = E2EOptions(deltas=30, pace_eps=20, tools=1)
    model = scenario_model(opts, 5)
    assert model == "synthetic;deltas=30;words=3-8;stamp=1;seed=5;tools=1;pace_ms=50"
    assert scenario_model(E2EOptions(deltas=10), 1) == "synthetic;deltas=10;words=3-8;stamp=1;seed=1"
    size, contract, raw = mean_event_size("anthropic", scenario_model(E2EOptions(deltas=30), 0))
    # stream.start, block.start, 30 deltas, block.stop, stream.done; Anthropic framing adds 6 events.
    assert contract == 34 and raw == 36
    assert 150 < size < 400


def test_pyspy_summary_by_package_and_function() -> None:
    raw = "\n".join(
        [
            "<module> (worker/__main__.py:7);run (worker/pipeline/consumer.py:70);feed (normalizer/sse.py:120) 6",
            "<module> (worker/__main__.py:7);run (worker/pipeline/consumer.py:70);feed (normalizer/sse.py:130) 2",
            "<module> (worker/__main__.py:7);execute (redis/asyncio/client.py:10);pack (redis/asyncio/connection.py:5) 2",  # noqa: E501 - a py-spy line as it comes
            "garbage line",
        ]
    )
    s = summarize_pyspy(raw)
    assert s["samples"] == 10
    assert s["self_by_package_pct"] == [("sluice normalizer", 80.0), ("redis-py", 20.0)]
    assert s["top_self_pct"][0] == ("feed (normalizer/sse.py)", 80.0)
    assert ("run (worker/pipeline/consumer.py)", 80.0) in s["top_inclusive_sluice_pct"]
    assert summarize_pyspy("")["samples"] == 0


def test_e2e_table_shows_the_floor_latency_next_to_the_workers() -> None:
    row = {
        "streams": 10,
        "pace_eps_per_stream": 20.0,
        "workers": 1,
        "events_per_s": 200.0,
        "worker_cpu_util": 0.1,
        "worker_cpu_us_per_event": 60.0,
        "worker_over_floor_cpu": 6.0,
        "rss_baseline_bytes": 2**25,
        "consumer": {"latency_us": {"p50": 900.0, "p99": 4200.0, "max": 7000.0}, "terminals": {"completed": 10}},
        "floor_client": {"cpu_us_per_event": 10.0, "latency_us": {"p50": 310.0, "p99": 1250.0}},
    }
    no_floor = {**row, "floor_client": {}}
    out = io.StringIO()
    Console(file=out, width=400).print(e2e_table([row, no_floor], "End to end"))
    lines = out.getvalue().splitlines()
    assert "floor latency ms p50/p99" in next(line for line in lines if "case" in line)
    cells = [[c.strip() for c in line.split("│")] for line in lines if "10 × 20/s" in line]
    assert cells[0][cells[0].index("0.90 / 4.20 / 7.00") + 1] == "0.31 / 1.25"
    assert cells[1][cells[1].index("0.90 / 4.20 / 7.00") + 1] == "—"


@pytest.mark.asyncio
async def test_floor_client_counts_every_reply_however_the_reads_split_them() -> None:
    """The floor client knows all its XADDs were answered by counting hiredis' replies; a read that ends
    anywhere in a reply (between a CR and its LF too) must not lose one, or the client waits forever."""
    from sluice.bench.floor_client import _RedisPipe

    ids = [b"1796000000000-%d" % i for i in range(50)]
    replies = b"".join(b"$%d\r\n%s\r\n" % (len(i), i) for i in ids)
    for seed in range(20):
        pipe = _RedisPipe()
        pipe.sent = 50
        rng = random.Random(seed)
        cuts = [*sorted(rng.sample(range(1, len(replies)), 30)), len(replies)]
        cuts += [i + 1 for i in range(len(replies)) if replies[i : i + 1] == b"\r"][:5]  # splits at a CR
        start = 0
        for cut in sorted(set(cuts)):
            pipe.data_received(replies[start:cut])
            start = cut
        assert pipe.replies == 50 and pipe.error is None and pipe.idle.is_set()


@pytest.mark.asyncio
async def test_floor_client_keeps_the_first_error_reply() -> None:
    from sluice.bench.floor_client import _RedisPipe

    pipe = _RedisPipe()
    pipe.sent = 3
    pipe.data_received(b"$3\r\n1-1\r\n-WRONGTYPE Operation against a key\r\n-ERR second\r")
    assert (pipe.replies, pipe.error, pipe.idle.is_set()) == (2, "WRONGTYPE Operation against a key", False)
    pipe.data_received(b"\n")
    assert (pipe.replies, pipe.error, pipe.idle.is_set()) == (3, "WRONGTYPE Operation against a key", True)


def test_http_parse_bench_runs_every_path_on_both_read_patterns() -> None:
    from sluice.bench.http_parse import run_http_parse

    results = run_http_parse(events=50, repeat=1, progress=lambda _: None)
    paths = {r.path for r in results}
    assert {"wire client (http1 + connection)", "http1 parser alone", "h11"} <= paths
    assert {(r.path, r.reads) for r in results} == {(p, m) for p in paths for m in ("chunk per read", "64 KiB reads")}
    assert all(r.us_per_event > 0 for r in results)


def _admin_args() -> argparse.Namespace:
    return argparse.Namespace(requests=4, deltas=10, repeat=1, quick=True)


def test_admin_bench_measures_an_attempt_and_a_scrape() -> None:
    from sluice.bench.admin import run_admin

    result = run_admin(_admin_args(), Console(file=io.StringIO()))
    # message_start, content_block_start, a ping, 10 deltas, content_block_stop, message_delta, message_stop
    assert (result["attempts"], result["deltas"], result["reads_per_attempt"]) == (4, 10, 16)
    assert set(result["attempt_cpu_us"]) == {"off", "admin"}
    assert all(us > 0 for us in result["attempt_cpu_us"].values())
    assert set(result["scrape"]) == {"text 0.0.4", "OpenMetrics 1.0.0"}
    for s in result["scrape"].values():
        assert s["ms"] > 0 and s["samples"] > 100
    assert result["open_fds"] is None or result["open_fds"] >= 400  # the descriptors a loaded worker holds


def test_the_validator_comparison_runs_and_every_candidate_agrees_with_the_reference() -> None:
    from sluice.bench.validators import SCHEMAS, run_validators

    args = argparse.Namespace(quick=True, repeat=1, seed=7)
    out = run_validators(args, Console(file=io.StringIO(), width=200))
    rows = out["validators"]
    assert set(rows) == {"jsonschema-rs", "jsonschema", "fastjsonschema", "sluice verdict"}
    assert all(r["agrees"] for r in rows.values()), rows
    for name, r in rows.items():
        kinds = {"valid", "invalid"} | (set() if name == "sluice verdict" else {"compile"})
        assert kinds <= set(r) and all(r[k]["low_us"] <= r[k]["median_us"] <= r[k]["high_us"] for k in kinds)
    assert out["schemas"] == list(SCHEMAS) and out["rounds"] == 1

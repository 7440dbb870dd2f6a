"""``sluice demo``: the whole pipeline on one machine, in seconds, with nothing configured.

Rule: the demo owns everything it starts and stops all of it before it returns: an embedded Redis (unless
``REDIS_URL`` or ``--redis-url`` names one; then every key goes under a fresh, unique prefix), the fake
provider and one worker, both in this process. It sends one job per dialect (multi-byte text, reasoning,
tool calls), one that fails mid-stream (an overloaded error after some text) and one per cloud (an Azure
OpenAI deployment path with ``api-key``; Claude on Vertex AI with an OAuth2 token refreshed against the
fake's token endpoint, when the google extra is installed), shows them streaming
(a compact live view on a terminal, plain lines otherwise), then prints a summary and the commands that
inspect the stored logs. It exits 0 only when every job ended as the demo expects, so it doubles as a
smoke test. ``--keep`` leaves the embedded Redis running and says how to stop it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import quote

import anyio
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from rich import box
from rich.console import Console, Group, JustifyMethod
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sluice.client import SluiceClient
from sluice.harness.embedded_redis import EmbeddedRedis, RedisUnavailable, embedded_redis
from sluice.harness.fake import google_sa
from sluice.harness.fake.provider import TOKEN_PATH, serve_fake_provider
from sluice.harness.fake.scenarios import encode_scenario
from sluice.normalizer.adapters import DIALECTS
from sluice.normalizer.assemble import AssembledBlock, Assembly
from sluice.schemas.events import BlockDelta, BlockStop, Event, StreamDone, StreamError, StreamStart
from sluice.schemas.states import TERMINAL_STATES
from sluice.worker.config import Config, RetryPolicy, Route, Timeouts
from sluice.worker.pipeline.consumer import Worker
from sluice.worker.redis.connect import QUIET

__all__ = ["DemoJob", "JobView", "configure_parser", "demo_jobs", "main", "run_from_args"]

KEY_ENV = "SLUICE_DEMO_API_KEY"  # the route's api_key_env; the demo sets it for itself
SA_ENV = "SLUICE_DEMO_VERTEX_SA"  # the Vertex route's service-account file (token_uri: the fake's endpoint)
_DEFAULT_PREFIX = "sluice"
_RETENTION_S = 3600  # on a Redis of the user's own, the demo's request keys expire after an hour
_MULTIBYTE = "Grüße aus Zürich! Привет, мир. 日本語のテキストも一緒に流れます。Emoji too 🙂🌊 — every byte in order."
_SLUICE = (
    "A sluice is a gate in a channel: it lets the water through at a pace you choose, and nothing that passed "
    "it is lost. Sluice does the same for tokens."
)
_STORY = (
    "Once upon a time a river carried every token to the sea, in order, until a storm upstream made the "
    "provider too busy to go on"
)


@dataclass(frozen=True, slots=True)
class DemoJob:
    name: str  # the row label and the request id's suffix
    route: str  # a route of the demo's config: one per dialect, named after it
    shows: str  # what this job demonstrates
    scenario: str  # the requested model: the fake provider's scenario (see sluice.harness.fake.scenarios)
    prompt: str
    expect_status: str
    expect_reason: str  # stop reason when completed, error category otherwise
    tools: bool = False


def demo_jobs(pace_ms: float, vertex: bool | None = None) -> tuple[DemoJob, ...]:
    """The demo's jobs; ``pace_ms`` spaces the provider's events so the streaming is visible. One job per
    cloud: Azure OpenAI always, Claude on Vertex AI when the google extra is installed (``vertex``)."""
    vertex = google_sa.available() if vertex is None else vertex
    pace = f"pace_ms={pace_ms:g}"

    def text(t: str) -> str:
        return "text=" + quote(t, safe="")  # the scenario syntax: ';' separates keys

    # A cloud's model name travels in the URL path too: base64url-encoded scenarios.
    clouds: tuple[DemoJob, ...] = (
        DemoJob(
            "azure",
            "azure",
            "Azure deployment, api-key",
            encode_scenario(f"synthetic;{text('Served from an Azure OpenAI deployment path.')};{pace};seed=16"),
            "Which cloud answers?",
            "completed",
            "stop",
        ),
    )
    if vertex:
        clouds += (
            DemoJob(
                "vertex-claude",
                "vertex-claude",
                "Vertex AI, OAuth token",
                encode_scenario(f"synthetic;{text('Claude on Vertex, with a refreshed OAuth2 token.')};{pace};seed=17"),
                "Which cloud answers?",
                "completed",
                "stop",
            ),
        )
    dialects = (
        DemoJob(
            "anthropic",
            "anthropic",
            "thinking + text",
            f"synthetic;reasoning=5;{text(_SLUICE)};{pace};seed=11",
            "Think first, then answer: what does a sluice do?",
            "completed",
            "stop",
        ),
        DemoJob(
            "openai-chat",
            "openai-chat",
            "multi-byte text",
            f"synthetic;{text(_MULTIBYTE)};{pace};seed=12",
            "Say hello in three scripts.",
            "completed",
            "stop",
        ),
        DemoJob(
            "openai-responses",
            "openai-responses",
            "text + tool call",
            f"synthetic;{text('Let me look that up for you.')};tools=1;{pace};seed=13",
            "What is the weather in Paris?",
            "completed",
            "tool_use",
            tools=True,
        ),
        # A Gemini model name travels in the URL path: the scenario goes base64url-encoded.
        DemoJob(
            "gemini",
            "gemini",
            "thoughts + 2 tools",
            encode_scenario(f"synthetic;reasoning=3;{text('Two lookups, in parallel.')};tools=2;{pace};seed=14"),
            "Weather in Paris, and find the docs on rivers.",
            "completed",
            "tool_use",
            tools=True,
        ),
        DemoJob(
            "anthropic-overloaded",
            "anthropic",
            "overloaded mid-stream",
            f"synthetic;{text(_STORY)};error_after=9;error=overloaded;{pace};seed=15",
            "Tell me a long story.",
            "failed",
            "overloaded",
        ),
    )
    return (*dialects, *clouds)


_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "search_docs",
        "description": "Search the documentation",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
]


def _job_doc(job: DemoJob, request_id: str) -> dict[str, object]:
    request: dict[str, object] = {"messages": [{"role": "user", "content": job.prompt}], "max_tokens": 512}
    if job.tools:
        request["tools"] = _TOOLS
    return {"route": job.route, "model": job.scenario, "request_id": request_id, "request": request}


@dataclass(slots=True)
class JobView:
    """What the demo has seen of one request, built only from its normalized events."""

    job: DemoJob
    request_id: str
    queued_ms: int
    state: str = "queued"  # then "streaming", then the terminal event's status
    attempt: int = 0
    events: int = 0
    fold: Assembly = field(default_factory=Assembly)  # the current attempt's blocks and terminal
    first_token_ms: int | None = None

    @property
    def blocks(self) -> list[AssembledBlock]:
        return list(self.fold.blocks.values())

    @property
    def stop_reason(self) -> str | None:
        t = self.fold.terminal
        return t.stop_reason if isinstance(t, StreamDone) else None

    @property
    def error_category(self) -> str | None:
        t = self.fold.terminal
        return t.error.category if isinstance(t, StreamError) else None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def reason(self) -> str | None:
        return self.stop_reason if self.state == "completed" else self.error_category

    @property
    def as_expected(self) -> bool:
        return self.state == self.job.expect_status and self.reason == self.job.expect_reason

    def apply(self, ev: Event) -> AssembledBlock | None:
        """Fold one event in; returns the block a ``block.stop`` closed (for the plain output). A new
        attempt starts over (only before anything was visible)."""
        self.events += 1
        block = self.fold.apply(ev)
        if isinstance(ev, StreamStart):
            self.attempt, self.state = ev.attempt, "streaming"
        elif isinstance(ev, BlockDelta):
            if ev.delta.kind != "signature" and self.first_token_ms is None:
                self.first_token_ms = ev.ts - self.queued_ms
        elif isinstance(ev, StreamDone | StreamError):
            self.state = ev.status
        return block if isinstance(ev, BlockStop) else None


# -- rendering -----------------------------------------------------------------------------------------

_STATE_STYLE = {"queued": "dim", "streaming": "yellow", "completed": "green", "failed": "red", "interrupted": "red"}
_NAME_WIDTH = 22


def _block_text(block: AssembledBlock) -> Text:
    flat = block.text.replace("\n", " ")
    if block.kind == "reasoning":
        return Text(flat, style="dim italic")
    if block.kind == "tool_call":
        return Text(f"⚙ {block.name}({flat}{')' if block.closed else ''}", style="cyan")
    if block.kind == "refusal":
        return Text(f"⊘ {flat}", style="red")
    return Text(flat)


def _content(view: JobView) -> Text:
    out = Text()
    for i, block in enumerate(view.blocks):
        if i:
            out.append(" │ ", style="dim")
        out.append_text(_block_text(block))
    if view.error_category is not None:  # the attempt ended failed or interrupted
        out.append(f"  ✗ {view.error_category}", style="bold red")
    return out


def _tail(text: Text, cells: int) -> Text:
    """The end of ``text`` that fits in ``cells`` terminal cells (wide characters count twice)."""
    from rich.cells import cell_len

    plain = text.plain
    if cell_len(plain) <= cells:
        return text
    used, start = 1, len(plain)  # one cell for the ellipsis
    while start > 0 and used + cell_len(plain[start - 1]) <= cells:
        start -= 1
        used += cell_len(plain[start])
    out = Text()
    out.append("…", style="dim")  # appended, not the base style: that would dim the whole line
    out.append_text(text[start:])
    return out


def _live_view(views: list[JobView], header: Text, started: float, width: int) -> Group:
    table = Table(box=None, show_header=False, padding=(0, 1), expand=False)
    table.add_column(width=_NAME_WIDTH, no_wrap=True, style="bold")
    table.add_column(width=10, no_wrap=True)
    table.add_column(width=4, no_wrap=True, justify="right")
    stream_cells = max(20, width - _NAME_WIDTH - 10 - 4 - 8)
    table.add_column(width=stream_cells, no_wrap=True)
    for v in views:
        state = Text(v.state, style=_STATE_STYLE.get(v.state, ""))
        table.add_row(v.job.name, state, str(v.events), _tail(_content(v), stream_cells))
    clock = Text(f"  {time.monotonic() - started:4.1f}s", style="dim")
    return Group(header + clock, table)


def _kinds(blocks: list[AssembledBlock]) -> str:
    """``reasoning, text, tool_call ×2``: the block kinds in order, repeats counted."""
    out: list[tuple[str, int]] = []
    for b in blocks:
        if out and out[-1][0] == b.kind:
            out[-1] = (b.kind, out[-1][1] + 1)
        else:
            out.append((b.kind, 1))
    return ", ".join(kind if n == 1 else f"{kind} ×{n}" for kind, n in out)


def _summary(views: list[JobView]) -> Table:
    table = Table(title="sluice demo: summary", title_justify="left", box=box.SIMPLE_HEAD)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("dialect", "left"),
        ("shows", "left"),
        ("status", "left"),
        ("stop reason", "left"),
        ("blocks", "left"),
        ("events", "right"),
        ("first token", "right"),
    )
    for name, justify in columns:
        wraps = name in ("shows", "blocks")  # the rest never wrap; these two give way on a narrow terminal
        table.add_column(name, justify=justify, no_wrap=not wraps, min_width=12 if wraps else None)
    for v in views:
        kinds = _kinds(v.blocks)
        reason = (
            v.stop_reason if v.state == "completed" else (f"error: {v.error_category}" if v.error_category else "—")
        )
        ttft = f"{v.first_token_ms} ms" if v.first_token_ms is not None else "—"
        table.add_row(
            v.job.route,
            v.job.shows,
            Text(v.state, style=_STATE_STYLE.get(v.state, "")),
            reason,
            kinds or "none",
            str(v.events),
            ttft,
        )
    return table


class _Output:
    """Live view on a terminal; on anything else, one plain line per block and per terminal event."""

    def __init__(self, console: Console, plain: bool) -> None:
        self.console = console
        self.plain = plain

    def line(self, text: str) -> None:
        if self.plain:
            print(text, flush=True)
        else:
            self.console.print(text, highlight=False)

    def block_closed(self, view: JobView, block: AssembledBlock) -> None:
        if self.plain:
            label = f"{block.kind} {block.name}" if block.name else block.kind
            self.line(f"{view.job.name:<{_NAME_WIDTH}} {label}: {block.text}")

    def finished(self, view: JobView) -> None:
        if self.plain:
            for block in view.blocks:
                if not block.closed:  # what arrived before the failure stays in the log
                    self.line(f"{view.job.name:<{_NAME_WIDTH}} {block.kind} (never closed): {block.text}")
            self.line(f"{view.job.name:<{_NAME_WIDTH}} {view.state} ({view.reason}), {view.events} events")


# -- running -------------------------------------------------------------------------------------------


def _config(redis_url: str, prefix: str, base_url: str, cluster: bool = False, vertex: bool = False) -> Config:
    routes = {d: Route(dialect=d, base_url=base_url, model="synthetic", api_key_env=KEY_ENV) for d in DIALECTS}
    routes["azure"] = Route(
        dialect="openai-chat",
        base_url=base_url,
        path="/openai/deployments/{model}/chat/completions?api-version=2024-10-21",
        auth="api-key",
        model="synthetic",
        api_key_env=KEY_ENV,
    )
    if vertex:
        routes["vertex-claude"] = Route(
            dialect="anthropic",
            base_url=base_url,
            request_options={"vertex": "true"},
            auth="google",
            credentials_file_env=SA_ENV,
            project="sluice-demo",
            location="us-east5",
            model="synthetic",
        )
    return Config(
        redis_url=redis_url,
        key_prefix=prefix,
        consumer="demo-worker",
        routes=routes,
        max_in_flight=16,
        redis_cluster=cluster,
        retention_seconds=_RETENTION_S,
        shutdown_grace=0.5,
        timeouts=Timeouts(connect=5, first_byte=10, idle=10, total=60),
        retry=RetryPolicy(max_attempts=2, base_delay=0.05, max_delay=0.2, max_total=2),
    )


@contextlib.contextmanager
def _api_key_env() -> Iterator[str]:
    """The fake provider's key, in the env var the routes name, for as long as the demo runs."""
    before = os.environ.get(KEY_ENV)
    key = before or secrets.token_urlsafe(24)
    os.environ[KEY_ENV] = key
    try:
        yield key
    finally:
        if before is None:
            os.environ.pop(KEY_ENV, None)


@contextlib.asynccontextmanager
async def _vertex_account(token_uri: str) -> AsyncIterator[bool]:
    """A throwaway service-account file for the Vertex route, named by ``SA_ENV`` while the demo runs
    (False, and no Vertex job, without the google extra)."""
    if not google_sa.available():
        yield False
        return
    before = os.environ.get(SA_ENV)
    with tempfile.TemporaryDirectory(prefix="sluice-demo-") as tmp:
        os.environ[SA_ENV] = str(google_sa.write_service_account(Path(tmp) / "sa.json", token_uri))
        try:
            yield True
        finally:
            if before is None:
                os.environ.pop(SA_ENV, None)
            else:
                os.environ[SA_ENV] = before


async def _follow(client: SluiceClient, view: JobView, out: _Output) -> None:
    async for ev in client.events(view.request_id):
        block = view.apply(ev)
        if block is not None:
            out.block_closed(view, block)
        if view.finished and isinstance(ev, StreamDone | StreamError):
            out.finished(view)


@dataclass(slots=True)
class _Run:
    views: list[JobView] = field(default_factory=list)
    fake_url: str = ""
    timed_out: bool = False
    interrupted: bool = False
    seconds: float = 0.0
    cluster: bool = False  # the Redis was a cluster's node (--redis-cluster)


async def _stop_on_signal(phase: anyio.CancelScope, everything: anyio.CancelScope, run: _Run) -> None:
    """The first SIGINT/SIGTERM ends the demo's jobs (the worker still shuts down in order and records
    them as interrupted); a second one cancels everything at once. Every ``finally`` runs either way."""
    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if run.interrupted:
                    everything.cancel()
                    return
                run.interrupted = True
                phase.cancel()
    except (ValueError, NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        return


async def _demo(
    args: argparse.Namespace, redis_url: str, prefix: str, where: str, console: Console, plain: bool
) -> _Run:
    run = _Run()
    started = time.monotonic()
    phase = anyio.CancelScope()
    with _api_key_env() as key:
        async with anyio.create_task_group() as guard:
            guard.start_soon(_stop_on_signal, phase, guard.cancel_scope, run)
            await _demo_body(args, run, phase, key, redis_url, prefix, where, _Output(console, plain))
            guard.cancel_scope.cancel()
    run.seconds = time.monotonic() - started
    return run


async def _demo_body(
    args: argparse.Namespace,
    run: _Run,
    phase: anyio.CancelScope,
    key: str,
    redis_url: str,
    prefix: str,
    where: str,
    out: _Output,
) -> None:
    started = time.monotonic()
    run_id = secrets.token_hex(3)
    async with serve_fake_provider(api_key=key) as fake, _vertex_account(fake.base_url + TOKEN_PATH) as vertex:
        run.fake_url = fake.base_url
        cluster = run.cluster = bool(getattr(args, "redis_cluster", False))
        worker = Worker(_config(redis_url, prefix, fake.base_url, cluster, vertex))
        client = SluiceClient(redis_url, key_prefix=prefix, retention_seconds=_RETENTION_S, cluster=cluster)
        # Leaving this task group waits for worker.run to return: the worker is gone before the summary.
        async with anyio.create_task_group() as workers:
            ready = anyio.Event()
            workers.start_soon(partial(worker.run, ready=ready.set))
            try:
                with phase:
                    with anyio.fail_after(15):
                        await ready.wait()
                    header = Text.assemble(
                        ("sluice demo", "bold"),
                        f" · Redis {redis_url} ({where}) · fake provider {fake.base_url} · worker {worker.consumer}"
                        f" · key prefix {prefix}",
                    )
                    if out.plain:
                        out.line(header.plain)
                    for job in demo_jobs(args.pace_ms, vertex):
                        rid = f"demo-{run_id}-{job.name}"
                        run.views.append(JobView(job, rid, time.time_ns() // 1_000_000))
                        await client.enqueue(_job_doc(job, rid))
                        if out.plain:
                            out.line(f"{job.name:<{_NAME_WIDTH}} queued as {rid} ({job.shows})")
                    live = None if out.plain else Live(console=out.console, refresh_per_second=15)
                    with anyio.move_on_after(args.timeout) as deadline, live or contextlib.nullcontext():
                        async with anyio.create_task_group() as display:
                            if live is not None:
                                display.start_soon(_refresh, live, run.views, header, started, out.console)
                            async with anyio.create_task_group() as followers:
                                for view in run.views:
                                    followers.start_soon(_follow, client, view, out)
                            display.cancel_scope.cancel()
                        if live is not None:
                            live.update(_live_view(run.views, header, started, out.console.width), refresh=True)
                    run.timed_out = deadline.cancelled_caught
            finally:
                worker.stop()  # it returns after its current XREADGROUP block, at most a second
                with anyio.CancelScope(shield=True):
                    await client.aclose()


async def _refresh(live: Live, views: list[JobView], header: Text, started: float, console: Console) -> None:
    while True:
        live.update(_live_view(views, header, started, console.width))
        await anyio.sleep(1 / 15)


# -- the command ---------------------------------------------------------------------------------------


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis instead of an embedded one, with a fresh key prefix (default: $REDIS_URL)",
    )
    p.add_argument("--key-prefix", default=None, help="key prefix on your own Redis (default: sluice-demo-<random>)")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="--redis-url names a node of a Redis Cluster (default: $SLUICE_REDIS_CLUSTER)",
    )
    p.add_argument("--keep", action="store_true", help="leave the embedded Redis running afterwards, to inspect it")
    p.add_argument("--plain", action="store_true", help="plain lines instead of the live view (default off a TTY)")
    p.add_argument("--pace-ms", type=float, default=60.0, help="delay between provider events (default 60)")
    p.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds (default 60)")


def run_from_args(args: argparse.Namespace) -> int:
    """Exit 0 when every job ended as expected, 1 when one did not, 2 when the demo could not start, 130
    when interrupted."""
    console = Console(highlight=False) if sys.stdout.isatty() else Console(width=200, highlight=False)
    plain = args.plain or not console.is_terminal
    url = args.redis_url or os.environ.get("REDIS_URL")
    if args.redis_cluster is None:
        args.redis_cluster = os.environ.get("SLUICE_REDIS_CLUSTER", "").strip().lower() in ("1", "true", "yes", "on")
    if args.redis_cluster and not url:
        print("sluice demo: --redis-cluster needs --redis-url (a node of the cluster)", file=sys.stderr)
        return 2
    with _sigterm_interrupts():
        try:
            if url:
                prefix = args.key_prefix or f"sluice-demo-{secrets.token_hex(4)}"
                if not anyio.run(_reachable, url):
                    print(f"sluice demo: Redis unreachable at {url}", file=sys.stderr)
                    return 2
                run = anyio.run(_demo, args, url, prefix, "yours", console, plain)
                return _report(console, run, url, prefix, None, keep=False)
            with embedded_redis(keep=args.keep) as server:
                run = anyio.run(_demo, args, server.url, _DEFAULT_PREFIX, "embedded", console, plain)
                return _report(console, run, server.url, _DEFAULT_PREFIX, server, keep=args.keep)
        except RedisUnavailable as exc:
            print(f"sluice demo: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # outside the event loop's own signal handling; the with blocks cleaned up
            print("sluice demo: interrupted", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM outside the event loop behaves like Ctrl-C, so the embedded Redis is stopped and its files
    removed instead of the process dying on the spot."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _reachable(url: str) -> bool:
    r = aioredis.Redis.from_url(url, socket_connect_timeout=3, **QUIET)
    try:
        return bool(await r.ping())
    except (RedisConnectionError, OSError):
        return False
    finally:
        await r.aclose()


def sluice_command() -> str:
    """How a new shell runs this installation's ``sluice`` (its bin directory is seldom on PATH): the full
    path of the script this process runs as, else the one beside this interpreter (a venv's bin), else
    ``python -m`` with this interpreter's full path."""
    argv0 = Path(sys.argv[0])
    for script in (argv0, Path(sys.executable).parent / "sluice"):
        if script.name == "sluice" and script.is_file():
            return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(sys.executable)} -m sluice.cli.main"


def _report(console: Console, run: _Run, url: str, prefix: str, server: EmbeddedRedis | None, *, keep: bool) -> int:
    say = partial(console.print, highlight=False, soft_wrap=True)
    say()
    say(_summary(run.views))
    ok = sum(v.as_expected for v in run.views)
    if run.interrupted:
        verdict = "interrupted"
    elif run.timed_out:
        verdict = "timed out waiting for " + ", ".join(v.job.name for v in run.views if not v.finished)
    else:
        verdict = "all as expected" if ok == len(run.views) else f"{len(run.views) - ok} NOT as expected"
    say(
        f"{len(run.views)} requests in {run.seconds:.1f} s: {verdict}. The worker and the fake provider "
        f"({run.fake_url}) have stopped."
    )
    where = f"--redis-url {url}" + ("" if prefix == _DEFAULT_PREFIX else f" --key-prefix {prefix}")
    where += " --redis-cluster" if run.cluster else ""
    if run.views:
        first, failed = run.views[0], next((v for v in run.views if v.state != "completed"), run.views[-1])
        say("\nInspect the stored logs (request ids: " + ", ".join(v.request_id for v in run.views) + "):")
        sluice = sluice_command()
        say(f"  {sluice} tail {first.request_id} {where}          # the normalized events, as a live view")
        say(f"  {sluice} tail {first.request_id} --raw {where}    # the provider's events exactly as received")
        say(f"  {sluice} audit {first.request_id} {where}         # re-normalize the raw log and compare")
        say(f"  {sluice} status {failed.request_id} {where}")
    if server is None:
        hours = _RETENTION_S // 3600
        say(
            f"\nThe keys are under the prefix {prefix!r} on {url}; request keys expire after {hours} h."
            f"\nRemove them all now with:\n  redis-cli -u {url} --scan --pattern '{prefix}:*' | "
            f"xargs -r redis-cli -u {url} del"
        )
    elif keep:
        say(f"\nThe embedded Redis is still running (pid {server.pid}). Stop it with:\n  {server.stop_hint}")
    else:
        say(
            "\nThe embedded Redis stopped with the demo, so those commands need it kept: run "
            f"`{sluice_command()} demo --keep`, or point the demo at a Redis of your own with REDIS_URL=redis://HOST:6379/0."
        )
    if run.interrupted:
        return 130
    return 0 if ok == len(run.views) and not run.timed_out else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m sluice.cli.demo``: the same as ``sluice demo``."""
    parser = argparse.ArgumentParser(prog="sluice demo", description="run the whole pipeline locally, in seconds")
    configure_parser(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The ``sluice`` command: one entry point, one sub-command per operator task.

Rule: a command's module is imported only when that command runs (or shows its ``--help``), so one
command's dependencies never slow or break another, and a command whose module is not installed says
"not available" and exits 2. Every command prints a clear one-line error and exits 2 on unusable input
(a missing or unreadable file, an unknown request, Redis unreachable); the other statuses are one table,
``sluice.cli.exits``. ``normalize`` and ``frames`` read files, not requests: a stream that merely ended badly
is still processed input and exits 0 (``frames`` exits 1 past a line or event limit).

Commands are registered by reference: each ``Command`` holds a loader whose import statement names the
command's two functions, so the registry costs no import until a command runs and still leads to its code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from sluice.cli.exits import Exit
from sluice.worker.extras import install_hint
from sluice.worker.files import UnreadableFile, open_input, read_error

__all__ = ["COMMANDS", "build_parser", "main"]

_ENC = msgspec.json.Encoder()
_CHUNK = 64 * 1024


class CliError(Exception):
    """A one-line message for the operator; exit status 2."""


Configure = Callable[[argparse.ArgumentParser], None]  # adds a command's arguments to its parser
Run = Callable[[argparse.Namespace], int]  # runs it; returns the exit status
Loaded = tuple[Configure, Run]


@dataclass(frozen=True, slots=True)
class Command:
    # Imports the command's module and returns its two functions: each loader below names them in an
    # import statement, so a reader (and an editor's go-to-definition, and mypy) finds them from here.
    load: Callable[[], Loaded]
    help: str
    examples: str
    extra: str | None = None  # the pyproject extra that brings its dependencies


def _enqueue() -> Loaded:
    from sluice.cli.requests import cmd_enqueue, configure_enqueue

    return configure_enqueue, cmd_enqueue


def _tail() -> Loaded:
    from sluice.cli.requests import cmd_tail, configure_tail

    return configure_tail, cmd_tail


def _status() -> Loaded:
    from sluice.cli.requests import cmd_status, configure_status

    return configure_status, cmd_status


def _cancel() -> Loaded:
    from sluice.cli.requests import cmd_cancel, configure_cancel

    return configure_cancel, cmd_cancel


def _routes() -> Loaded:
    from sluice.cli.routes import cmd_routes, configure_routes

    return configure_routes, cmd_routes


def _reprice() -> Loaded:
    from sluice.archive.reprice import configure_parser, run_from_args

    return configure_parser, run_from_args


def _budgets() -> Loaded:
    from sluice.cli.budgets import cmd_budgets, configure_budgets

    return configure_budgets, cmd_budgets


def _audit() -> Loaded:
    from sluice.cli.audit import configure_parser, run_from_args

    return configure_parser, run_from_args


def _archive() -> Loaded:
    from sluice.archive.cli import configure_parser, run_from_args

    return configure_parser, run_from_args


def _dlq() -> Loaded:
    from sluice.cli.dlq import configure_parser, run_from_args

    return configure_parser, run_from_args


def _worker() -> Loaded:
    from sluice.worker.main import cmd_worker, configure_worker

    return configure_worker, cmd_worker


def _fake_provider() -> Loaded:
    from sluice.harness.fake.provider import configure_parser, run_from_args

    return configure_parser, run_from_args


def _demo() -> Loaded:
    from sluice.cli.demo import configure_parser, run_from_args

    return configure_parser, run_from_args


def _relay() -> Loaded:
    from sluice.relay.cli import configure_parser, run_from_args

    return configure_parser, run_from_args


def _bench() -> Loaded:
    from sluice.bench.main import configure_parser, run_from_args

    return configure_parser, run_from_args


COMMANDS: dict[str, Command] = {
    "enqueue": Command(
        _enqueue,
        "enqueue a job and print its request_id",
        "sluice enqueue job.json\n  sluice enqueue --route anthropic --prompt 'Hello' --follow\n"
        "  sluice enqueue job.json --request-id order-42 --metadata tenant=acme\n  cat job.json | sluice enqueue -",
    ),
    "tail": Command(
        _tail,
        "follow a request live until it ends (a live view on a terminal, plain text when piped); exits 0 "
        "completed, 3 failed, 4 interrupted",
        "sluice tail req_0123\n  sluice tail req_0123 --json | jq -c 'select(.type==\"block.delta\")'\n"
        "  sluice tail req_0123 --after 1-5 --json\n  sluice tail req_0123 --raw",
    ),
    "status": Command(
        _status,
        "print a request's status record (JSON); exits 0 completed, 3 failed, 4 interrupted, 5 not finished",
        "sluice status req_0123\n  sluice status req_0123 | jq -r .state",
    ),
    "cancel": Command(
        _cancel,
        "cancel a request: the worker closes the upstream connection and ends it interrupted / cancelled",
        "sluice cancel req_0123\n  sluice cancel req_0123 --wait",
    ),
    "routes": Command(
        _routes,
        "show each limited route's capacity: limits, in flight, waiting by priority and tenant, cooldown, counters",
        "sluice routes\n  sluice routes --route claude --json | jq .routes[0].in_flight",
    ),
    "budgets": Command(
        _budgets,
        "show each budget's current window: amount, spent, reserved, left, window end",
        "sluice budgets\n  sluice budgets --tenant acme --json | jq .budgets[0].left",
    ),
    "audit": Command(
        _audit,
        "re-normalize a request's raw log and prove it reproduces the stored events and result hash",
        "sluice audit req_0123\n  sluice audit --since 10m\n  sluice audit --since 2h --quiet\n"
        "  sluice audit req_0123 -c sluice.toml    # replay with the worker's configured limits",
    ),
    "archive": Command(
        _archive,
        "write every finished request to a directory or object store before Redis retention expires it",
        "sluice archive --to /var/lib/sluice/archive\n  sluice archive --to s3://bucket/sluice --concurrency 16\n"
        "  sluice archive --status\n  sluice archive --to s3://bucket/sluice --verify",
    ),
    "reprice": Command(
        _reprice,
        "recompute archived requests' costs under another price table, written beside the originals",
        "sluice reprice --archive /var/lib/sluice/archive --prices discount.toml\n"
        "  sluice reprice --archive s3://bucket/sluice --prices corrected.toml --since 7d",
    ),
    "dlq": Command(
        _dlq,
        "list, requeue, delete or purge dead-lettered jobs",
        "sluice dlq list\n  sluice dlq requeue 1732900000000-0\n  sluice dlq delete 1732900000000-0\n"
        "  sluice dlq purge --yes",
    ),
    "worker": Command(
        _worker,
        "run a worker: take jobs from Redis, stream them, write the logs",
        "sluice worker --config sluice.toml\n  sluice worker -c sluice.toml --redis-url redis://redis:6379/0\n"
        "  sluice worker -c sluice.toml --fail-fast --log-format json   # under a supervisor",
    ),
    "fake-provider": Command(
        _fake_provider,
        "run the local fake provider (every dialect, synthetic streams and faults) on loopback",
        "SLUICE_FAKE_API_KEY=k sluice fake-provider --port 8089\n"
        "  then route base_url = http://127.0.0.1:8089 and model 'synthetic;deltas=20;pace_ms=50'",
    ),
    "normalize": Command(
        lambda: (_configure_normalize, _cmd_normalize),
        "normalize a recorded provider stream into contract events (end of file = end of transport)",
        "sluice normalize --dialect anthropic capture.sse\n"
        "  sluice normalize --dialect openai-chat --result capture.sse",
    ),
    "frames": Command(
        lambda: (_configure_frames, _cmd_frames),
        "decode a raw text/event-stream body into SSE events (one JSON per line)",
        "sluice frames capture.sse\n  curl -N ... | sluice frames -",
    ),
    "demo": Command(
        _demo,
        "run everything locally (Redis, fake provider, worker) and stream one job per dialect",
        "sluice demo",
    ),
    "relay": Command(
        _relay,
        "serve request streams to browsers and other HTTP clients (SSE and WebSocket)",
        "SLUICE_RELAY_SECRETS=$(openssl rand -hex 32) sluice relay --port 8090\n"
        "  curl -N -H 'Authorization: Bearer <secret>' http://127.0.0.1:8090/v1/requests/req_0123/events\n"
        "  sluice relay --mint req_0123 --ttl 600      # a token for one request; open /view/req_0123?token=...",
        extra="relay",
    ),
    "bench": Command(
        _bench,
        "measure throughput and latency against the fake provider (results beside a floor and the SDKs)",
        "sluice bench --quick                        # every mode, small, in well under a minute each\n"
        "  sluice bench normalizer --dialects anthropic --size-mb 5\n"
        "  sluice bench e2e --streams 200 --pace 40 --http-client wire,httpx --out e2e.json\n"
        "  sluice bench memory --redis-delay-ms 20 --redis-bytes-per-s 1000000\n"
        "  sluice bench capacity --quick             # route limits: burst, fairness, admission cost",
    ),
}


# -- frames / normalize (offline, no Redis) ------------------------------------------------------------------


def _open(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    return open_input(path, "file")


def _chunks(stream: BinaryIO, path: str) -> Iterator[bytes]:
    try:
        while chunk := stream.read(_CHUNK):
            yield chunk
    except OSError as exc:  # e.g. EIO, or a directory handed in as standard input
        if path == "-":
            raise CliError(f"cannot read standard input: {exc.strerror or exc}") from None
        raise read_error(path, "file", exc) from None


def _write(obj: object) -> None:
    sys.stdout.buffer.write(_ENC.encode(obj) + b"\n")


def _configure_frames(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the body to decode, or - for standard input")
    p.add_argument("--max-line-bytes", type=int, default=1 << 20, help="longest line accepted (default: 1 MiB)")
    p.add_argument("--max-event-bytes", type=int, default=4 << 20, help="largest event accepted (default: 4 MiB)")


def _cmd_frames(args: argparse.Namespace) -> int:
    from sluice.normalizer.sse import SSEDecoder, SSELimitExceeded

    decoder = SSEDecoder(max_line_bytes=args.max_line_bytes, max_event_bytes=args.max_event_bytes)
    with _open(args.file) as f:
        for chunk in _chunks(f, args.file):
            try:
                events = decoder.feed(chunk)
            except SSELimitExceeded as exc:
                for ev in exc.events:
                    _write({"event": ev.event, "data": ev.data, "id": ev.id, "retry": ev.retry})
                print(f"sluice frames: {exc.message}", file=sys.stderr)
                return 1
            for ev in events:
                _write({"event": ev.event, "data": ev.data, "id": ev.id, "retry": ev.retry})
    decoder.close()
    return 0


def _configure_normalize(p: argparse.ArgumentParser) -> None:
    from sluice.normalizer.adapters import DIALECTS

    p.add_argument("file", help="the recorded body, or - for standard input")
    p.add_argument("--dialect", required=True, metavar="D", help=f"one of: {', '.join(DIALECTS)}")
    p.add_argument("--result", action="store_true", help="print the assembled result instead of the events")
    p.add_argument("--request-id", default="local", help="request_id stamped on events (default: local)")
    p.add_argument("--attempt", type=int, default=1, help="the attempt stamped on events (default: 1)")
    p.add_argument("--model", default=None, help="the requested model, until the provider names its own")
    p.add_argument("--ts", type=int, default=0, help="the ts stamped on every event (unix ms; default 0)")


def _cmd_normalize(args: argparse.Namespace) -> int:
    from sluice.normalizer.machine import StreamInfo
    from sluice.normalizer.stream import Normalizer
    from sluice.schemas.errors import WorkerError

    info = StreamInfo(
        stream_id=f"{args.request_id}:{args.attempt}",
        request_id=args.request_id,
        provider="",
        dialect=args.dialect,
        attempt=args.attempt,
        model=args.model,
    )
    try:
        norm = Normalizer(args.dialect, info)
    except WorkerError as exc:
        raise CliError(exc.message) from None
    with _open(args.file) as f:
        for chunk in _chunks(f, args.file):
            for ev in norm.feed(chunk, args.ts).events:
                if not args.result:
                    _write(ev)
    for ev in norm.close(args.ts):
        if not args.result:
            _write(ev)
    if args.result:
        _write(norm.result())
    return 0


# -- the parser ----------------------------------------------------------------------------------------------


class _NotAvailable:
    """The run function of a command whose module cannot be imported (e.g. ``relay`` without the extra)."""

    accepts_anything = True  # its real arguments are unknown here

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self, _: argparse.Namespace) -> int:
        raise CliError(f"not available in this installation ({self.why})")


def _load(cmd: Command) -> Loaded | str:
    """The command's configure and run functions, or why they cannot be had."""
    try:
        return cmd.load()
    except ImportError as exc:
        hint = f"; install the {cmd.extra!r} extra: {install_hint(cmd.extra)}" if cmd.extra else ""
        return f"{exc.name or 'its module'} cannot be imported: {exc}{hint}"


def _build(command: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Normalize streaming LLM provider output into one ordered event log on Redis Streams.",
        epilog="Run `sluice COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"sluice {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, cmd in COMMANDS.items():
        p = parsers[name] = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.help,
            epilog=f"examples:\n  {cmd.examples}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if command is not None and name != command:
            continue
        loaded = _load(cmd)
        if isinstance(loaded, str):
            p.set_defaults(func=_NotAvailable(loaded))
            continue
        configure, run = loaded
        configure(p)
        p.set_defaults(func=run)
    return parser, parsers


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments (all, when None)."""
    return _build(command)[0]


def _version() -> str:
    import sluice

    return sluice.__version__


def _command_name(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def _command_errors() -> tuple[type[Exception], ...]:
    errors: list[type[Exception]] = [CliError, UnreadableFile]
    # Imported only if a command that raises them ran (sluice.cli.main twice when run as `python -m sluice.cli.main`).
    for module, name in (
        ("sluice.cli.requests", "CommandError"),
        ("sluice.worker.main", "StartupError"),
        ("sluice.cli.main", "CliError"),
    ):
        mod = sys.modules.get(module)
        if mod is not None:
            errors.append(getattr(mod, name))
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (``sluice.cli.exits``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_name(argv)
    parser, parsers = _build(name)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args.func, "accepts_anything", False):
        # the command's own usage, not the top level's: the options it takes are the ones to show
        parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return Exit.SIGINT
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly; point stdout at /dev/null so the flush
        # at exit does not complain again (the recipe of Python's signal docs).
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    except Exception as exc:
        if isinstance(exc, _command_errors()):
            print(f"sluice {args.command}: {exc}", file=sys.stderr)
            return Exit.USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())

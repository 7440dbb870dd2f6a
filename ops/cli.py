"""The ``sluice`` command: one entry point, one sub-command per operator task.

Rule: every command prints a clear one-line error and exits non-zero on unusable input (missing file,
unknown dialect); a stream that merely ended badly is still processed input and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from normalizer.adapters import DIALECTS
from normalizer.machine import StreamInfo
from normalizer.sse import SSEDecoder, SSELimitExceeded
from normalizer.stream import Normalizer
from schemas.errors import WorkerError

__all__ = ["main"]

_ENC = msgspec.json.Encoder()
_CHUNK = 64 * 1024


class CliError(Exception):
    """A one-line message for the operator; exit status 2."""


def _open(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    p = Path(path)
    if not p.is_file():
        raise CliError(f"no such file: {path}")
    return p.open("rb")


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


def _write(obj: object) -> None:
    sys.stdout.buffer.write(_ENC.encode(obj) + b"\n")


def cmd_frames(args: argparse.Namespace) -> int:
    decoder = SSEDecoder(max_line_bytes=args.max_line_bytes, max_event_bytes=args.max_event_bytes)
    with _open(args.file) as f:
        for chunk in _chunks(f):
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


def cmd_normalize(args: argparse.Namespace) -> int:
    info = StreamInfo(
        stream_id=f"{args.request_id}:{args.attempt}", request_id=args.request_id, provider="",
        dialect=args.dialect, attempt=args.attempt, model=args.model,
    )  # fmt: skip
    try:
        norm = Normalizer(args.dialect, info)
    except WorkerError as exc:
        raise CliError(exc.message) from None
    with _open(args.file) as f:
        for chunk in _chunks(f):
            for ev in norm.feed(chunk, args.ts).events:
                if not args.result:
                    _write(ev)
    for ev in norm.close(args.ts):
        if not args.result:
            _write(ev)
    if args.result:
        _write(norm.result())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Normalize streaming LLM provider output into one ordered event log on Redis Streams.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add(
        sub, "frames", cmd_frames, "decode a raw text/event-stream body into SSE events (one JSON per line)",
        "examples:\n  sluice frames capture.sse\n  curl -N ... | sluice frames -",
    )  # fmt: skip
    p = sub.choices["frames"]
    p.add_argument("file", help="the body to decode, or - for standard input")
    p.add_argument("--max-line-bytes", type=int, default=1 << 20)
    p.add_argument("--max-event-bytes", type=int, default=4 << 20)

    _add(
        sub, "normalize", cmd_normalize,
        "normalize a recorded provider stream into contract events (the end of the file is the end of the "
        "transport)",
        "examples:\n  sluice normalize --dialect anthropic capture.sse\n"
        "  sluice normalize --dialect openai-chat --result capture.sse",
    )  # fmt: skip
    p = sub.choices["normalize"]
    p.add_argument("file", help="the recorded body, or - for standard input")
    p.add_argument("--dialect", required=True, metavar="D", help=f"one of: {', '.join(DIALECTS)}")
    p.add_argument("--result", action="store_true", help="print the assembled result instead of the events")
    p.add_argument("--request-id", default="local", help="request_id stamped on events (default: local)")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--model", default=None, help="the requested model, until the provider names its own")
    p.add_argument("--ts", type=int, default=0, help="the ts stamped on every event (unix ms; default 0)")
    _add_service_commands(sub)
    _add_fake_provider(sub)
    return parser


def _add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ops import cmd_worker as w

    _add(
        sub,
        "worker",
        w.cmd_worker,
        "run a worker: take jobs from Redis, stream them, write the logs",
        "examples:\n  sluice worker --config sluice.toml\n  REDIS_URL=redis://redis:6379 sluice worker -c sluice.toml",
    )
    p = sub.choices["worker"]
    p.add_argument("--config", "-c", default=None, help="TOML config file (default: $SLUICE_CONFIG)")
    p.add_argument("--log-level", default="INFO")

    _add(
        sub,
        "enqueue",
        w.cmd_enqueue,
        "enqueue a job and print its request_id",
        "examples:\n  sluice enqueue job.json\n  sluice enqueue --route anthropic --prompt 'Hello' --follow",
    )
    p = sub.choices["enqueue"]
    p.add_argument("job_file", nargs="?", help="a JSON job file, or - for standard input")
    p.add_argument("--route")
    p.add_argument("--prompt")
    p.add_argument("--model")
    p.add_argument("--request-id")
    p.add_argument("--follow", action="store_true", help="print the normalized events live until the end")
    w.redis_args(p)

    for name, fn, text in (
        ("status", w.cmd_status, "print a request's status record"),
        ("cancel", w.cmd_cancel, "cancel a request: the worker closes the upstream connection"),
    ):
        _add(sub, name, fn, text, f"example:\n  sluice {name} req_0123")
        p = sub.choices[name]
        p.add_argument("request_id")
        w.redis_args(p)

    _add(
        sub,
        "tail",
        w.cmd_tail,
        "follow a request's normalized events (JSON lines) until its terminal",
        "examples:\n  sluice tail req_0123\n  sluice tail req_0123 --after 1-5\n  sluice tail req_0123 --raw",
    )
    p = sub.choices["tail"]
    p.add_argument("request_id")
    p.add_argument("--after", default="0-0", help="resume after this position (<attempt>-<seq>)")
    p.add_argument("--raw", action="store_true", help="print the raw provider events instead")
    p.add_argument("--json", action="store_true", help="JSON lines (the default when not a terminal)")
    w.redis_args(p)


def _add_fake_provider(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ops import fake_provider

    _add(
        sub, "fake-provider", fake_provider.run_from_args,
        "run the local fake provider (all four dialects, synthetic streams and faults) on loopback",
        "examples:\n  SLUICE_FAKE_API_KEY=k sluice fake-provider --port 8089\n"
        "  then route base_url = http://127.0.0.1:8089 and model 'synthetic;deltas=20;pace_ms=50'",
    )  # fmt: skip
    fake_provider.configure_parser(sub.choices["fake-provider"])


def _add(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    func: Callable[[argparse.Namespace], int],
    help_: str,
    epilog: str,
) -> None:
    p = sub.add_parser(
        name,
        help=help_,
        description=help_,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)


def _command_error() -> type[Exception]:
    from ops.cmd_worker import CommandError

    return CommandError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, _command_error()) as exc:
        print(f"sluice {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

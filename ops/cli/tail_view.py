"""How ``sluice tail`` and ``sluice enqueue --follow`` show a request's normalized events.

Rule: one model of the request (its blocks as ``sluice.normalizer.assemble`` folds them, seq, attempt,
elapsed time, terminal) fed event by event, three ways to show it: ``live`` (a terminal: rich renders
open blocks as they grow, prints each finished block above, and keeps a status line), ``plain`` (not a
terminal: text written as it arrives, one bracketed marker line per block and per terminal, no escape
codes) and ``json`` (contract events as JSON lines, byte for byte what the events stream holds). The
view never decides when to stop: the caller feeds it until the request's final terminal event, then
closes it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any, Protocol

import msgspec

from sluice.normalizer.assemble import AssembledBlock, Assembly
from sluice.schemas.events import (
    BlockDelta,
    BlockStart,
    BlockStop,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
    Usage,
    Verdict,
    encode_event,
)

__all__ = ["JsonView", "LiveView", "PlainView", "RequestModel", "View", "feed_all", "make_view"]

_LIVE_REFRESH_PER_SECOND = 8


class View(Protocol):
    def feed(self, ev: Event) -> None: ...

    def close(self) -> None: ...


# -- the model ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestModel:
    """What all three views know about the request so far."""

    request_id: str = ""
    attempt: int = 0
    seq: int = 0
    events: int = 0
    provider: str = ""
    dialect: str = ""
    model: str | None = None
    first_ts: int | None = None
    last_ts: int | None = None
    fold: Assembly = field(default_factory=Assembly)  # the current attempt's blocks and terminal
    warnings: list[StreamWarning] = field(default_factory=list)

    def apply(self, ev: Event) -> AssembledBlock | None:
        """Record one event; returns the block it touched, if any. A block whose start was not seen
        (joined mid-stream with --after) starts where its first event is: the view shows what arrives."""
        self.events += 1
        self.seq = ev.seq
        self.request_id = ev.request_id
        self.last_ts = ev.ts
        if isinstance(ev, StreamStart):  # a new attempt follows a retryable failure: the fold starts over
            self.attempt, self.provider, self.dialect, self.model = ev.attempt, ev.provider, ev.dialect, ev.model
            if self.first_ts is None:
                self.first_ts = ev.ts
        elif isinstance(ev, StreamWarning):
            self.warnings.append(ev)
        return self.fold.apply(ev)

    @property
    def terminal(self) -> StreamDone | StreamError | None:
        return self.fold.terminal

    @property
    def blocks(self) -> dict[tuple[int, int], AssembledBlock]:
        """The current attempt's blocks by (attempt, index)."""
        return {(self.attempt, i): b for i, b in self.fold.blocks.items()}

    def elapsed(self) -> float:
        """Seconds from the first stream.start to the terminal, or to the latest event while streaming
        (event times, so a request tailed long after it ran shows its own duration)."""
        if self.first_ts is None:
            return 0.0
        end = self.terminal.ts if self.terminal is not None else self.last_ts
        return max(0.0, ((end or self.first_ts) - self.first_ts) / 1000)

    def open_blocks(self) -> list[AssembledBlock]:
        if self.terminal is not None:
            return []
        return [b for b in self.fold.blocks.values() if not b.closed]


def _usage(u: Usage | None) -> str:
    if u is None:
        return ""
    parts = [
        f"{k.removesuffix('_tokens')} {v}"
        for k, v in msgspec.structs.asdict(u).items()
        if v is not None and v is not msgspec.UNSET and k != "provider_cost"
    ]
    return " · tokens " + ", ".join(parts) if parts else ""


def verdict_text(verdict: Verdict) -> str:
    """A verdict in one line (contract 1.3): ``valid``, or the reason and each listed error, where it is."""
    if verdict.valid:
        return "valid"
    errors = "; ".join(
        f"{e.pointer or '/'} {e.keyword}: {e.message}" if e.keyword else e.message for e in verdict.errors
    )
    more = "; …" if verdict.more_errors else ""
    return f"invalid ({verdict.reason}): {errors}{more}"


def _checked(m: RequestModel, t: StreamDone | StreamError) -> str:
    """`` · 1 invalid call · answer valid``: what the attempt's checks concluded, when it was checked."""
    verdicts = [b.verdict for b in m.fold.blocks.values() if b.verdict is not None]
    said = ""
    if verdicts:
        invalid = sum(not v.valid for v in verdicts)
        said += f" · {invalid} invalid call{'' if invalid == 1 else 's'}"
    if not isinstance(t.answer, msgspec.UnsetType):
        said += f" · answer {'valid' if t.answer.valid else 'invalid'}"
    return said


def terminal_summary(m: RequestModel) -> str:
    """One line: status, reason, seq, attempt, elapsed (the plain view's last line, the live status), and
    what the output checks concluded."""
    t = m.terminal
    where = f"seq {m.seq} · attempt {m.attempt} · {m.elapsed():.2f}s"
    if isinstance(t, StreamDone):
        return f"completed: {t.stop_reason} · {where}{_usage(t.usage)}{_checked(m, t)}"
    if isinstance(t, StreamError):
        code = f" ({t.error.provider_code})" if t.error.provider_code else ""
        retry = " · retryable" if t.error.retryable else ""
        return f"{t.status}: {t.error.category}{code} · {t.error.message} · {where}{retry}{_checked(m, t)}"
    return f"streaming · {where}"


# -- json ------------------------------------------------------------------------------------------------


class JsonView:
    """Contract events as JSON lines, flushed one by one (a pipe reader sees each at once)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout

    def feed(self, ev: Event) -> None:
        line = encode_event(ev) + b"\n"
        buffer = getattr(self.out, "buffer", None)
        if buffer is not None:
            self.out.flush()
            buffer.write(line)
            buffer.flush()
        else:
            self.out.write(line.decode())
        self.out.flush()

    def close(self) -> None:
        self.out.flush()


# -- plain -----------------------------------------------------------------------------------------------


def _marker(blk: AssembledBlock, *, cont: bool = False) -> str:
    label: str = blk.kind
    if blk.kind == "tool_call":
        label += f" {blk.name or '?'}" + (f" · {blk.call_id}" if blk.call_id else "")
    return f"[{label}{', continued' if cont else ''}]"


class PlainView:
    """No escape codes: text as it arrives under one marker line per block, e.g.::

    [attempt 1 · anthropic (anthropic) · model claude-x]
    [reasoning]
    Let me think.
    [text]
    Hello, world.
    [tool_call get_weather · toolu_1]
    {"city": "Paris"}
    [completed: tool_use · seq 14 · attempt 1 · 0.42s · tokens input 12, output 40]
    """

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.model = RequestModel()
        self._inline: tuple[int, int] | None = None  # the block whose text the cursor follows
        self._at_line_start = True

    def _write(self, s: str) -> None:
        if s:
            self.out.write(s)
            self._at_line_start = s.endswith("\n")

    def _line(self, s: str) -> None:
        if not self._at_line_start:
            self._write("\n")
        self._write(s + "\n")

    def feed(self, ev: Event) -> None:
        m = self.model
        blk = m.apply(ev)
        if isinstance(ev, StreamStart):
            self._inline = None
            model = f" · model {ev.model}" if ev.model else ""
            self._line(f"[attempt {ev.attempt} · {ev.provider} ({ev.dialect}){model}]")
        elif isinstance(ev, BlockStart) and blk is not None:
            self._line(_marker(blk))
            self._inline = (m.attempt, blk.index)
        elif isinstance(ev, BlockDelta) and blk is not None and ev.delta.kind != "signature":
            key = (m.attempt, blk.index)
            if self._inline != key:
                self._line(_marker(blk, cont=True))
                self._inline = key
            self._write(ev.delta.text)
        elif isinstance(ev, BlockStop) and blk is not None:
            if self._inline == (m.attempt, blk.index) and not self._at_line_start:
                self._write("\n")
            if isinstance(ev.verdict, Verdict):
                self._line(f"[verdict: {verdict_text(ev.verdict)}]")
        elif isinstance(ev, StreamWarning):
            self._line(f"[warning {ev.code}: {ev.message}]")
        elif isinstance(ev, StreamDone | StreamError):
            self._line(f"[{terminal_summary(m)}]")
            self._inline = None
        self.out.flush()

    def close(self) -> None:
        if not self._at_line_start:
            self._write("\n")
        self.out.flush()


# -- live (rich) -------------------------------------------------------------------------------------------


class LiveView:
    """A terminal view: finished blocks are printed once (they scroll up like any output), open blocks
    are redrawn as they grow (cut to their last lines so the live region always fits the screen), and a
    status line shows seq, attempt, elapsed time and, at the end, the terminal status."""

    def __init__(self, console: Any = None, *, refresh_per_second: float = _LIVE_REFRESH_PER_SECOND) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = console if console is not None else Console()
        self.model = RequestModel()
        self._lock = threading.Lock()
        self._last_feed: float | None = None
        self._live = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=refresh_per_second,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._started = False

    def __enter__(self) -> LiveView:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        if not self._started:
            self._live.start()
            self._started = True

    def feed(self, ev: Event) -> None:
        self.start()
        with self._lock:
            blk = self.model.apply(ev)
            self._last_feed = time.monotonic()
            done = blk if (blk is not None and blk.closed) else None
        if isinstance(ev, StreamStart):
            self._print(self._start_line(ev))
        elif done is not None:
            self._print(self._block(done, full=True))
            self._print("")  # a blank line between blocks
        elif isinstance(ev, StreamWarning):
            self._print(self._warning(ev))
        elif isinstance(ev, StreamDone | StreamError):
            # Blocks a failure left open are shown as they stood (the machine never fakes a block.stop).
            for b in self.model.fold.blocks.values():
                if not b.closed:
                    self._print(self._block(b, full=True, cut=True))
                    self._print("")
            self._print(self._status())
        self._live.refresh()

    def close(self) -> None:
        if self._started:
            self._live.update("", refresh=True)
            self._live.stop()
            self._started = False

    # rendering --------------------------------------------------------------------------------------

    def _print(self, renderable: Any) -> None:
        self._live.console.print(renderable)

    def _start_line(self, ev: StreamStart) -> Any:
        from rich.rule import Rule

        model = f" · {ev.model}" if ev.model else ""
        return Rule(f"{ev.request_id} · attempt {ev.attempt} · {ev.provider} ({ev.dialect}){model}", style="dim")

    def _warning(self, ev: StreamWarning) -> Any:
        from rich.text import Text

        return Text(f"⚠ {ev.code}: {ev.message}", style="yellow")

    def _block(self, blk: AssembledBlock, *, full: bool, max_lines: int | None = None, cut: bool = False) -> Any:
        from rich.console import Group
        from rich.text import Text

        body_style = {"reasoning": "dim italic", "refusal": "red", "tool_call": "cyan"}.get(blk.kind, "")
        if blk.kind == "reasoning":
            head = Text("thinking" + (" (signed)" if blk.signature_parts else ""), style="dim bold")
        elif blk.kind == "refusal":
            head = Text("⛔ refusal", style="bold red")
        elif blk.kind == "tool_call":
            head = Text.assemble(("⚙ ", "cyan"), (blk.name or "?", "bold cyan"), (f"  {blk.call_id or ''}", "dim"))
        else:
            head = None
        content = blk.text
        if blk.kind == "tool_call" and blk.arguments is not None:
            content = msgspec.json.format(msgspec.json.encode(blk.arguments), indent=2).decode()
        body = Text(content, style=body_style)
        if blk.verdict is not None:
            body.append(f"\n{verdict_text(blk.verdict)}", style="green" if blk.verdict.valid else "bold red")
        if cut:
            body.append("  [cut off]", style="bold red")
        if not full and max_lines is not None:
            width = max(10, self.console.width)
            lines = body.wrap(self.console, width)
            if len(lines) > max_lines:
                body = Text("…\n", style="dim") + Text("\n").join(lines[-max_lines:])
        parts = [p for p in (head, body) if p is not None]
        return Group(*parts)

    def _status(self) -> Any:
        from rich.text import Text

        m = self.model
        t = m.terminal
        if isinstance(t, StreamDone):
            return Text("✓ " + terminal_summary(m), style="bold green")
        if isinstance(t, StreamError):
            style = "bold red" if t.status == "failed" else "bold yellow"
            return Text(("✗ " if t.status == "failed" else "■ ") + terminal_summary(m), style=style)
        # Plus the time since the latest event arrived here, so the clock keeps running while waiting.
        waiting = time.monotonic() - self._last_feed if self._last_feed is not None else 0.0
        where = f"seq {m.seq} · attempt {m.attempt or '-'} · {m.elapsed() + waiting:.1f}s"
        return Text(f"● streaming · {where}" if m.events else "● waiting for the first event", style="bold blue")

    def _render(self) -> Any:
        from rich.console import Group

        with self._lock:
            if self.model.terminal is not None:
                return Group()
            open_blocks = self.model.open_blocks()
            room = max(3, (self.console.height or 24) - 2)
            per = max(2, room // max(1, len(open_blocks)) - 1)
            parts = [self._block(b, full=False, max_lines=per) for b in open_blocks]
            return Group(*parts, self._status())


# -- choosing and driving ---------------------------------------------------------------------------------


def make_view(mode: str = "auto", *, out: IO[str] | None = None) -> View:
    """``json``, ``plain``, ``live``, or ``auto`` (live on a terminal, plain otherwise)."""
    stream = out if out is not None else sys.stdout
    if mode == "json":
        return JsonView(stream)
    if mode == "auto":
        mode = "live" if stream.isatty() else "plain"
    if mode == "live":
        from rich.console import Console

        return LiveView(Console(file=stream))
    return PlainView(stream)


async def feed_all(events: AsyncIterator[Event], view: View) -> RequestModel | None:
    """Feed every event the iterator yields, close the view (also on error or cancel)."""
    try:
        async for ev in events:
            view.feed(ev)
    finally:
        view.close()
    return getattr(view, "model", None)

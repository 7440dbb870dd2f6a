"""One attempt's appends, in order, one in flight at a time.

Rule: ``send`` writes a batch on the append connection to the request's master and returns at once; the
reply of that batch is settled by the next ``send`` (or by ``drain`` at the attempt's end), usually
answered by then: no wait. So the reader never waits a round trip per event, a busy stream's
next batch holds everything that arrived meanwhile, and an idle stream's event goes at once. A batch whose
seqs are taken is stored whole even when the attempt is cancelled meanwhile. When Redis stays away past
the outage limit, the upstream is cancelled and this batch and every later one are held, then stored in
order once Redis is back (``drain``; appends are idempotent).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import anyio

from sluice.schemas.errors import StorageError
from sluice.worker.append.log import PendingBatch, RequestLog

__all__ = ["AttemptStore", "Cancellable"]

log = logging.getLogger("sluice.worker")


class Cancellable(Protocol):
    """What the store cancels when Redis stays away: the running request (``pipeline.context.InFlight``)."""

    request_id: str

    def cancel(self, reason: str, category: str = ...) -> None: ...


class AttemptStore:
    """One attempt's ordered appends (the module docstring says how)."""

    def __init__(self, rlog: RequestLog, attempt: int, handle: Cancellable) -> None:
        self.rlog = rlog
        self.attempt = attempt
        self.handle = handle
        self.held: list[PendingBatch] = []
        self._sent: tuple[asyncio.Future[Any], PendingBatch] | None = None

    async def send(self, batch: PendingBatch) -> None:
        """Settle the reply of the batch sent before, then send this one without waiting for its reply
        (``drain`` settles the last). Raises ``Fenced``, ``LogLost``."""
        if self._sent is not None:
            try:
                await self._settle()
            except anyio.get_cancelled_exc_class():
                await self._resend_shielded(batch)  # its seqs are taken: stored after the one in flight
                raise
        if self.held:
            self.held.append(batch)  # never overtakes a held batch
            return
        fut = self.rlog.send_append(self.attempt, batch)
        if fut is not None:
            self._sent = (fut, batch)
            return
        await self._append(batch)  # no connection to send on yet: the waiting path connects

    async def _settle(self) -> None:
        """The sent batch's reply: checked, or on any error stored again the waiting way (idempotent)."""
        assert self._sent is not None
        fut, batch = self._sent
        self._sent = None
        try:
            res = fut.result() if fut.done() else await fut
        except anyio.get_cancelled_exc_class():
            await self._resend_shielded(batch)
            raise
        except Exception:  # broken connection, overdue reply, unknown script: the waiting path decides
            await self._append(batch, again=True)
            return
        self.rlog.check_append(res, self.attempt, batch)

    async def _append(self, batch: PendingBatch, *, again: bool = False) -> None:
        try:
            await self._append_or_hold(batch, again=again)
        except anyio.get_cancelled_exc_class():
            await self._resend_shielded(batch)
            raise

    async def _resend_shielded(self, batch: PendingBatch) -> None:
        """Cancelled while the append was in flight: it may or may not have landed. Sent again under a
        shield (appends are idempotent), so the batch is stored whole before the cancel goes on."""
        with anyio.CancelScope(shield=True):
            await self._append_or_hold(batch)

    async def _append_or_hold(self, batch: PendingBatch, *, again: bool = False) -> None:
        if self.held:
            self.held.append(batch)  # never overtakes a held batch
            return
        try:
            if again:
                await self.rlog.append_again(self.attempt, batch)
            else:
                await self.rlog.append(self.attempt, batch)
        except StorageError:
            self._hold(batch)

    def _hold(self, batch: PendingBatch) -> None:
        self.handle.cancel("Redis was unavailable past the outage limit; the upstream was cancelled", "transport")
        log.error("Redis unavailable; holding the batch", extra={"request_id": self.handle.request_id})
        self.held.append(batch)

    async def drain(self) -> None:
        """Settle the sent batch, then store the held ones, retrying until Redis answers. Raises ``Fenced``."""
        with anyio.CancelScope(shield=True):
            if self._sent is not None:
                await self._settle()
            while self.held:
                try:
                    await self.rlog.append(self.attempt, self.held[0])
                    self.held.pop(0)
                except StorageError:
                    await anyio.sleep(1.0)

    def abandon(self) -> None:
        """The attempt ends without ``drain`` (fenced): the sent batch's reply is no one's business now."""
        if self._sent is not None:
            fut = self._sent[0]
            self._sent = None
            fut.add_done_callback(_consume)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not log it as never retrieved

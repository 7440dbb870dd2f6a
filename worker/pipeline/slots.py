"""A worker's run slots: ``max_in_flight`` of them, each held by one running job.

Rule: a job runs only in a slot it holds. A limited route's job is admitted only into a slot taken for it
before the capacity call that admits it (``take``, never waiting), so an admission never waits for a slot
and a route's in-flight count is the streams its workers run; a slot taken for a call that admitted nothing
is given back at once. Other jobs wait for a slot (``acquire``).
"""

from __future__ import annotations

import anyio

__all__ = ["RunSlots"]


class RunSlots:
    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._freed = anyio.Event()

    @property
    def free(self) -> int:
        return self.total - self.used

    def take(self, n: int) -> int:
        """Up to ``n`` free slots, now; how many were taken."""
        k = max(0, min(n, self.free))
        self.used += k
        return k

    def give(self, n: int) -> None:
        if n <= 0:
            return
        if n > self.used:
            raise RuntimeError(f"giving back {n} run slots with {self.used} taken")
        self.used -= n
        self._freed.set()
        self._freed = anyio.Event()

    async def acquire(self) -> None:
        """One slot, waiting for it."""
        while self.take(1) == 0:
            await self._freed.wait()

"""The admission discipline of a limited route, as a pure model: strict priority between the classes, deficit
round robin over the tenants of a class, per-tenant caps (docs/design-capacity.md B.5).

Rule: this is the specification the Lua of ``sluice.worker.capacity.scripts`` implements (its tests run
both on the same inputs and compare every choice); it does no IO and reads no clock. The route's limits are
reduced to one concurrency cap (the windows and the cooldown refuse everybody alike, so they never change
whose turn it is, only when it comes):

- ``offer`` admits at once only when no job of its class or above waits (no queue to jump), the cap has room
  and its tenant is below its cap; else it parks the job at the end of its tenant's FIFO queue, and a tenant
  that had nothing waiting joins the end of its class's ring.
- ``admit(n)`` serves the interactive ring, then the batch ring (batch only while no interactive job is
  admissible). The ring's head tenant starts a turn with a quantum of ``weight`` admissions (no credit past
  one turn); a turn cut short by ``n`` or by the cap goes on at the next call, the tenant staying at the head.
  A tenant at its cap forfeits its turn and goes to the tail. A tenant whose queue empties leaves the ring.
- ``release`` ends a job's custody: one place of the cap and of its tenant's count frees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sluice.schemas.keys import PRIORITIES, Priority

__all__ = ["Discipline", "TenantShare"]


@dataclass(frozen=True, slots=True)
class TenantShare:
    weight: int = 1
    max_concurrency: int = 0  # 0: no cap


@dataclass(slots=True)
class Discipline:
    max_concurrency: int = 0  # 0: no cap
    tenants: dict[str, TenantShare] = field(default_factory=dict)  # "*": the default
    waiting: dict[Priority, dict[str, list[tuple[int, str]]]] = field(
        default_factory=lambda: {p: {} for p in PRIORITIES}
    )
    rings: dict[Priority, deque[str]] = field(default_factory=lambda: {p: deque() for p in PRIORITIES})
    deficit: dict[tuple[Priority, str], int] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    per_tenant: dict[str, int] = field(default_factory=dict)

    def share(self, tenant: str) -> TenantShare:
        return self.tenants.get(tenant) or self.tenants.get("*") or TenantShare()

    def _full(self) -> bool:
        return self.max_concurrency > 0 and len(self.held) >= self.max_concurrency

    def capped(self, tenant: str) -> bool:
        cap = self.share(tenant).max_concurrency
        return cap > 0 and self.per_tenant.get(tenant, 0) >= cap

    def _hold(self, rid: str, tenant: str) -> None:
        self.held[rid] = tenant
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1

    def offer(self, rid: str, tenant: str, priority: Priority, queued_at: int) -> str:
        """``admitted`` or ``parked``."""
        ahead = sum(len(q) for q in self.waiting["interactive"].values())
        if priority == "batch":
            ahead += sum(len(q) for q in self.waiting["batch"].values())
        if not self._full() and not self.capped(tenant) and ahead == 0:
            self._hold(rid, tenant)
            return "admitted"
        queue = self.waiting[priority].setdefault(tenant, [])
        if not queue:
            self.rings[priority].append(tenant)
        queue.append((queued_at, rid))
        queue.sort()  # the Lua's members order by (queued_at, request id) within a tenant
        return "parked"

    def admit(self, n: int) -> list[str]:
        """Up to ``n`` request ids, in the order the discipline admits them."""
        got: list[str] = []
        for prio in PRIORITIES:
            ring, queues = self.rings[prio], self.waiting[prio]
            visits = 0
            while len(got) < n and ring and visits <= len(ring) + n:
                visits += 1
                t = ring[0]
                if self.capped(t):
                    self.deficit.pop((prio, t), None)
                    ring.rotate(-1)
                    continue
                d = self.deficit.get((prio, t), 0)
                if d < 1:
                    d = self.share(t).weight
                capped = False
                while d >= 1 and len(got) < n and queues[t]:
                    if self._full():
                        self.deficit[(prio, t)] = d
                        return got
                    _, rid = queues[t].pop(0)
                    self._hold(rid, t)
                    got.append(rid)
                    d -= 1
                    if self.capped(t):
                        capped = True
                        break
                if not queues[t]:
                    del queues[t]
                    self.deficit.pop((prio, t), None)
                    ring.popleft()
                elif d < 1 or capped:
                    self.deficit.pop((prio, t), None)
                    ring.rotate(-1)
                else:
                    self.deficit[(prio, t)] = d
        return got

    def release(self, rid: str) -> None:
        tenant = self.held.pop(rid)
        self.per_tenant[tenant] -= 1

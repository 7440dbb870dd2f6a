"""Fallback routes: which route a claim's next attempt goes to, and which model it asks for there.

Rule: a route's ``fallbacks`` (or a job's own list, which replaces the route's) are tried in order, each
at most once per claim, and only right after an attempt that failed before anything was visible with an
availability category: ``overloaded``, ``rate_limit``, ``server_error``, or ``transport`` / ``timeout``
before the first byte of the response body. Never after a visible delta, never for any other category
(``invalid_request``, ``authentication``, ``permission``, ``not_found``, ``billing``, ``limit_exceeded``
...). A hop goes at once (the failed route is busy, waiting would only delay the answer); once the chain
is used up, the retry policy resumes on the job's own route. A claim makes at most
``retry.max_attempts + len(chain)`` attempts.

The model: the job's ``model`` (else its route's) on the job's own route; on a fallback route that route's
configured ``model``, else the job's model when the two routes share a dialect (the same API, e.g. a second
account). A fallback of another dialect without a ``model`` is refused: at start for a route's list
(``check_fallbacks``), per job for a job's list (``job_fallback_problem``).

Pure: no IO, no clock. The worker's attempt loop (``sluice.worker.pipeline.attempts``) drives a ``FallbackChain``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.schemas.errors import ConfigError

if TYPE_CHECKING:
    from sluice.worker.config import Route

__all__ = [
    "AVAILABILITY_CATEGORIES",
    "BEFORE_FIRST_BYTE_CATEGORIES",
    "FallbackChain",
    "check_fallbacks",
    "falls_back",
    "job_fallback_problem",
    "model_for",
]

# Provider-reported "not now": another provider may well answer.
AVAILABILITY_CATEGORIES = frozenset({"overloaded", "rate_limit", "server_error"})
# Sluice's own categories that say the provider did not answer at all, when not a byte of the body came.
BEFORE_FIRST_BYTE_CATEGORIES = frozenset({"transport", "timeout"})


def falls_back(category: str, *, visible: bool, received: bool) -> bool:
    """Whether an attempt that failed with ``category`` may hop to the next route: nothing was visible
    (no ``block.delta``) and, for ``transport`` / ``timeout``, no byte of the response body arrived."""
    if visible:
        return False
    if category in AVAILABILITY_CATEGORIES:
        return True
    return category in BEFORE_FIRST_BYTE_CATEGORIES and not received


@dataclass(slots=True)
class FallbackChain:
    """One claim's fallback routes, consumed in order. ``home`` is the job's own route."""

    home: str
    routes: tuple[str, ...]
    used: int = 0  # fallback routes handed out so far (each is one attempt of the claim)
    tried: list[str] = field(default_factory=list)  # the route of every attempt of the request, in order

    @property
    def home_attempts(self) -> int:
        """Attempts on the job's own route so far: what ``retry.max_attempts`` bounds."""
        return sum(1 for r in self.tried if r == self.home)

    def next_route(self) -> str | None:
        """Hand out the next fallback route (consumed), or None when the chain is used up. The hook for
        any reason to skip a route: a failed attempt (``after``), or a route found in cooldown at admission."""
        if self.used >= len(self.routes):
            return None
        self.used += 1
        return self.routes[self.used - 1]

    def after(self, category: str | None, *, visible: bool, received: bool) -> str | None:
        """The route of the next attempt if the one that just ended (``category``: its error's, None when
        it did not fail) earns a hop to a fallback, else None (the retry policy decides, on ``home``)."""
        if category is None or not falls_back(category, visible=visible, received=received):
            return None
        return self.next_route()


def model_for(home: Route, job_model: str | None, route: Route, *, is_home: bool) -> str:
    """The model an attempt on ``route`` asks for (the module's rule); "" when none is known."""
    if is_home:
        return job_model or home.model or ""
    if route.model:
        return route.model
    return (job_model or home.model or "") if route.dialect == home.dialect else ""


def _model_problem(home: Route, name: str, route: Route) -> str | None:
    if route.model or route.dialect == home.dialect:
        return None
    return f"route {name!r} ({route.dialect}) has no model; a fallback to another dialect needs routes.{name}.model"


def check_fallbacks(routes: Mapping[str, Route]) -> None:
    """Refuse, in one line naming the key, a ``fallbacks`` entry naming an unknown route, a cycle (found by
    a depth-first search; a route naming itself is one), or a route of another dialect without a model.
    Raises ``ConfigError``."""
    for name, route in routes.items():
        for fb in route.fallbacks:
            if fb not in routes:
                raise ConfigError(f"routes.{name}.fallbacks: unknown route {fb!r}")
            if (problem := _model_problem(route, fb, routes[fb])) is not None:
                raise ConfigError(f"routes.{name}.fallbacks: {problem}")
    graph = {name: tuple(route.fallbacks) for name, route in routes.items()}
    if (cycle := _find_cycle(graph)) is not None:
        raise ConfigError(f"routes.{cycle[0]}.fallbacks: a cycle {' -> '.join(cycle)}")


def _find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
    """The first cycle a depth-first search meets, as the path that closes it (``a -> b -> a``)."""
    done: set[str] = set()
    for start in graph:
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        # one iterator per node on the path: the successors still to visit
        stack = [iter(graph[start])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(graph[nxt]))
    return None


def job_fallback_problem(routes: Mapping[str, Route], home: str, fallbacks: Sequence[str]) -> str | None:
    """Why a job's own ``fallbacks`` cannot run (a route not configured, a route of another dialect
    without a model), or None. The job is then failed ``invalid_request`` and dead-lettered."""
    for fb in fallbacks:
        if fb not in routes:
            return f"invalid job: fallbacks names an unknown route {fb!r}"
        if fb == home:
            return f"invalid job: fallbacks names the job's own route {fb!r}"
        if (problem := _model_problem(routes[home], fb, routes[fb])) is not None:
            return f"invalid job: fallbacks: {problem}"
    return None

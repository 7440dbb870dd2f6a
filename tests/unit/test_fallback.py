"""Fallback routes, the pure part (sluice.worker.capacity.fallback): when an attempt hops, the chain's order, the
model a fallback asks for, and the refusals at start (each message exact) and per job."""

from __future__ import annotations

import graphlib
import itertools
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.schemas.errors import ConfigError
from sluice.schemas.events import ERROR_CATEGORIES, StreamStart, decode_event, encode_event
from sluice.schemas.jobs import decode_job
from sluice.schemas.status import Status
from sluice.worker.capacity.fallback import FallbackChain, check_fallbacks, falls_back, job_fallback_problem, model_for
from sluice.worker.config import Route, load_config

HOPS_ANY_TIME = {"overloaded", "rate_limit", "server_error"}
HOPS_BEFORE_FIRST_BYTE = {"transport", "timeout"}


def test_which_categories_hop() -> None:
    for category in ERROR_CATEGORIES:
        # nothing visible, nothing received: the availability categories and the two "no answer" ones
        assert falls_back(category, visible=False, received=False) == (
            category in HOPS_ANY_TIME | HOPS_BEFORE_FIRST_BYTE
        ), category
        # bytes came, no delta: a transport / timeout is no longer "the provider did not answer"
        assert falls_back(category, visible=False, received=True) == (category in HOPS_ANY_TIME), category
        # after a visible delta: never
        assert not falls_back(category, visible=True, received=True), category
    for never in ("invalid_request", "authentication", "permission", "not_found", "billing", "limit_exceeded"):
        assert not falls_back(never, visible=False, received=False)


def test_the_chain_is_handed_out_in_order_once() -> None:
    chain = FallbackChain("claude", ("gpt", "gemini"))
    assert chain.after("authentication", visible=False, received=False) is None
    assert chain.used == 0  # a refusal does not use up a fallback
    assert chain.after(None, visible=False, received=False) is None
    assert chain.after("overloaded", visible=False, received=False) == "gpt"
    assert chain.after("rate_limit", visible=True, received=True) is None
    assert chain.after("timeout", visible=False, received=False) == "gemini"
    assert chain.after("overloaded", visible=False, received=False) is None  # used up
    assert chain.next_route() is None and chain.used == 2


def test_home_attempts_count_only_the_jobs_own_route() -> None:
    chain = FallbackChain("claude", ("gpt",), tried=["claude", "gpt", "claude"])
    assert chain.home_attempts == 2


@given(st.lists(st.sampled_from(ERROR_CATEGORIES), max_size=8), st.integers(0, 4))
def test_a_chain_never_hands_out_more_than_its_routes(categories: list[str], n: int) -> None:
    routes = tuple(f"r{i}" for i in range(n))
    chain = FallbackChain("home", routes)
    handed = [r for c in categories if (r := chain.after(c, visible=False, received=False)) is not None]
    assert handed == list(routes[: len(handed)])
    assert chain.used == len(handed) <= n


def _route(dialect: str, model: str | None = None, fallbacks: tuple[str, ...] = ()) -> Route:
    return Route(dialect=dialect, base_url="http://x", model=model, fallbacks=list(fallbacks))


def test_the_model_rule() -> None:
    home = _route("anthropic", "claude-default")
    # the job's own route: the job's model, else the route's
    assert model_for(home, "claude-x", home, is_home=True) == "claude-x"
    assert model_for(home, None, home, is_home=True) == "claude-default"
    # a fallback: its own model, whatever the job asked for
    assert model_for(home, "claude-x", _route("openai-chat", "gpt-4o"), is_home=False) == "gpt-4o"
    # a fallback of the same dialect without a model: the job's (the same API, e.g. a second account)
    assert model_for(home, "claude-x", _route("anthropic"), is_home=False) == "claude-x"
    assert model_for(home, None, _route("anthropic"), is_home=False) == "claude-default"


def _load(tmp_path: Path, routes: str) -> None:
    p = tmp_path / "sluice.toml"
    p.write_text(routes)
    load_config(p, env={})


def _toml(**fallbacks: list[str]) -> str:
    out = []
    for name, fb in fallbacks.items():
        dialect = "anthropic" if name == "claude" else "openai-chat"
        out.append(
            f'[routes.{name}]\ndialect = "{dialect}"\nbase_url = "http://x"\nmodel = "m"\n'
            f"fallbacks = {msgspec.json.encode(fb).decode()}\n"
        )
    return "\n".join(out)


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ({"claude": ["gtp"], "gpt": []}, "routes.claude.fallbacks: unknown route 'gtp'"),
        ({"a": ["b"], "b": ["a"]}, "routes.a.fallbacks: a cycle a -> b -> a"),
        ({"a": ["a"]}, "routes.a.fallbacks: a cycle a -> a"),
        ({"a": ["b"], "b": ["c"], "c": ["b"]}, "routes.b.fallbacks: a cycle b -> c -> b"),
    ],
)
def test_refused_at_start(tmp_path: Path, routes: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, _toml(**routes))
    assert str(exc.value) == message


def test_a_fallback_of_another_dialect_needs_a_model(tmp_path: Path) -> None:
    text = """
[routes.claude]
dialect = "anthropic"
base_url = "http://x"
fallbacks = ["gpt"]
[routes.gpt]
dialect = "openai-chat"
base_url = "http://x"
"""
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text)
    assert str(exc.value) == (
        "routes.claude.fallbacks: route 'gpt' (openai-chat) has no model; "
        "a fallback to another dialect needs routes.gpt.model"
    )
    _load(tmp_path, text.replace('dialect = "openai-chat"', 'dialect = "anthropic"'))  # same dialect: fine


def test_accepted_chains(tmp_path: Path) -> None:
    # a diamond is no cycle; fallbacks of fallbacks are allowed (each route's list is its own)
    _load(tmp_path, _toml(claude=["a", "b"], a=["b"], b=[]))


@given(st.dictionaries(st.sampled_from("abcde"), st.lists(st.sampled_from("abcde"), max_size=3), min_size=1))
def test_a_cycle_is_refused_exactly_when_the_graph_has_one(graph: dict[str, list[str]]) -> None:
    routes = {name: _route("anthropic", "m", tuple(fb for fb in fbs if fb in graph)) for name, fbs in graph.items()}
    try:
        graphlib.TopologicalSorter({n: r.fallbacks for n, r in routes.items()}).prepare()
        acyclic = True
    except graphlib.CycleError:
        acyclic = False
    try:
        check_fallbacks(routes)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    assert (refused is None) == acyclic
    if refused is not None:
        # the message names a real cycle, closed: routes.X.fallbacks: a cycle X -> ... -> X
        head, _, path = refused.partition(": a cycle ")
        nodes = path.split(" -> ")
        assert head == f"routes.{nodes[0]}.fallbacks" and nodes[0] == nodes[-1]
        assert all(b in routes[a].fallbacks for a, b in itertools.pairwise(nodes))


def test_a_jobs_fallbacks() -> None:
    routes = {"claude": _route("anthropic", "m"), "gpt": _route("openai-chat", "g"), "bare": _route("gemini")}
    assert job_fallback_problem(routes, "claude", ["gpt"]) is None
    assert job_fallback_problem(routes, "claude", ["gtp"]) == "invalid job: fallbacks names an unknown route 'gtp'"
    assert job_fallback_problem(routes, "claude", ["claude"]) == (
        "invalid job: fallbacks names the job's own route 'claude'"
    )
    assert job_fallback_problem(routes, "claude", ["bare"]) == (
        "invalid job: fallbacks: route 'bare' (gemini) has no model; "
        "a fallback to another dialect needs routes.bare.model"
    )
    request = b'"request": {"messages": [{"role": "user", "content": "x"}]}'
    assert decode_job(b'{"route": "claude", "fallbacks": ["gpt"], ' + request + b"}").fallbacks == ["gpt"]
    assert decode_job(b'{"route": "claude", ' + request + b"}").fallbacks is None  # the route's list


def test_stream_start_names_its_route_and_stays_1_1_without_one() -> None:
    common = {"stream_id": "r:1", "request_id": "r", "seq": 1, "ts": 0, "provider": "p", "dialect": "anthropic"}
    bare = StreamStart(**common, model=None, attempt=1)  # type: ignore[arg-type]
    assert b"route" not in encode_event(bare)  # what contract 1.1 wrote, byte for byte
    named = StreamStart(**common, model=None, attempt=1, route="claude")  # type: ignore[arg-type]
    assert encode_event(named).endswith(b',"attempt":1,"route":"claude"}')
    assert decode_event(encode_event(named)) == named
    assert (decode_event(encode_event(bare)).route or "") == ""


def test_the_status_record_reads_the_routes() -> None:
    record = {"request_id": "r", "state": "completed", "route": "claude", "attempt_route": "gpt"}
    st_ = Status.from_record(record | {"routes_tried": '["claude","gpt"]'})
    assert (st_.route, st_.attempt_route, st_.routes_tried) == ("claude", "gpt", ["claude", "gpt"])
    old = Status.from_record({"request_id": "r", "state": "completed", "route": "claude"})
    assert (old.attempt_route, old.routes_tried) == ("", [])

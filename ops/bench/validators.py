"""``sluice bench validators``: the JSON Schema validators a tool call's verdict could use, compared on real tool
schemas, and the verdict as sluice computes it.

Rule: every candidate validates the same instances against the same schemas in the same run, in interleaved
rounds (each round in a new order), and the table shows each cost's median over the rounds with the lowest and
highest round (the interval); nothing is asserted about speed. The candidates: jsonschema-rs (sluice's
choice, ``offline``), python-jsonschema (the reference implementation, with a registry that retrieves
nothing) and fastjsonschema (code generation; drafts 4, 6 and 7 only, the first error only). Each is also held
to the reference on every instance (valid or not), so a fast answer that is wrong shows as such. The schemas
are the shapes tools declare: nested objects, enums, ``anyOf``, ``$ref`` to ``$defs`` (a recursive one
too), formats (annotations), arrays of objects; each with a valid instance and an invalid one.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["SCHEMAS", "run_validators"]

_EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 200},
        "start": {"type": "string", "format": "date-time"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "email": {"type": "string", "format": "email"},
                    "role": {"enum": ["required", "optional", "resource"]},
                },
                "required": ["email"],
                "additionalProperties": False,
            },
            "maxItems": 50,
        },
        "reminder": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0}]},
    },
    "required": ["title", "start", "duration_minutes"],
    "additionalProperties": False,
}
_TREE_DEFS = {
    "node": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"enum": ["file", "dir"]},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        },
        "required": ["name", "kind"],
    }
}

# name -> (schema, a valid instance, an invalid one)
SCHEMAS: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "get_weather": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        {"city": "Paris", "unit": "celsius"},
        {"city": "Paris", "unit": "kelvin"},
    ),
    "create_event": (
        _EVENT,
        {
            "title": "Planning",
            "start": "2026-12-02T10:00:00Z",
            "duration_minutes": 45,
            "attendees": [{"email": "a@example.com", "role": "required"}, {"email": "b@example.com"}],
            "reminder": None,
        },
        {
            "title": "",
            "start": "2026-12-02T10:00:00Z",
            "duration_minutes": 2,
            "attendees": [{"email": "a@example.com", "role": "boss"}],
        },
    ),
    "search": (
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {"$ref": "#/$defs/range"},
                            {"type": "object", "properties": {"tag": {"type": "string"}}, "required": ["tag"]},
                        ]
                    },
                },
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            },
            "required": ["query"],
            "$defs": {
                "range": {
                    "type": "object",
                    "properties": {"field": {"type": "string"}, "gte": {"type": "number"}, "lte": {"type": "number"}},
                    "required": ["field"],
                }
            },
        },
        {"query": "sluice", "filters": [{"field": "year", "gte": 2020}, {"tag": "docs"}], "limit": 10},
        {"query": "sluice", "filters": [{"gte": 2020}], "limit": 1000},
    ),
    "write_tree": (
        {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "$defs": _TREE_DEFS},
        {
            "root": {
                "name": "src",
                "kind": "dir",
                "children": [{"name": "a.py", "kind": "file"}, {"name": "lib", "kind": "dir", "children": []}],
            }
        },
        {"root": {"name": "src", "kind": "dir", "children": [{"name": "a.py", "kind": "link"}]}},
    ),
}

Candidate = tuple[Callable[[dict[str, Any]], Any], Callable[[Any, Any], bool], Callable[[Any, Any], int]]


def _candidates() -> dict[str, Candidate]:
    """name -> (compile, is_valid, number of errors it reports): each library through its public API."""
    out: dict[str, Candidate] = {}
    import jsonschema_rs

    out["jsonschema-rs"] = (
        lambda s: jsonschema_rs.validator_for(s, offline=True, validate_formats=False),
        lambda v, x: bool(v.is_valid(x)),
        lambda v, x: sum(1 for _ in v.iter_errors(x)),
    )
    try:
        import jsonschema  # type: ignore[import-untyped]  # no stubs installed: a bench-only candidate
        from referencing import Registry
    except ImportError:  # the bench extra brings it
        pass
    else:
        out["jsonschema"] = (
            lambda s: jsonschema.Draft202012Validator(s, registry=Registry()),
            lambda v, x: bool(v.is_valid(x)),
            lambda v, x: sum(1 for _ in v.iter_errors(x)),
        )
    try:
        import fastjsonschema
    except ImportError:
        pass
    else:

        def fast_errors(v: Any, x: Any) -> int:
            try:
                v(x)
            except fastjsonschema.JsonSchemaValueException:
                return 1  # it stops at the first error
            return 0

        out["fastjsonschema"] = (
            # draft 7, its newest; $defs is reached as a JSON pointer like any other
            lambda s: fastjsonschema.compile({"$schema": "http://json-schema.org/draft-07/schema#", **s}),
            lambda v, x: fast_errors(v, x) == 0,
            fast_errors,
        )
    return out


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name.replace("-", "_") if name == "jsonschema-rs" else name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _per_call(fn: Callable[[], Any], n: int) -> float:
    """Microseconds per call, over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _sluice_verdict() -> Candidate:
    """sluice's own path at a block.stop: the cache lookup by schema hash, then the verdict (errors listed)."""
    from sluice.normalizer.checks import Checker, ValidatorCache
    from sluice.schemas.checks import CheckSpec

    cache = ValidatorCache()

    def compile_(schema: dict[str, Any]) -> Checker:
        return Checker.compile(CheckSpec(tools={"t": schema}), "record", cache)

    return (
        compile_,
        lambda c, x: c.check_call("t", x).valid,
        lambda c, x: len(c.check_call("t", x).errors),
    )


def run_validators(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    calls = 400 if args.quick else 5000
    compiles = 5 if args.quick else 50
    rounds = args.repeat or (3 if args.quick else 7)
    rng = random.Random(args.seed)
    cands = _candidates()
    cands["sluice verdict"] = _sluice_verdict()
    reference = cands.get("jsonschema")
    compiled = {name: {s: c[0](SCHEMAS[s][0]) for s in SCHEMAS} for name, c in cands.items()}
    agree: dict[str, bool] = {}
    for name, (_, valid, _errs) in cands.items():
        # Each instance's validity as the reference says it (as the corpus says it, without the reference).
        agree[name] = all(
            valid(compiled[name][s], inst)
            is (reference[1](compiled["jsonschema"][s], inst) if reference is not None else inst is SCHEMAS[s][1])
            for s in SCHEMAS
            for inst in SCHEMAS[s][1:]
        )
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        order = list(cands)
        rng.shuffle(order)
        for name in order:
            comp, valid, errs = cands[name]
            per: dict[str, list[float]] = {"valid": [], "invalid": [], "compile": []}
            for s, (schema, good, bad) in SCHEMAS.items():
                v = compiled[name][s]
                per["valid"].append(_per_call(functools.partial(valid, v, good), calls))
                per["invalid"].append(_per_call(functools.partial(errs, v, bad), calls))
                if name != "sluice verdict":  # its compile is the cache's: a hit after the first
                    per["compile"].append(_per_call(functools.partial(comp, schema), compiles))
            for kind, values in per.items():
                if values:
                    samples.setdefault((name, kind), []).append(statistics.fmean(values))
    rows: dict[str, dict[str, Any]] = {}
    for (name, kind), values in samples.items():
        row = rows.setdefault(
            name, {"version": _version(name) if name != "sluice verdict" else "", "agrees": agree[name]}
        )
        row[kind] = {"median_us": statistics.median(values), "low_us": min(values), "high_us": max(values)}
    table = Table(  # the title's brackets are text, not rich markup
        title=f"Tool-argument validation: µs per call, mean over {len(SCHEMAS)} tool schemas "
        f"(median of {rounds} interleaved rounds \\[lowest … highest])"
    )
    for col in ("validator", "valid instance", "invalid instance (errors listed)", "compile", "agrees"):
        table.add_column(col, justify="left" if col == "validator" else "right")

    def cell(r: dict[str, Any], kind: str) -> str:
        if kind not in r:
            return "-"
        m = r[kind]
        return f"{m['median_us']:.2f} [{m['low_us']:.2f} … {m['high_us']:.2f}]"

    for name, r in rows.items():
        label = f"{name} {r['version']}".strip()
        table.add_row(label, cell(r, "valid"), cell(r, "invalid"), cell(r, "compile"), "yes" if r["agrees"] else "NO")
    console.print(table)
    return {"schemas": list(SCHEMAS), "calls_per_sample": calls, "rounds": rounds, "validators": rows}

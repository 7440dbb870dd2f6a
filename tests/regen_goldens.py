"""Write draft goldens for transcripts that have none: ``python -m tests.regen_goldens [--force]``.

A draft is only the current output: read every line against the provider's wire format before you
commit it. The per-dialect test modules spell the same sequences out by hand, and
``tests/unit/test_handwritten_events.py`` holds every event of one transcript per dialect (raw references,
seq and usage included) written from the wire bytes, which no regeneration touches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import encode_event
from tests.checked_cases import POLICIES, body_path, cases, checked_info
from tests.helpers import TRANSCRIPTS, info, run, transcript_bodies


def main(force: bool) -> None:
    for path in transcript_bodies():
        out = path.with_suffix(".jsonl")
        if out.exists() and not force:
            continue
        _, events, result = run(path.parent.name, path.read_bytes())
        out.write_bytes(b"".join(encode_event(e) + b"\n" for e in events))
        path.with_suffix(".result.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
        print(f"wrote {out.relative_to(TRANSCRIPTS)}")
    checked(force)


def checked(force: bool) -> None:
    """The output-check goldens (``tests/checked_cases.py``): ``<transcript>.checked.json`` per transcript."""
    docs: dict[Path, dict[str, object]] = {}
    for dialect in sorted({p.parent.name for p in transcript_bodies()}):
        for transcript, case, spec in cases(dialect):
            body = body_path(dialect, transcript)
            doc = docs.setdefault(body.with_suffix(".checked.json"), {})
            for policy in POLICIES:
                _, events, result = normalize_bytes(
                    [body.read_bytes()], dialect, checked_info(info(dialect), spec, policy)
                )
                doc[f"{case}/{policy}"] = {
                    "events": [msgspec.json.decode(encode_event(e)) for e in events],
                    "result": msgspec.to_builtins(result),
                }
    for out, doc in docs.items():
        if out.exists() and not force:
            continue
        out.write_bytes(msgspec.json.format(msgspec.json.encode(doc)) + b"\n")
        print(f"wrote {out.relative_to(TRANSCRIPTS)}")


if __name__ == "__main__":
    main("--force" in sys.argv)

"""The redactor on bytes: every spelling of a secret replaced, whatever the chunking; nothing else changed;
nothing held back past a line end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.redact import Redactor
from sluice.schemas.raw import REDACTION_MARKER

SECRET = "sk-proj-AbC/123_xyz"
M = REDACTION_MARKER.encode()


def _stream(r: Redactor, chunks: list[bytes]) -> bytes:
    s = r.stream()
    return b"".join(s.feed(c) for c in chunks) + s.flush()


def test_every_spelling_is_replaced_and_nothing_else_changes() -> None:
    r = Redactor([SECRET, "", "other-key-42"])
    body = b'{"m":"Incorrect API key provided: sk-proj-AbC/123_xyz, also sk-proj-AbC\\/123_xyz; sk-proj-AbC"}'
    assert r.redact(body) == b'{"m":"Incorrect API key provided: ' + M + b", also " + M + b'; sk-proj-AbC"}'
    assert r.redact_text("other-key-42 and other-key-4") == f"{REDACTION_MARKER} and other-key-4"
    assert Redactor([]).redact(body) == body and not Redactor([""]).active


def test_a_line_end_is_never_held_back() -> None:
    s = Redactor([SECRET]).stream()
    assert s.feed(b"data: x sk-pr") == b"data: x "  # may begin the secret: held
    assert s.feed(b"oj\n\n") == b"sk-proj\n\n"  # it did not: released with the line end
    assert s.feed(b"data: sk-proj-AbC/1") == b"data: "
    assert s.feed(b"23_xyz\n\n") == M + b"\n\n"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([b"data: ", b"sk-", SECRET.encode(), b"\n", b"\\/", b"x", b"sk-proj-AbC\\/123_xyz", b"\xff"]),
        max_size=40,
    ),
    st.data(),
)
def test_any_chunking_gives_the_one_shot_redaction(parts: list[bytes], data: st.DataObject) -> None:
    r = Redactor([SECRET])
    whole = b"".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(whole)))))
    chunks = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    out = _stream(r, chunks)
    assert out == r.redact(whole)
    assert SECRET.encode() not in out and b"sk-proj-AbC\\/123_xyz" not in out

"""The redactor on bytes: every spelling of a secret replaced, whatever the chunking; nothing else changed;
nothing held back past a line end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.normalizer.redact import MIN_SECRET_LENGTH, Redactor, is_placeholder
from sluice.schemas.raw import REDACTION_MARKER

SECRET = "sk-proj-AbC/123_xyz789"
M = REDACTION_MARKER.encode()


def _stream(r: Redactor, chunks: list[bytes]) -> bytes:
    s = r.stream()
    return b"".join(s.feed(c) for c in chunks) + s.flush()


def test_every_spelling_is_replaced_and_nothing_else_changes() -> None:
    r = Redactor([SECRET, "", "other-key-42-0123456789"])
    body = b'{"m":"Incorrect API key provided: sk-proj-AbC/123_xyz789, also sk-proj-AbC\\/123_xyz789; sk-proj-AbC"}'
    assert r.redact(body) == b'{"m":"Incorrect API key provided: ' + M + b", also " + M + b'; sk-proj-AbC"}'
    other = "other-key-42-0123456789"
    assert r.redact_text(f"{other} and {other[:-1]}") == f"{REDACTION_MARKER} and {other[:-1]}"
    assert Redactor([]).redact(body) == body and not Redactor([""]).active


def test_a_line_end_is_never_held_back() -> None:
    s = Redactor([SECRET]).stream()
    assert s.feed(b"data: x sk-pr") == b"data: x "  # may begin the secret: held
    assert s.feed(b"oj\n\n") == b"sk-proj\n\n"  # it did not: released with the line end
    assert s.feed(b"data: sk-proj-AbC/1") == b"data: "
    assert s.feed(b"23_xyz789\n\n") == M + b"\n\n"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [b"data: ", b"sk-", SECRET.encode(), b"\n", b"\\/", b"x", b"sk-proj-AbC\\/123_xyz789", b"\xff"]
        ),
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
    assert SECRET.encode() not in out and b"sk-proj-AbC\\/123_xyz789" not in out


def test_a_placeholder_key_is_not_a_secret() -> None:
    """Dummy keys of keyless local servers are shorter than MIN_SECRET_LENGTH: the model's text keeps them."""
    dummies = ["x", "EMPTY", "none", "ollama", "lm-studio", "sk-no-key-required", "a" * (MIN_SECRET_LENGTH - 1)]
    assert all(is_placeholder(d) for d in dummies) and not is_placeholder("k" * MIN_SECRET_LENGTH)
    r = Redactor(dummies)
    text = b'data: {"text":"none of EMPTY x ollama lm-studio sk-no-key-required"}\n\n'
    assert not r.active and r.redact(text) == text and _stream(r, [text[:7], text[7:]]) == text
    assert Redactor([*dummies, "k" * MIN_SECRET_LENGTH]).redact(b"x " + b"k" * MIN_SECRET_LENGTH) == b"x " + M

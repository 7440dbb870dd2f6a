"""Secrets out of what a provider sends, before anything is stored (the redactor).

Rule: every occurrence of a configured secret (a route's API key, which a provider may echo in an error
body, an event or a header) is replaced by ``REDACTION_MARKER``, so the raw log, the normalized events,
error messages and logs derived from them never hold it, and ``sluice audit`` re-normalizing the stored
raw log sees exactly what the live stream saw. Redaction works on decoded values and never changes the
framing, so the outcome, the events and their categories are the ones the stream makes without the echo:

- ``text/event-stream`` (and an error body, a header value): on the bytes as they arrive
  (``RedactingStream``), which is the same as on the decoded values, because the framing is lines and
  nothing else: a secret and the marker hold no CR or LF, so no line starts or ends elsewhere; the marker
  is printable ASCII without ``"`` or ``\\``, so inside a JSON string (where an echoed credential is: its
  characters, letters, digits and ``-_.+/=~``, hold no JSON delimiter) it is text of the same string.
  (Offsets and size limits count the bytes as stored: never more than came.)
- AWS event-stream (length-prefixed, CRC-checked binary messages): after each message is decoded, on its
  values, then framed again (``EventStreamDecoder.redact_with``); ``Normalizer.redact_with`` picks the
  place by the dialect's framing.

A chunk is not a boundary: a secret split across chunks is caught by holding back the longest chunk end
that could begin one (never a line end: secrets hold no CR or LF, so no SSE event waits on it). JSON may
escape ``/`` as ``\\/``; that spelling is matched too. Where bytes cannot be decoded (a broken binary
message, an unfinished one cut off), ``mask`` replaces a secret by the marker padded to its length, so
every length and offset stays the same.

Redaction never changes what the model said: a value shorter than ``MIN_SECRET_LENGTH`` (20) characters
is not a secret but a placeholder (the dummy key a keyless local server is configured with: ``x``,
``EMPTY``, ``none``, ``ollama``, ``sk-no-key-required``) and is left alone; replacing it would rewrite
every occurrence in the answer and break the JSON around it. Every real provider credential is longer
(OpenAI, Anthropic, Gemini, Azure, Groq, Mistral keys: 32 and more; OAuth access tokens, SigV4
signatures: 64 and more); the worker warns at start for each route whose key is a placeholder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sluice.schemas.raw import REDACTION_MARKER

__all__ = ["MIN_SECRET_LENGTH", "RedactingStream", "Redactor", "is_placeholder"]

MIN_SECRET_LENGTH = 20


def is_placeholder(value: str) -> bool:
    """True for a value too short to be a credential (it is not redacted)."""
    return len(value) < MIN_SECRET_LENGTH


class Redactor:
    """The configured secrets, compiled once per worker; ``stream()`` gives each attempt its own state."""

    def __init__(self, secrets: Iterable[str], marker: str = REDACTION_MARKER) -> None:
        variants: set[bytes] = set()
        for s in secrets:
            if not is_placeholder(s):
                b = s.encode()
                variants |= {b, b.replace(b"/", b"\\/")}
        pats = sorted(variants, key=len, reverse=True)  # the longest spelling wins where two overlap
        self.pattern = re.compile(b"|".join(re.escape(p) for p in pats)) if pats else None
        self.marker = marker.encode()
        self.prefixes = frozenset(p[:k] for p in pats for k in range(1, len(p)))
        self.prefix_ends = frozenset(p[k - 1] for p in pats for k in range(1, len(p)))  # a held prefix's last byte
        self.longest = max((len(p) for p in pats), default=0)

    @property
    def active(self) -> bool:
        return self.pattern is not None

    def redact(self, data: bytes) -> bytes:
        """One whole piece (a header value, an error body): every secret replaced."""
        return data if self.pattern is None else self.pattern.sub(self.marker, data)

    def mask(self, data: bytes) -> bytes:
        """Every secret replaced by the marker padded with ``*`` to the secret's length (bytes that cannot
        be decoded, whose lengths and offsets must not move)."""
        if self.pattern is None:
            return data
        marker = self.marker
        return self.pattern.sub(lambda m: marker.ljust(len(m[0]), b"*")[: len(m[0])], data)

    def redact_text(self, text: str) -> str:
        if self.pattern is None:
            return text
        return self.redact(text.encode("utf-8", "surrogatepass")).decode("utf-8", "surrogatepass")

    def stream(self) -> RedactingStream:
        return RedactingStream(self)


class RedactingStream:
    """One stream's bytes, redacted as they arrive."""

    def __init__(self, redactor: Redactor) -> None:
        self._r = redactor
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """The next bytes, redacted; a tail that may begin a secret is held for the next call."""
        r = self._r
        if r.pattern is None:
            return chunk
        data = r.pattern.sub(r.marker, self._held + chunk if self._held else chunk)
        keep = self._keep(data)
        self._held = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep] if keep else data

    def flush(self) -> bytes:
        """The end of the stream: whatever was held (it did not turn out to be a secret)."""
        held, self._held = self._held, b""
        return held

    def _keep(self, data: bytes) -> int:
        r = self._r
        if not data or data[-1] not in r.prefix_ends:  # the usual case: a chunk ends with a line end
            return 0
        for k in range(min(r.longest - 1, len(data)), 0, -1):
            if data[-k:] in r.prefixes:
                return k
        return 0

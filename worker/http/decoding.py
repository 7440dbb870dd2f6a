"""``gzip`` / ``deflate`` body decoding whose output the reader bounds, shared by both clients.

Rule: ``feed`` keeps compressed bytes, ``read(limit)`` inflates at most ``limit`` bytes of them. A body
that inflates a thousandfold (a "gzip bomb") is never in memory beyond what the reader has room for; the
rest waits compressed. A corrupt or truncated stream raises ``DecodingError``; a coding other than these
and ``identity`` is refused with ``RemoteProtocolError`` (``decoder_for``).
"""

from __future__ import annotations

import zlib
from collections import deque

from sluice.worker.http.errors import DecodingError, HTTPError, RemoteProtocolError, map_exceptions

__all__ = ["ContentDecoder", "decoder_for"]

_ZLIB: dict[type[BaseException], type[HTTPError]] = {zlib.error: DecodingError}


class ContentDecoder:
    def __init__(self, encoding: str) -> None:
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS)
        self._queue: deque[bytes] = deque()
        self._tail = b""  # input zlib took no output room for yet
        self._more = False  # the last read filled its limit: zlib may hold output for input it took

    @property
    def pending(self) -> bool:
        return bool(self._tail or self._queue or self._more)

    def feed(self, data: bytes) -> None:
        if data:
            self._queue.append(data)

    def read(self, limit: int) -> bytes:
        """At most ``limit`` decoded bytes. Raises ``DecodingError`` on a corrupt stream."""
        out = bytearray()
        while len(out) < limit and self.pending:
            data = self._tail or (self._queue.popleft() if self._queue else b"")
            room = limit - len(out)
            with map_exceptions(_ZLIB, detail=True):
                piece = self._z.decompress(data, room)
            self._tail = self._z.unconsumed_tail
            self._more = len(piece) == room
            out += piece
        return bytes(out)

    def close(self) -> None:
        """The body ended. Raises ``DecodingError`` when the compressed stream was cut short."""
        if not self._z.eof:
            raise DecodingError("the compressed body ended early")


def decoder_for(content_encoding: str | None) -> ContentDecoder | None:
    """The decoder a response's ``Content-Encoding`` needs (``None``: the body is as sent). Raises
    ``RemoteProtocolError`` for a coding sluice does not decode."""
    enc = (content_encoding or "identity").lower().strip()
    if enc in ("gzip", "x-gzip", "deflate"):
        return ContentDecoder(enc)
    if enc not in ("identity", ""):
        raise RemoteProtocolError(f"unsupported content-encoding {enc!r}")
    return None

"""The HTTP layer's failures: one typed exception per kind, raised ``from`` the library's or the OS's at one
boundary in each client (httpcore's discipline).

Rule: a client never lets a library's, a socket's or a codec's exception out and never writes a kind into
a message: it maps what it caught through one table (``map_exceptions``) or raises one of these directly.
The consumer (``worker/pipeline/upstream.py``) tells the kinds apart by type. ``str(exc)`` is what a terminal
message shows, built here from the type: ``Kind`` or ``Kind: detail``, where a network error names the
OS error behind it (``ConnectionRefusedError``, ``gaierror``, ``SSLCertVerificationError``), which says
more than ``ConnectError``. Details are sluice's own text, never the library's (which may echo a URL).

```
HTTPError
├── LocalProtocolError   the request was refused before anything was sent: InvalidURL, InvalidHeader
├── RemoteProtocolError  the response breaks HTTP/1.1, or uses a content-coding sluice does not speak
├── DecodingError        the gzip/deflate body is corrupt or cut short
├── TimeoutException     ConnectTimeout, PoolTimeout, WriteTimeout, ReadTimeout
└── NetworkError         ConnectError, WriteError, ReadError
```
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = [
    "NOT_SENT",
    "ConnectError",
    "ConnectTimeout",
    "DecodingError",
    "HTTPError",
    "InvalidHeader",
    "InvalidURL",
    "LocalProtocolError",
    "NetworkError",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "TimeoutException",
    "WriteError",
    "WriteTimeout",
    "map_exceptions",
]


class HTTPError(Exception):
    """Root of the HTTP layer's failures. The constructor takes only sluice's own detail text."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def kind(self) -> str:
        """The failure's name as messages show it."""
        return type(self).__name__

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


class LocalProtocolError(HTTPError):
    """Sluice refused to send the request (nothing reached the provider)."""


class InvalidURL(LocalProtocolError):
    """Not an http(s) URL with a host."""


class InvalidHeader(LocalProtocolError):
    """A header that would split the request (a line break, NUL or a colon in its name)."""


class RemoteProtocolError(HTTPError):
    """The provider's response is not valid HTTP/1.1 as sluice reads it."""


class DecodingError(HTTPError):
    """The body's content-coding (gzip, deflate) is corrupt or ended early."""


class TimeoutException(HTTPError):
    """A transport timer fired (the stream's own timers are ``worker/pipeline/upstream.py``'s)."""


class ConnectTimeout(TimeoutException):
    """The connection (TCP and TLS) was not up in time; nothing was sent."""


class PoolTimeout(TimeoutException):
    """No connection from the pool in time (httpx); nothing was sent."""


class WriteTimeout(TimeoutException):
    """The request could not be written in time."""


class ReadTimeout(TimeoutException):
    """The response did not come in time."""


class NetworkError(HTTPError):
    """The connection failed. ``kind`` is the OS error's name when one caused it."""

    @property
    def kind(self) -> str:
        cause = self.__cause__
        return type(cause).__name__ if isinstance(cause, OSError) else type(self).__name__


class ConnectError(NetworkError):
    """The provider could not be reached (refused, unreachable, name unknown, TLS refused); nothing was sent."""


class WriteError(NetworkError):
    """The connection broke while the request was being sent."""


class ReadError(NetworkError):
    """The connection broke while the response was being read."""


# The failures after which the provider has certainly not seen the request.
NOT_SENT: tuple[type[HTTPError], ...] = (LocalProtocolError, ConnectError, ConnectTimeout, PoolTimeout)


@contextmanager
def map_exceptions(table: Mapping[type[BaseException], type[HTTPError]], *, detail: bool = False) -> Iterator[None]:
    """Raise the first matching ``table`` entry's type ``from`` what the block raised (entries in order, so
    a subclass goes before its base). ``detail``: keep the caught exception's text, for sources whose text
    is sluice's own (the sans-IO parser, zlib); a library's or socket's is dropped (it may echo a URL)."""
    try:
        yield
    except HTTPError:
        raise
    except Exception as exc:
        for src, dst in table.items():
            if isinstance(exc, src):
                raise dst(str(exc) if detail else "") from exc
        raise

"""The HTTP layer's typed failures (worker/http/errors.py): each kind is a type, mapped once with its cause
kept, and the message a terminal shows is built from the type, exactly as before the types existed."""

from __future__ import annotations

import socket
import ssl
import zlib

import httpx
import pytest

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import StreamError
from sluice.worker.http.decoding import ContentDecoder, decoder_for
from sluice.worker.http.errors import (
    NOT_SENT,
    ConnectError,
    ConnectTimeout,
    DecodingError,
    HTTPError,
    InvalidHeader,
    InvalidURL,
    ReadError,
    RemoteProtocolError,
    map_exceptions,
)
from sluice.worker.http.httpx_client import _HTTPX
from sluice.worker.http.wire import _CONNECT
from sluice.worker.pipeline.upstream import _transport_failure


def _mapped(table: dict[type[BaseException], type[HTTPError]], exc: BaseException, **kw: bool) -> HTTPError:
    with pytest.raises(HTTPError) as info, map_exceptions(table, **kw):
        raise exc
    assert info.value.__cause__ is exc  # raised `from` what was caught: the traceback keeps the origin
    return info.value


@pytest.mark.parametrize(
    ("exc", "kind", "shown"),
    [
        (ConnectionRefusedError(111, "Connection refused"), ConnectError, "ConnectionRefusedError"),
        (socket.gaierror(-2, "Name or service not known"), ConnectError, "gaierror"),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), ConnectError, "SSLCertVerificationError"),
        (TimeoutError(), ConnectTimeout, "ConnectTimeout"),  # an OSError too: the table's order decides
    ],
)
def test_the_wire_connect_table_names_the_os_error(exc: OSError, kind: type[HTTPError], shown: str) -> None:
    err = _mapped(_CONNECT, exc)
    assert type(err) is kind and str(err) == shown  # the OS's own text (addresses) is dropped


def test_every_httpx_failure_maps_to_the_kind_of_its_name_without_httpx_text() -> None:
    request = httpx.Request("POST", "https://user:secret@example.com/v1")
    assert len(_HTTPX) == 10
    for src, dst in _HTTPX.items():
        exc = (
            src("boom https://user:secret@example.com/v1", request=request)
            if src is not httpx.InvalidURL
            else src("bad https://user:secret@example.com")
        )
        err = _mapped(_HTTPX, exc)
        assert type(err) is dst
        expected = "InvalidURL" if dst is InvalidURL else src.__name__
        assert str(err) == expected and "secret" not in str(err)


def test_unmapped_exceptions_and_the_layers_own_pass_through() -> None:
    with pytest.raises(KeyError), map_exceptions(_CONNECT):
        raise KeyError("x")
    own = RemoteProtocolError("bad chunk size line b'zz'")
    with pytest.raises(RemoteProtocolError) as info, map_exceptions({Exception: ReadError}):
        raise own
    assert info.value is own


def test_messages_are_kind_then_sluices_detail() -> None:
    assert str(InvalidURL("only http(s) URLs with a host are supported ('ftp')")) == (
        "InvalidURL: only http(s) URLs with a host are supported ('ftp')"
    )
    assert str(ConnectTimeout()) == "ConnectTimeout"
    try:
        raise ReadError("the connection closed inside the response") from ConnectionResetError(104, "reset")
    except ReadError as exc:
        assert str(exc) == "ConnectionResetError: the connection closed inside the response"
    assert str(ReadError()) == "ReadError"  # httpx's: no OS error behind it
    with pytest.raises(DecodingError, match=r"^DecodingError: Error -3 while decompressing"):
        _corrupt()
    with pytest.raises(RemoteProtocolError, match=r"^RemoteProtocolError: unsupported content-encoding 'br'$"):
        decoder_for("br")
    assert decoder_for(None) is None and decoder_for(" Identity ") is None


def _corrupt() -> None:
    dec = ContentDecoder("gzip")
    dec.feed(b"nope")
    dec.read(10)


def test_corrupt_zlib_error_is_the_cause() -> None:
    with pytest.raises(DecodingError) as info:
        _corrupt()
    assert isinstance(info.value.__cause__, zlib.error)


@pytest.mark.parametrize(
    ("exc", "responded", "message", "retryable"),
    [
        (ConnectTimeout(), False, "could not connect to the provider (ConnectTimeout)", True),
        (
            InvalidHeader("header 'X-A' holds a line break or a colon"),
            False,
            "could not connect to the provider (InvalidHeader: header 'X-A' holds a line break or a colon)",
            True,
        ),
        (
            RemoteProtocolError("the peer closed the connection inside the response (head)"),
            False,
            "the connection failed before a response (RemoteProtocolError: the peer closed the connection inside"
            " the response (head))",
            True,
        ),
        (ReadError(), True, "the connection broke mid-stream (ReadError)", False),
        (
            DecodingError("the compressed body ended early"),
            True,
            "the connection broke mid-stream (DecodingError: the compressed body ended early)",
            False,
        ),
    ],
)
def test_upstream_maps_every_kind_to_one_transport_terminal(
    exc: HTTPError, responded: bool, message: str, retryable: bool
) -> None:
    norm = Normalizer("anthropic", StreamInfo("r:1", "r", "", "anthropic", 1, None))
    (last,) = [ev for ev in _transport_failure(norm, exc, responded=responded) if isinstance(ev, StreamError)]
    assert last.error.category == "transport" and last.error.message == message
    assert last.error.retryable is retryable
    assert isinstance(exc, NOT_SENT) is (message.startswith("could not connect"))

"""The TCP proxy's synchronous surface: which Redis it fronts and the URL that reaches it through the proxy.
(Its behaviour on real sockets is tested in tests/integration/test_tcp_proxy.py.)"""

from __future__ import annotations

import pytest

from tests.faults import TcpProxy


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://127.0.0.1:6390/0", ("127.0.0.1", 6390)),
        ("redis://redis.internal", ("redis.internal", 6379)),
        ("rediss://user:pw@cache.example:7000/2", ("cache.example", 7000)),
        ("redis://[::1]:6400", ("::1", 6400)),
    ],
)
def test_for_url_targets_the_urls_server(url: str, target: tuple[str, int]) -> None:
    proxy = TcpProxy.for_url(url)
    assert (proxy.target_host, proxy.target_port) == target


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6390/0", "redis://127.0.0.1:7777/0"),
        ("redis://redis.internal", "redis://127.0.0.1:7777"),
        (
            "rediss://user:p%40ss@cache.example:7000/2?socket_timeout=1",
            "rediss://user:p%40ss@127.0.0.1:7777/2?socket_timeout=1",
        ),
        ("redis://:secret@[::1]:6400/1", "redis://:secret@127.0.0.1:7777/1"),
    ],
)
def test_url_for_replaces_only_host_and_port(url: str, expected: str) -> None:
    assert TcpProxy("unused", 1, port=7777).url_for(url) == expected


def test_url_for_brackets_an_ipv6_listen_address() -> None:
    assert TcpProxy("unused", 1, host="::1", port=7777).url_for("redis://h:1/0") == "redis://[::1]:7777/0"


@pytest.mark.parametrize("url", ["unix:///tmp/redis.sock", "http://127.0.0.1:6379", "redis://"])
def test_non_tcp_redis_urls_are_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="not a TCP Redis URL"):
        TcpProxy.for_url(url)
    with pytest.raises(ValueError, match="not a TCP Redis URL"):
        TcpProxy("unused", 1, port=7777).url_for(url)


def test_url_for_needs_the_port_chosen_at_start() -> None:
    with pytest.raises(RuntimeError, match="inside `async with`"):
        TcpProxy("127.0.0.1", 6379).url_for("redis://127.0.0.1:6379/0")


@pytest.mark.parametrize("rate", [0, -1.5])
def test_throttle_needs_a_positive_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        TcpProxy("127.0.0.1", 6379).throttle(rate)


def test_a_new_proxy_has_empty_statistics() -> None:
    stats = TcpProxy("127.0.0.1", 6379).statistics()
    assert stats.accepted == stats.open == stats.bytes_to_target == stats.bytes_to_client == stats.held_bytes == 0

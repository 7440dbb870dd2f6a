"""Fault injection for the test suite: tools that break the network between the worker and its peers.

Rule: faults are real (loopback sockets, real resets and stalls), never mocks of the Redis client.
"""

from tests.faults.tcp_proxy import ProxyStatistics, TcpProxy

__all__ = ["ProxyStatistics", "TcpProxy"]

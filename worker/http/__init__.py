"""The HTTP layer: the worker's upstream client, one module per layer.

Rule: ``client`` is the interface the worker codes against (``HttpClient``, ``UpstreamResponse``,
``make_http_client``); ``wire`` is sluice's HTTP/1.1 client (the default) over ``http1``, its sans-IO
response parser; ``httpx_client`` the same interface over httpx; ``decoding`` the bounded gzip/deflate
decoder both share; ``errors`` the typed failures both raise, each mapped once at the client's boundary.
Nothing here knows about providers, streams or Redis.
"""

from sluice.worker.http.client import HttpClient, UpstreamResponse, make_http_client
from sluice.worker.http.errors import NOT_SENT, HTTPError

__all__ = ["NOT_SENT", "HTTPError", "HttpClient", "UpstreamResponse", "make_http_client"]

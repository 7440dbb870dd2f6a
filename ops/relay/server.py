"""Running the relay: uvicorn in-process, with a shutdown that ends client streams first.

Rule: on shutdown the relay first stops listening, then ends every client's stream cleanly (a browser's
EventSource then reconnects with ``Last-Event-ID`` to another instance, or to this one once it is back),
then lets uvicorn finish; open streams never hold a shutdown until its graceful timeout.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import uvicorn
from starlette.types import Scope

from .access import AccessLog
from .app import CUT_OFF, Relay, create_app
from .config import RelayConfig
from .connections import RelayRedis
from .hub import Hub

__all__ = ["RelayServer", "RunningRelay", "serve_relay"]


class QuietCutOff(logging.Filter):
    """Drops uvicorn's "returned without completing response" error for a client the relay cut off on
    purpose (the relay logged the reason itself); the same line for any other response still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (CUT_OFF.get() and str(record.msg).startswith("ASGI callable returned without completing"))


_QUIET = QuietCutOff()


class RelayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, relay: Relay) -> None:
        super().__init__(config)
        self.relay = relay
        relay.abort = self.abort_connection

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Whoever runs the server decides when it stops (``sluice relay`` stops it on SIGINT/SIGTERM and
        # exits 0); uvicorn's own handlers would re-raise the signal after a clean shutdown.
        yield

    def abort_connection(self, scope: Scope) -> bool:
        """Abort the connection serving ``scope`` (no flush: a client that stopped reading would hold it
        open for as long as TCP lets it). True when found."""
        for conn in list(self.server_state.connections):
            transport = getattr(conn, "transport", None)
            if getattr(conn, "scope", None) is scope and transport is not None:
                transport.abort()
                return True
        return False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        if self.relay.hub is not None:
            self.relay.hub.close()
        await super().shutdown(sockets)


@dataclass(slots=True)
class RunningRelay:
    server: RelayServer
    host: str
    port: int
    stopped: anyio.Event

    async def wait_stopped(self) -> None:
        """Until the server stopped (SIGINT/SIGTERM, or ``stop()``)."""
        await self.stopped.wait()

    def stop(self) -> None:
        self.server.should_exit = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def redis(self) -> RelayRedis:
        redis = self.server.relay.redis
        if redis is None:
            raise RuntimeError("the relay is not running")
        return redis

    @property
    def hub(self) -> Hub:
        hub = self.server.relay.hub
        if hub is None:
            raise RuntimeError("the relay is not running")
        return hub


def build_server(config: RelayConfig, host: str = "127.0.0.1", port: int = 0, **uvicorn_options: object) -> RelayServer:
    logging.getLogger("uvicorn.error").addFilter(_QUIET)  # once: filters are a set-like list of the same object
    app = create_app(config)
    options: dict[str, object] = {
        "log_config": None,
        "access_log": False,
        "lifespan": "on",
        "timeout_graceful_shutdown": 5,
        "ws_ping_interval": None,
    }
    options.update(uvicorn_options)
    relay: Relay = app.state.relay
    return RelayServer(uvicorn.Config(AccessLog(app), host=host, port=port, **options), relay)  # type: ignore[arg-type]


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket (bound here rather than by uvicorn, which logs and exits the process when it
    cannot). Raises ``OSError`` naming the address and the reason, e.g. the port taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


@contextlib.asynccontextmanager
async def serve_relay(
    config: RelayConfig, host: str = "127.0.0.1", port: int = 0, **uvicorn_options: object
) -> AsyncIterator[RunningRelay]:
    """Serve the relay in this event loop for the duration of the block (port 0: a free port).
    Raises ``OSError`` when it cannot listen."""
    server = build_server(config, host, port, **uvicorn_options)
    done = anyio.Event()

    sock = _listen(host, port)
    # Accepted sockets inherit the listener's buffer sizes (Linux): a small send buffer bounds what a client
    # that stopped reading can leave unsent before the write timeout starts running.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_send_buffer)

    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit:
            pass
        finally:
            done.set()
            sock.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not server.started:
            if done.is_set():
                raise OSError(f"the relay could not listen on {host}:{port}")
            await anyio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield RunningRelay(server, host, int(bound), done)
        finally:
            server.should_exit = True
            await done.wait()

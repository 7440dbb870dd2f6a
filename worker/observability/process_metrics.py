"""The process's own figures on ``/metrics``: the families prometheus-client's ``ProcessCollector`` gives,
under its names and help texts, read with a few system calls instead of its /proc parsing.

Rule: the same six families (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_virtual_memory_bytes``, ``process_start_time_seconds``, ``process_open_fds``, ``process_max_fds``),
so dashboards built on prometheus-client's names read them unchanged. Why not ``ProcessCollector``: it lists
``/proc/self/fd`` to count the descriptors, and a loaded worker holds hundreds (a socket per stream in
flight): that listing was most of a scrape (docs/benchmarks.md, "The process's figures"). Here the count is
the size Linux reports for that directory (6.2 and later; a listing where it reports 0), CPU is
``getrusage`` (to the microsecond, where /proc's is in clock ticks), memory one read of ``/proc/self/statm``,
both through descriptors kept open.
Where there is no /proc (macOS), the memory and descriptor families are left out, as prometheus-client
leaves them out; CPU is there everywhere.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["ProcessMetrics"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProcessMetrics:
    """A prometheus-client collector of this process's CPU, memory and descriptors (register it in a
    registry: ``registry.register(ProcessMetrics())``). ``statm`` and the descriptors' directory are opened
    once and read again at each collection (a kept descriptor of each): opening a /proc file looks its path
    up, several times the cost of the read in a loaded worker."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self._proc = proc
        self._statm_path = os.path.join(proc, "statm")
        self._fd_path = os.path.join(proc, "fd")
        self._start: float | None = None
        self._pid = 0  # whose the kept descriptors and start time are: a forked child reads its own
        self._statm = self._fd = -1

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self._pid != os.getpid():
            self._open()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out: list[Metric] = []
        memory = self._memory()
        if memory is not None:
            vsize, rss = memory
            out.append(GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", value=vsize))
            out.append(GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.", value=rss))
        if self._start is not None:
            out.append(
                GaugeMetricFamily(
                    "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    value=self._start,
                )
            )
        out.append(
            CounterMetricFamily(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                value=usage.ru_utime + usage.ru_stime,
            )
        )
        fds = self._open_fds()
        if fds is not None:
            out.append(GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=fds))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            limit = math.inf if soft == resource.RLIM_INFINITY else float(soft)
            out.append(GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors.", value=limit))
        return out

    def close(self) -> None:
        """Close the kept descriptors (a later collection opens them again)."""
        for fd in (self._statm, self._fd):
            if fd >= 0:
                os.close(fd)
        self._statm = self._fd = -1
        self._pid = 0

    def __del__(self) -> None:
        if self._pid == os.getpid():
            self.close()

    def _open(self) -> None:
        self._statm, self._fd = -1, -1  # a parent's, after a fork: its own to close
        self._pid = os.getpid()
        self._start = _start_time(self._proc)
        with contextlib.suppress(OSError):
            self._statm = os.open(self._statm_path, os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            self._fd = os.open(self._fd_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _memory(self) -> tuple[float, float] | None:
        """Virtual size and resident set in bytes (statm counts pages)."""
        if self._statm < 0:
            return None
        try:
            size, resident = os.pread(self._statm, 256, 0).split()[:2]
            return float(int(size) * _PAGE), float(int(resident) * _PAGE)
        except (OSError, ValueError):
            return None

    def _open_fds(self) -> int | None:
        """Open descriptors, the kept one of the directory included."""
        if self._fd < 0:
            return None
        try:
            # Linux 6.2 and later give the directory's size as the number of open descriptors.
            if n := os.fstat(self._fd).st_size:
                return n
            return len(os.listdir(self._fd))
        except OSError:
            return None


def _start_time(proc: str) -> float | None:
    """When the process started (unix seconds), as prometheus-client works it out: the boot time plus the
    start ticks of /proc/self/stat; None without /proc."""
    try:
        with open(os.path.join(proc, "stat"), "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[-1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return ticks / os.sysconf("SC_CLK_TCK") + btime

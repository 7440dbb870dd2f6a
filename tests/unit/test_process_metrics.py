"""sluice.worker.observability.process_metrics against prometheus-client's ProcessCollector: the same families under the
same names, types and help texts, and the same figures (CPU to its clock ticks), read the cheap way; the
descriptor count follows what the process opens; without /proc, only what can be read anywhere."""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from sluice.worker.observability import process_metrics
from sluice.worker.observability.process_metrics import ProcessMetrics

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prometheus-client reads /proc (Linux)")


def _figures(collector: Any) -> dict[str, tuple[str, str, float]]:
    """Family name -> (type, help, value) of a collector rendered in the 0.0.4 text and parsed back."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    return {
        f.name: (f.type, f.documentation, f.samples[0].value)
        for f in parse_text(generate_latest(registry).decode())
        if len(f.samples) == 1
    }


@pytest.fixture
def held() -> Iterator[list[int]]:
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


@linux
def test_the_families_and_figures_are_prometheus_clients(held: list[int]) -> None:
    held += [os.open(os.devnull, os.O_RDONLY) for _ in range(40)]
    theirs = _figures(ProcessCollector(registry=None))
    ours = _figures(ProcessMetrics())
    assert (
        set(ours)
        == set(theirs)
        == {
            "process_cpu_seconds",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
        }
    )
    for name, (kind, doc, value) in theirs.items():
        assert ours[name][:2] == (kind, doc), name
        if name == "process_cpu_seconds":
            # Theirs in clock ticks, read first; ours to the microsecond, read a little later.
            tick = 1 / os.sysconf("SC_CLK_TCK")
            assert value - tick <= ours[name][2] <= value + 0.5, (value, ours[name][2])
        elif name == "process_open_fds":
            # Theirs counts the descriptor its listing opens; ours, the two it keeps open.
            assert ours[name][2] == value + 1
        elif name.endswith("memory_bytes"):
            assert abs(ours[name][2] - value) <= 0.05 * value, name  # the parse between the two reads
        else:
            assert ours[name][2] == value, name
    assert theirs["process_max_fds"][2] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@linux
def test_open_descriptors_are_counted_as_they_come_and_go(held: list[int]) -> None:
    metrics = ProcessMetrics()
    before = _figures(metrics)["process_open_fds"][2]
    held += [os.open(os.devnull, os.O_RDONLY) for _ in range(25)]
    assert _figures(metrics)["process_open_fds"][2] == before + 25
    for fd in held[:10]:
        os.close(fd)
    del held[:10]
    assert _figures(metrics)["process_open_fds"][2] == before + 15


@linux
def test_where_the_directory_has_no_size_the_descriptors_are_listed(
    held: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux before 6.2 gives /proc/self/fd the size 0: the count is then a listing's."""
    held += [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
    metrics = ProcessMetrics()
    sized = _figures(metrics)["process_open_fds"][2]
    real_fstat = os.fstat

    def sizeless(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        return os.stat_result((*st[:6], 0, *st[7:])) if fd == metrics._fd else st

    monkeypatch.setattr(process_metrics.os, "fstat", sizeless)
    assert _figures(metrics)["process_open_fds"][2] == sized + 1  # and the listing's own descriptor
    metrics.close()


@linux
def test_the_kept_descriptors_are_closed_and_opened_again(held: list[int]) -> None:
    metrics = ProcessMetrics()
    before = len(os.listdir("/proc/self/fd"))
    first = _figures(metrics)
    assert len(os.listdir("/proc/self/fd")) == before + 2
    metrics.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert set(_figures(metrics)) == set(first)  # opened again at the next collection
    del metrics
    assert len(os.listdir("/proc/self/fd")) == before  # and closed with the collector


def test_without_proc_only_cpu_is_given(tmp_path: Path) -> None:
    figures = _figures(ProcessMetrics(proc=str(tmp_path / "none")))
    assert set(figures) == {"process_cpu_seconds"}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    assert 0 < figures["process_cpu_seconds"][2] <= usage.ru_utime + usage.ru_stime


def test_memory_is_statms_pages_in_bytes(tmp_path: Path) -> None:
    (tmp_path / "statm").write_text("3540 2753 1528 1 0 1596 0\n")
    figures = _figures(ProcessMetrics(proc=str(tmp_path)))
    page = os.sysconf("SC_PAGE_SIZE")
    assert figures["process_virtual_memory_bytes"][2] == 3540 * page
    assert figures["process_resident_memory_bytes"][2] == 2753 * page


def test_a_garbled_statm_leaves_memory_out(tmp_path: Path) -> None:
    (tmp_path / "statm").write_text("garbled")
    assert set(_figures(ProcessMetrics(proc=str(tmp_path)))) == {"process_cpu_seconds"}


@linux
def test_a_forked_child_reads_its_own_process() -> None:
    metrics = ProcessMetrics()
    parent = _figures(metrics)["process_start_time_seconds"][2]  # the parent's descriptors are open now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own start time, read through the collector the parent made
        try:
            child = _figures(metrics)["process_start_time_seconds"][2]
            fresh = _figures(ProcessMetrics())["process_start_time_seconds"][2]
            os.write(write, json.dumps([child, fresh, metrics._pid == os.getpid()]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child, fresh, reopened = json.loads(os.read(read, 200))
    os.close(read)
    assert reopened and child == fresh and child > parent  # pytest started well before this fork
    assert _figures(metrics)["process_start_time_seconds"][2] == parent  # the parent's stay its own
    metrics.close()

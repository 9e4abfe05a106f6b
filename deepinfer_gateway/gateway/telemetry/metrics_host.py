"""One `/metrics` for every gateway process on a host, and each process's CPU.

With `PROMETHEUS_MULTIPROC_DIR` set (by the `serve --processes` supervisor, to a fresh
private folder, before it starts the processes), prometheus-client's multiprocess mode
writes every counter, gauge and histogram of each process to files of its own in that
folder; whichever process answers a scrape merges all of them (`HostCollector`).
prometheus-client picks its value store when it is imported, so the variable must be set
before the process imports it; `multiprocess_dir` refuses a variable set too late.

How the merge treats each kind (chosen per metric in metrics.py, documented in
docs/metrics.md): counters and histograms add up over every process that ever wrote to the
folder, exited ones included, so they never go backwards; gauges follow their
`multiprocess_mode`, and `live*` modes drop a process's values once the supervisor calls
`prometheus_client.multiprocess.mark_process_dead(pid)` for it. What keeps no file is taken
from the answering process: the build info (one build per host) and the CPU collector,
which reads every live process's CPU time from /proc at scrape time, so the request path
pays nothing for it.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from prometheus_client import values
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The shared folder when this process runs in multiprocess mode, else None."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return None
    if values.ValueClass is values.MutexValue:
        raise RuntimeError(f"{MULTIPROC_ENV} was set after prometheus_client was imported: this process's "
                           "metrics would stay in memory; set it before the process starts")
    if not os.path.isdir(path):
        raise RuntimeError(f"{MULTIPROC_ENV}={path!r} is not a directory")
    return path


def live_pids(filenames: Iterable[str]) -> set[int]:
    """Processes with a `live*` gauge file (`gauge_live<mode>_<pid>.db`): each gateway process
    writes one from the start (its in-flight gauge), and `mark_process_dead` deletes it."""
    pids = set()
    for name in filenames:
        stem = Path(name).name.removesuffix(".db")
        if stem.startswith("gauge_live"):
            pid = stem.rpartition("_")[2]
            if pid.isdigit():
                pids.add(int(pid))
    return pids


def live_processes(path: str) -> set[int]:
    """This process and every other one of the folder that has not been marked dead."""
    return live_pids(glob.glob(os.path.join(path, "gauge_live*.db"))) | {os.getpid()}


def written_files(path: str) -> list[str]:
    """The folder's value files, less those a starting process has created but not yet sized:
    prometheus-client opens a file, then truncates it to its first size, and a scrape that reads
    it in between would fail on the empty file. Such a file holds no value yet."""
    files = []
    for name in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.path.getsize(name) > 0:
                files.append(name)
        except FileNotFoundError:  # marked dead since the glob
            continue
    return files


def stat_cpu_seconds(stat: str, ticks_per_second: int) -> float:
    """User + system CPU seconds from the text of /proc/<pid>/stat (proc(5): utime and stime
    are fields 14 and 15, counted after the parenthesised command name, which may hold spaces)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU seconds; None when it is gone or /proc cannot be read."""
    if pid == os.getpid():
        own = os.times()
        return own.user + own.system
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_cpu_seconds(text, os.sysconf("SC_CLK_TCK"))


class ProcessCpuCollector(Collector):
    """`dgw_process_cpu_seconds_total{pid}`: one series per gateway process, read at scrape."""

    name = "dgw_process_cpu_seconds"
    documentation = "User + system CPU seconds of each gateway process on this host, read at scrape"
    labelnames = ("pid",)

    def __init__(self, pids: Callable[[], Collection[int]]) -> None:
        self._pids = pids

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for pid in sorted(self._pids()):
            seconds = cpu_seconds(pid)
            if seconds is not None:
                family.add_metric([str(pid)], seconds)
        yield family


class HostCollector(Collector):
    """Every process's file-backed metrics merged, then this process's `local` collectors.

    Series labelled `label` (the worker id) are kept only for values `visible()` returns:
    multiprocess mode cannot delete a series from another process's file, so a removed
    worker's last values would otherwise stay in the merge for as long as the files do.
    """

    def __init__(self, path: str, local: Iterable[Collector], label: str,
                 visible: Callable[[], Collection[str]]) -> None:
        self._path = path
        self._local = tuple(local)
        self._label = label
        self._visible = visible

    def collect(self) -> Iterator[Metric]:
        visible, label = self._visible(), self._label
        for family in MultiProcessCollector.merge(written_files(self._path), accumulate=True):
            family.samples = [s for s in family.samples if label not in s.labels or s.labels[label] in visible]
            yield family
        for collector in self._local:
            yield from collector.collect()

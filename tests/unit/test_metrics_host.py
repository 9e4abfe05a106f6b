"""metrics_host's pure parts (live processes from the folder's file names, CPU seconds from
/proc/<pid>/stat) and its guards; the merge itself runs across real processes in
tests/e2e/test_metrics_multiprocess.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict

from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.telemetry.metrics_host import (
    MULTIPROC_ENV,
    HostCollector,
    cpu_seconds,
    live_pids,
    multiprocess_dir,
    stat_cpu_seconds,
)


def test_live_processes_are_the_pids_of_live_gauge_files() -> None:
    names = ["/d/gauge_livesum_101.db", "gauge_livemostrecent_101.db", "/d/gauge_livesum_202.db",
             "/d/counter_303.db", "/d/histogram_303.db", "/d/gauge_all_404.db", "/d/gauge_livesum_x.db"]
    assert live_pids(names) == {101, 202}


def test_cpu_seconds_are_utime_plus_stime_after_the_command_name() -> None:
    # The command name may hold spaces and parentheses: fields are counted after the last ')'.
    stat = "4242 (uvicorn (a) b) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 75 0 0 20 0 3 0 1000 1 1"
    assert stat_cpu_seconds(stat, 100) == pytest.approx(3.25)


def test_cpu_seconds_of_this_process_and_of_a_missing_one() -> None:
    own = os.times()
    assert cpu_seconds(os.getpid()) == pytest.approx(own.user + own.system, abs=0.5)
    assert cpu_seconds(2**22 + 1) is None  # above the kernel's pid limit: never a process


def test_without_the_variable_the_exposition_is_the_processs_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    metrics = GatewayMetrics()
    assert metrics.exposition is metrics.registry
    pids = [s.labels["pid"] for f in metrics.registry.collect() if f.name == "dgw_process_cpu_seconds"
            for s in f.samples]
    assert pids == [str(os.getpid())]


def test_a_variable_set_after_prometheus_client_was_imported_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="before the process starts"):
        multiprocess_dir()


def test_the_merge_skips_a_file_a_starting_process_has_not_sized_yet(tmp_path: Path) -> None:
    """prometheus-client creates a value file, then truncates it to its first size; a scrape in
    between must still answer, with every other process's values."""
    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(json.dumps(["dgw_x", "dgw_x_total", {"worker": "w1"}, "x"]), 3.0, 0.0)
    written.close()
    (tmp_path / "counter_202.db").touch()
    collector = HostCollector(str(tmp_path), local=(), label="worker", visible=lambda: {"w1"})
    samples = [(s.name, s.value) for family in collector.collect() for s in family.samples]
    assert samples == [("dgw_x_total", 3.0)]

"""`bench report` table and the sweep chart helpers."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer_gateway.loadgen import plots
from deepinfer_gateway.loadgen.report import load_summaries, table
from deepinfer_gateway.workload.summary import summarize
from deepinfer_gateway.workload.types import RequestRecord


def write_run(d: Path, ttft: float, target: str, percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    records = [RequestRecord(index=i, arrival_s=float(i), ttft_s=ttft, e2e_s=ttft + 1.0, output_tokens=101,
                             prompt_tokens=1000, cached_tokens=400, itl_s=[0.01] * 100) for i in range(4)]
    s = summarize(records, wall_s=4.0, meta={"target": target, "protocol": "chat"}, percentiles=percentiles)
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(s))
    return s


def test_report_side_by_side(tmp_path: Path) -> None:
    write_run(tmp_path / "ours", 0.25, "http://a")
    write_run(tmp_path / "theirs", 0.5, "http://b")
    text = table(load_summaries([tmp_path / "ours", tmp_path / "theirs"]))
    lines = text.splitlines()
    assert lines[0].split() == ["ours", "theirs"]
    assert next(line for line in lines if line.startswith("TTFT p50 s")).split()[-2:] == ["0.250", "0.500"]
    assert next(line for line in lines if line.startswith("hit rate total")).split()[-2:] == ["0.400", "0.400"]
    assert next(line for line in lines if line.startswith("hit rate memory")).split()[-2:] == ["-", "-"]
    md = table(load_summaries([tmp_path / "ours"]), markdown=True)
    assert md.splitlines()[1].startswith("|---|")


def test_report_shows_the_chosen_percentiles(tmp_path: Path) -> None:
    write_run(tmp_path / "a", 0.25, "http://a", percentiles=(50, 95, 99.9))
    old = write_run(tmp_path / "b", 0.5, "http://b")
    del old["statistics"], old["ttft_s"]["max"]  # a summary written before percentiles were chosen
    (tmp_path / "b" / "summary.json").write_text(json.dumps(old))
    labels = {line.split("  ")[0].strip(): line.split()[-2:]
              for line in table(load_summaries([tmp_path / "a", tmp_path / "b"])).splitlines()[1:]}
    assert labels["TTFT p95 s"] == ["0.250", "-"] and labels["ITL p99.9 ms"] == ["10.0", "-"]
    assert labels["TTFT p90 s"] == ["0.250", "0.500"] and labels["e2e p99 s"] == ["1.25", "1.50"]
    only_default = table(load_summaries([tmp_path / "b"]))
    assert "p95" not in only_default and "TTFT p90 s" in only_default


def test_pareto_frontier_and_chart(tmp_path: Path) -> None:
    pts = [("a", 100.0, 10.0), ("b", 50.0, 30.0), ("c", 40.0, 20.0), ("d", 10.0, 40.0)]
    assert [p[0] for p in plots.frontier(pts)] == ["d", "b", "a"]
    s1 = write_run(tmp_path / "p1", 0.2, "x")
    s2 = write_run(tmp_path / "p2", 0.4, "x")
    plots.pareto([("rate=1", s1), ("rate=2", s2)], tmp_path / "pareto.png", "rate")
    assert (tmp_path / "pareto.png").stat().st_size > 1000

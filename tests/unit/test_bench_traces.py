"""Trace loaders and synthetic workloads."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import orjson
import pytest

from deepinfer_gateway.workload.traces import TraceFormatError, load_trace
from tests.shared_data import CONVERSATION, TRACES, needs_shared


def test_mooncake_gz_rebases_and_keeps_file_order_on_ties(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 100, "output_length": 7, "hash_ids": [0]},
        {"timestamp": 3000, "input_length": 512, "output_length": 9, "hash_ids": [0]},
    ]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    trace = load_trace(str(path))
    assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in trace.requests] == [
        (0.0, 100, 7, (0,)), (2.0, 600, 5, (0, 1)), (2.0, 512, 9, (0,))]
    assert [r.index for r in trace.requests] == [0, 1, 2]
    assert trace.has_prefix_info and trace.block_size == 512


def test_mooncake_bad_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(TraceFormatError, match="bad.jsonl:2"):
        load_trace(str(path))


def test_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:48.1805900,396,109\n")
    trace = load_trace(str(path))
    assert [(round(r.arrival_s, 6), r.input_length, r.output_length, r.hash_ids) for r in trace.requests] == [
        (0.0, 374, 44, None), (1.5, 396, 109, None)]
    assert not trace.has_prefix_info


@needs_shared(CONVERSATION, TRACES / "AzureLLMInferenceTrace_code.csv")
def test_shared_traces_load() -> None:
    conv = load_trace(str(CONVERSATION))
    assert len(conv.requests) == 5606 and conv.requests[-1].arrival_s == pytest.approx(1767.0)
    assert all(len(r.hash_ids or ()) == math.ceil(r.input_length / 512) for r in conv.requests)
    code = load_trace(str(TRACES / "AzureLLMInferenceTrace_code.csv"))
    assert len(code.requests) == 8819 and code.requests[-1].arrival_s == pytest.approx(3435.948, abs=1e-3)


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_synthetic_workloads_are_deterministic_hash_id_traces(kind: str) -> None:
    a = load_trace(f"synthetic:{kind}:requests=200,seed=3")
    b = load_trace(f"synthetic:{kind}:requests=200,seed=3")
    assert a == b and len(a.requests) == 200 and a.has_prefix_info
    assert all(len(r.hash_ids or ()) == math.ceil(r.input_length / 512) for r in a.requests)
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    firsts = [r.hash_ids[0] for r in a.requests if r.hash_ids]
    assert len(set(firsts)) < len(firsts) / 2  # shared system prompts / tool specs


def test_unknown_synthetic_and_format_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown synthetic"):
        load_trace("synthetic:nope")
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(TraceFormatError, match="cannot tell"):
        load_trace(str(tmp_path / "x.txt"))

"""Additive protocol changes keep the version: a gateway reads a newer worker's reports, ignoring
the fields it does not know; a worker still refuses a request field it does not know."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from deepinfer_gateway.core import protocol as wp

INFO = {"worker_id": "w", "engine": "sim", "role": "unified", "hardware": "sm100", "kv_format": "f", "model": "m",
        "epoch": "e"}
RANK = {"dp_rank": 0, "running": 1, "waiting": 0, "queued_prefill_tokens": 7}
LOAD = {"worker_id": "w", "role": "unified", "hardware": "sm100", "kv_format": "f", "running": 1, "waiting": 0,
        "queued_prefill_tokens": 7, "kv_usage": 0.5, "memory_capacity_blocks": 10, "dp_ranks": [RANK]}
EVENTS = {"worker_id": "w", "epoch": "e", "last_seq": 1, "oldest_seq": 1,
          "events": [{"seq": 1, "kind": "stored", "tier": "memory", "block_hashes": [3]}]}


@pytest.mark.parametrize(("model", "report"), [(wp.WorkerInfo, INFO), (wp.LoadReport, LOAD),
                                               (wp.KvEventBatch, EVENTS)])
def test_a_newer_workers_report_reads_without_the_fields_it_adds(model: type[BaseModel],
                                                                  report: dict[str, object]) -> None:
    newer = {**report, "a_later_field": 1}
    if model is wp.LoadReport:
        newer["dp_ranks"] = [{**RANK, "a_later_field": 2}]
    if model is wp.KvEventBatch:
        newer["events"] = [{**EVENTS["events"][0], "a_later_field": 3}]
    assert model.model_validate(newer) == model.model_validate(report)


def test_a_request_field_the_worker_does_not_know_is_refused() -> None:
    with pytest.raises(ValidationError, match="a_later_field"):
        wp.GenerateRequest.model_validate({"request_id": "r", "token_ids": [1], "a_later_field": 1})
    with pytest.raises(ValidationError, match="a_later_field"):
        wp.Sampling.model_validate({"a_later_field": 1})

"""The rule that turns the shared admin state into a replica's worker set."""

from __future__ import annotations

import pytest

from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.gateway.fleet.admin_store import WorkerEntry, desired_workers, routing_inputs

A, B, C = (DgwWorkerSpec(url=f"http://127.0.0.1:{port}") for port in (9001, 9002, 9003))


def test_added_workers_join_the_configured_ones_and_tombstones_remove_either() -> None:
    entries = {C.worker_id: WorkerEntry(spec=C), A.worker_id: WorkerEntry()}
    assert desired_workers((A, B), entries) == {B.worker_id: B, C.worker_id: C}
    assert desired_workers((A, B), {}) == {A.worker_id: A, B.worker_id: B}
    assert desired_workers((), {C.worker_id: WorkerEntry()}) == {}


def test_an_added_spec_replaces_a_configured_one_of_the_same_id() -> None:
    moved = DgwWorkerSpec(url=A.url, hardware="ascend950")
    assert desired_workers((A,), {A.worker_id: WorkerEntry(spec=moved)}) == {A.worker_id: moved}


def test_entries_round_trip_and_routing_fields_decode() -> None:
    for entry in (WorkerEntry(spec=B), WorkerEntry()):
        assert WorkerEntry.model_validate_json(entry.model_dump_json()) == entry
    stored = {"policy": '{"name": "round_robin"}', "decode_policy": '"least_load"'}
    assert routing_inputs(stored) == {"policy": {"name": "round_robin"}, "decode_policy": "least_load"}
    assert routing_inputs({}) == {}


def test_a_snapshot_is_lost_only_without_its_marker_and_without_data() -> None:
    from deepinfer_gateway.gateway.fleet.admin_store import AdminSnapshot

    assert AdminSnapshot({}, {}, kept=False).lost
    assert not AdminSnapshot({}, {}, kept=True).lost  # changes were made and all undone: nothing to restore
    assert not AdminSnapshot({A.worker_id: WorkerEntry()}, {}, kept=False).lost  # stored before the marker
    assert not AdminSnapshot({}, {"policy": '"least_load"'}, kept=False).lost


def test_a_record_written_before_the_engine_variants_still_decodes() -> None:
    """Before WorkerSpec was one variant per engine, every record carried every engine's keys."""
    old = ('{"spec": {"url": "http://127.0.0.1:9001", "engine": "dgw", "model": "", "kv_events_endpoint": "", '
           '"kv_events_replay_endpoint": "", "kv_events_topic": "", "role": "unified", "hardware": "sm100", '
           '"kv_format": "", "pool": "", "id": ""}}')
    assert WorkerEntry.model_validate_json(old).spec == A
    with pytest.raises(ValueError, match="model"):  # a set key of another engine is refused, not dropped
        WorkerEntry.model_validate_json(old.replace('"model": ""', '"model": "m"'))

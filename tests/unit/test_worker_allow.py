"""Which addresses a worker added at run time may name (gateway/fleet/worker_allow.py): every
address it makes the gateway contact, parsed as the HTTP client parses it, against the
configured workers' own addresses and the hosts/CIDRs listed."""

from __future__ import annotations

import pytest

from deepinfer_gateway.config import parse_worker_spec
from deepinfer_gateway.gateway.fleet.worker_allow import WorkerAllowList, WorkerNotAllowed

ALLOW = WorkerAllowList.build(["10.0.0.0/8", "gpu-1.internal"], [parse_worker_spec({"url": "http://127.0.0.1:9"})])


@pytest.mark.parametrize("url", ["http://10.0.0.1:8100", "http://127.0.0.1:9", "http://GPU-1.internal.:5",
                                 "http://[::ffff:10.1.2.3]:1"])
def test_listed_and_configured_addresses_pass(url: str) -> None:
    assert ALLOW.refusal(parse_worker_spec({"url": url})) is None


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:10",  # a configured worker's host, another port: another service
    "http://localhost:9",  # names are matched as written, never resolved
    "http://10.0.0.1@127.0.0.2:9",  # the host is after the @
    "https://127.0.0.1:9",  # another scheme: another port
])
def test_other_addresses_are_refused(url: str) -> None:
    with pytest.raises(WorkerNotAllowed) as refused:
        ALLOW.check(parse_worker_spec({"url": url}))
    assert refused.value.status_code == 400 and refused.value.code == "worker_not_allowed"


def test_a_vllm_workers_kv_events_endpoints_are_checked_too() -> None:
    spec = parse_worker_spec({"url": "http://10.0.0.1:8000", "engine": "vllm", "kv_format": "vllm:x",
                              "kv_events_endpoint": "tcp://8.8.8.8:5557"})
    assert "tcp://8.8.8.8:5557" in (ALLOW.refusal(spec) or "")


def test_no_list_admits_only_the_configured_addresses() -> None:
    only_configured = WorkerAllowList.build([], [parse_worker_spec({"url": "http://10.0.0.1:8100"})])
    assert only_configured.refusal(parse_worker_spec({"url": "http://10.0.0.1:8100", "pool": "p"})) is None
    assert only_configured.refusal(parse_worker_spec({"url": "http://10.0.0.2:8100"})) is not None


def test_a_local_zmq_socket_is_admitted_as_loopback_is() -> None:
    """vLLM's KV events may come over an `ipc://` socket on this host: local, so admitted where
    loopback is (or where a configured worker names the same socket), refused elsewhere."""
    spec = parse_worker_spec({"url": "http://127.0.0.1:9", "engine": "vllm", "kv_format": "vllm:x",
                              "kv_events_endpoint": "ipc:///run/vllm/kv.ipc"})
    assert WorkerAllowList.build(["127.0.0.1"], []).refusal(spec) is None
    assert WorkerAllowList.build([], [spec]).refusal(spec) is None
    assert "ipc:///run/vllm/kv.ipc" in (ALLOW.refusal(spec) or "")

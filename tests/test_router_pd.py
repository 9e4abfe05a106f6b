"""Prefill/decode disaggregation through the live gateway: PD streaming, KV hand-off,
bypass, cancellation of both sides, admission control, admin add/remove."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer_gateway.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"
PD_WORKERS = "prefill:sm100,prefill:sm100,prefill:ascend950,decode:sm100,decode:sm100,decode:ascend950"
ADMIN_KEY = "admin-secret"
ADMIN_TOML = """
[[api_keys]]
name = "admin"
key_sha256 = "{digest}"
admin = true
"""


def _admin_toml() -> str:
    import hashlib

    return ADMIN_TOML.format(digest=hashlib.sha256(ADMIN_KEY.encode()).hexdigest())


@pytest.fixture(scope="module")
def pd_cluster() -> Iterator[SimCluster]:
    cluster = SimCluster(PD_WORKERS, time_scale=20.0)
    yield cluster
    cluster.stop()


def _workers(cluster: SimCluster) -> list[tuple[str, str, str]]:
    return [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs)]  # type: ignore[misc]


@pytest.fixture(scope="module")
def pd_gateway(pd_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("pd"), _workers(pd_cluster), extra_toml=_admin_toml())
    gw.wait_ready(6)
    yield gw
    gw.stop()


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60)


def _metric(gw: Gateway, needle: str) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(needle):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _bypasses(gw: Gateway) -> float:
    return sum(_metric(gw, f'dgw_routing_decisions_total{{hardware="{hw}",pool="decode",reason="pd_bypass"}}')
               for hw in ("sm100", "ascend950"))


def _load(url: str) -> dict:
    return httpx.get(url + "/v1/worker/load").json()


def test_pd_stream_is_one_answer_from_two_workers(pd_gateway: Gateway, pd_cluster: SimCluster) -> None:
    before = _metric(pd_gateway, 'dgw_routing_decisions_total{hardware="sm100",pool="decode"') + _metric(
        pd_gateway, 'dgw_routing_decisions_total{hardware="ascend950",pool="decode"')
    stream = _client(pd_gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Explain PD disaggregation in one line."}],
        stream=True, stream_options={"include_usage": True})
    content, reasoning, usage = "", "", None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        elif chunk.choices:
            content += chunk.choices[0].delta.content or ""
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning and content and usage is not None
    assert usage.completion_tokens > 1  # the first token came from prefill, the rest from decode
    after = _metric(pd_gateway, 'dgw_routing_decisions_total{hardware="sm100",pool="decode"') + _metric(
        pd_gateway, 'dgw_routing_decisions_total{hardware="ascend950",pool="decode"')
    assert after == before + 1


def test_pd_matches_unified_output(pd_gateway: Gateway, gateway: Gateway) -> None:
    """The same prompt gives the same answer through PD and through a unified cluster."""
    messages = [{"role": "user", "content": "Same answer either way?"}]
    pd = _client(pd_gateway).chat.completions.create(model=MODEL, messages=messages, max_tokens=40, seed=7)
    unified = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, seed=7)
    assert pd.choices[0].message.content == unified.choices[0].message.content
    assert pd.usage.completion_tokens == unified.usage.completion_tokens


def test_shared_prefix_hits_cache_in_pd(pd_gateway: Gateway) -> None:
    system = " ".join(f"rule {i}: keep block {i * 3 % 997}." for i in range(700))
    client = _client(pd_gateway)
    first = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "first"}])
    second = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "second"}])
    prefix_blocks = (first.usage.prompt_tokens - 20) // 128
    assert second.usage.prompt_tokens_details.cached_tokens >= prefix_blocks * 128 - 128


def test_repeated_prompt_bypasses_prefill(pd_gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "bypass me " * 300}]
    client = _client(pd_gateway)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    time.sleep(0.3)  # KV events reach the index
    before = _bypasses(pd_gateway)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert _bypasses(pd_gateway) == before + 1
    assert out.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 256


def test_client_disconnect_aborts_both_sides(pd_gateway: Gateway, pd_cluster: SimCluster) -> None:
    with httpx.stream("POST", pd_gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                      json={"model": MODEL, "stream": True, "max_tokens": 5000, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "a very long answer please"}]}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if all(_load(url)["running"] == 0 and _load(url)["waiting"] == 0 for url in pd_cluster.urls):
            return
        time.sleep(0.05)
    pytest.fail(f"worker requests leaked: {[_load(u) for u in pd_cluster.urls]}")


def test_admin_remove_and_add_worker(pd_gateway: Gateway, pd_cluster: SimCluster) -> None:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(pd_gateway.url + "/admin/workers", headers=headers).json()["workers"]
    victim = next(w for w in listed if w["role"] == "prefill")
    assert httpx.get(pd_gateway.url + "/admin/workers").status_code == 401
    r = httpx.delete(f"{pd_gateway.url}/admin/workers/{victim['id']}", headers=headers)
    assert r.status_code == 200
    assert httpx.get(pd_gateway.url + "/ready").json()["healthy_workers"] == 5
    r = httpx.post(pd_gateway.url + "/admin/workers", headers=headers,
                   json={"url": victim["url"], "role": "prefill", "hardware": victim["hardware"]})
    assert r.status_code == 201 and r.json()["healthy"]
    assert httpx.get(pd_gateway.url + "/ready").json()["healthy_workers"] == 6


def test_admission_control_429_with_retry_after(pd_cluster: SimCluster, tmp_path: Path) -> None:
    gw = Gateway(tmp_path, _workers(pd_cluster), extra_toml="[router]\nadmission_queued_tokens = 1000\n")
    try:
        gw.wait_ready(6)
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 3000}]}
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda i: httpx.post(gw.url + "/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": f"{i} " + "word " * 3000}]}, timeout=60), range(24)))
        statuses = [r.status_code for r in responses]
        assert 429 in statuses and 200 in statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
    finally:
        gw.stop()

"""Prefill/decode disaggregation through the live gateway: PD streaming, KV hand-off,
bypass, cancellation of both sides, admission control, the admin API (workers, routing
policies, index stats) and `bench --sweep policy` against it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer_gateway.process.cli import main as cli_main
from harness.launch import Gateway, SimCluster
from tests.shared_data import CONVERSATION, needs_shared

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
    return [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]  # type: ignore[misc]


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


def _prefill_decisions(gw: Gateway, reason: str) -> float:
    lines = httpx.get(gw.url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("dgw_routing_decisions_total{") and f'pool="prefill",reason="{reason}"' in line)


def test_admin_routing_switches_the_policy_at_run_time(pd_gateway: Gateway) -> None:
    url, headers = pd_gateway.url + "/admin/routing", {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.put(url, json={"policy": "round_robin"}).status_code == 401
    current = httpx.get(url, headers=headers).json()
    assert current["policy"] == "estimated_ttft" and "round_robin" in current["available"]
    for bad, why in (({"policy": "fastest_please"}, "unknown routing policy 'fastest_please'"),
                     ({"polcy": "round_robin"}, "polcy"),
                     ({"decode_policy": {"name": "least_load", "choices": 3}}, "decode_policy: choices: unknown"),
                     ({"policy": {"name": "estimated_ttft", "stick_ratio": 0.5}}, "policy: stick_ratio: Input")):
        r = httpx.put(url, headers=headers, json=bad)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and message.startswith("Invalid routing update") and why in message, r.text
    assert httpx.get(url, headers=headers).json() == current  # nothing changed
    r = httpx.put(url, headers=headers, json={"policy": {"name": "estimated_ttft", "stick_ratio": 2.0}})
    assert r.status_code == 200 and r.json()["policy"] == "estimated_ttft"
    assert r.json()["parameters"]["policy"] == {**current["parameters"]["policy"], "stick_ratio": 2.0}
    before = _prefill_decisions(pd_gateway, "round_robin")
    try:
        r = httpx.put(url, headers=headers, json={"policy": "round_robin"})
        assert r.status_code == 200 and r.json()["policy"] == "round_robin"
        client = _client(pd_gateway)
        for i in range(4):
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": f"policy switch {i} " * 300}])
        assert _prefill_decisions(pd_gateway, "round_robin") - before == 4
    finally:
        httpx.put(url, headers=headers, json={"policy": "estimated_ttft"})
    assert httpx.get(url, headers=headers).json()["policy"] == "estimated_ttft"


def test_admin_index_stats(pd_gateway: Gateway) -> None:
    url, headers = pd_gateway.url + "/admin/index", {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(url).status_code == 401
    _client(pd_gateway).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "index stats " * 400}])
    deadline = time.monotonic() + 5
    while True:
        stats = httpx.get(url, headers=headers).json()
        if sum(w["memory_blocks"] for w in stats["workers"].values()) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats["backend"] == "memory" and len(stats["workers"]) == 6, stats
    assert sum(w["memory_blocks"] for w in stats["workers"].values()) >= 3  # ~1,200 prompt tokens
    assert all(w["last_seq"] >= 0 for w in stats["workers"].values())


@needs_shared(CONVERSATION)
def test_bench_sweeps_routing_policies_through_the_admin_api(pd_gateway: Gateway, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = _prefill_decisions(pd_gateway, "round_robin")
    rc = cli_main(["bench", "--url", pd_gateway.url, "--trace", str(CONVERSATION), "--max-requests", "6",
                   "--speedup", "40", "--sweep", "policy", "--sweep-values", "round_robin,estimated_ttft",
                   "--api-key", ADMIN_KEY, "--out", str(tmp_path), "--no-progress", "--no-plots"])
    assert rc == 0
    sweep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["label"] for p in sweep["points"]] == ["policy=round_robin", "policy=estimated_ttft"]
    for point in ("policy-round_robin", "policy-estimated_ttft"):
        assert json.loads((tmp_path / point / "summary.json").read_text())["completed"] == 6
    assert _prefill_decisions(pd_gateway, "round_robin") - before == 6  # the first point only
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(pd_gateway.url + "/admin/routing", headers=headers).json()["policy"] == "estimated_ttft"


def test_bench_policy_sweep_without_admin_rights_says_why(pd_gateway: Gateway, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="HTTP 401"):
        cli_main(["bench", "--url", pd_gateway.url, "--trace", "synthetic:chat:requests=2", "--sweep", "policy",
                  "--sweep-values", "round_robin", "--api-key", "not-a-key", "--out", str(tmp_path)])


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

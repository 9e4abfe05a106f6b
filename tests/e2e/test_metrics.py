"""The gateway's metrics: per-request histograms labelled by the serving worker's model, pool
and hardware (unified and PD), `dgw_build_info`, a removed worker's series, the generated
docs/metrics.md, and the Grafana dashboard against the registry."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai.types import CompletionUsage
from prometheus_client.metrics import MetricWrapperBase

from deepinfer_gateway.core.protocol import V1Fallback
from deepinfer_gateway.gateway.telemetry import metrics_reference
from deepinfer_gateway.gateway.telemetry.metrics import REQUEST_LABELS, WORKER_LABEL, GatewayMetrics
from deepinfer_gateway.gateway.telemetry.metrics_reference import (
    LABELS,
    exposed_names,
    metric_docs,
    reference_registry,
    render,
)
from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, scrape_until, total

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "deepinfer-gateway.json"
MODEL = "DeepSeek-V4.1-Flash"
ADMIN_KEY = "metrics-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
KEYS_TOML = f"""
admin_worker_hosts = ["127.0.0.1"]  # the second sim worker is added at run time
[[api_keys]]
name = "admin"
key_sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
admin = true
"""
POOL = "mixed"
ASCEND = {"role": "unified", "hardware": "ascend950", "pool": POOL, "id": "asc-1"}
PER_REQUEST = ("dgw_time_to_first_token_seconds", "dgw_queue_time_seconds", "dgw_request_duration_seconds",
               "dgw_request_prompt_tokens", "dgw_request_generation_tokens")


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, content: str, stream: bool) -> tuple[str, int, int]:
    """One chat request: (the worker that served it, prompt tokens, completion tokens)."""
    create = client.chat.completions.with_raw_response.create
    messages: list[Any] = [{"role": "user", "content": content}]
    usage: CompletionUsage | None
    if stream:
        streamed = create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                          stream_options={"include_usage": True})
        worker = streamed.headers["x-dgw-worker"]
        usage = [chunk.usage for chunk in streamed.parse() if chunk.usage is not None][-1]
    else:
        whole = create(model=MODEL, messages=messages, max_tokens=24)
        worker = whole.headers["x-dgw-worker"]
        usage = whole.parse().usage
    assert usage is not None
    return worker, usage.prompt_tokens, usage.completion_tokens


# ------------------------------------------------------------------------------ unified

@pytest.fixture(scope="module")
def two_workers() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100,unified:ascend950", time_scale=20.0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def one_worker_gateway(two_workers: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Configured with the sm100 worker only, in pool `mixed`; tests add the Ascend one to that
    pool through the admin API (the planner serves a role from one pool)."""
    sm100 = f'[[workers]]\nurl = "{two_workers.urls[0]}"\nhardware = "sm100"\npool = "{POOL}"\nid = "sm-1"\n'
    gw = Gateway(tmp_path_factory.mktemp("metrics"), [], extra_toml=KEYS_TOML + sm100)
    gw.wait_ready(1)
    yield gw
    gw.stop()


def test_histograms_carry_the_serving_workers_model_pool_and_hardware(
        one_worker_gateway: Gateway, two_workers: SimCluster) -> None:
    gw = one_worker_gateway
    added = httpx.post(gw.url + "/admin/workers", headers=ADMIN, json={"url": two_workers.urls[1], **ASCEND})
    assert added.status_code == 201 and added.json()["healthy"]
    assert httpx.put(gw.url + "/admin/routing", headers=ADMIN, json={"policy": "round_robin"}).status_code == 200
    labels_of = {"sm-1": {"pool": POOL, "hardware": "sm100"}, "asc-1": {"pool": POOL, "hardware": "ascend950"}}

    client = _client(gw)
    served: list[tuple[str, int, int, bool]] = []
    for i in range(6):  # round robin over two workers: three each, streamed and not
        stream = i % 4 < 2
        served.append((*_chat(client, f"Metrics request {i}: tell me about hardware.", stream), stream))
    assert {w for w, *_ in served} == set(labels_of)
    samples = scrape_until(gw.url, "dgw_requests_total", len(served), protocol="chat", status="200")

    for worker, labels in labels_of.items():
        mine = [s for s in served if s[0] == worker]
        series = {"model": MODEL, **labels}
        for name in PER_REQUEST:
            assert total(samples, name + "_count", **series) == len(mine), (name, series)
        assert total(samples, "dgw_request_prompt_tokens_sum", **series) == sum(p for _, p, _, _ in mine)
        assert total(samples, "dgw_request_generation_tokens_sum", **series) == sum(c for _, _, c, _ in mine)
        # queue time ends at the worker's `ready`, before the first token: never longer than TTFT
        assert 0 < total(samples, "dgw_queue_time_seconds_sum", **series) <= total(
            samples, "dgw_time_to_first_token_seconds_sum", **series)
        streamed_tokens = sum(c for _, _, c, s in mine if s)
        assert 0 < total(samples, "dgw_inter_token_latency_seconds_count", **series) <= streamed_tokens
    # Only bounded values appear: the served model, configured pools, the Hardware enum.
    for name, sample_labels in samples:
        found = dict(sample_labels)
        if name.startswith(PER_REQUEST + ("dgw_inter_token_latency_seconds",)):
            assert found["model"] == MODEL
            assert found["pool"] == POOL and found["hardware"] in {"sm100", "ascend950"}


def test_build_info_names_this_build(one_worker_gateway: Gateway) -> None:
    samples = scrape(one_worker_gateway.url)
    (labels,) = [dict(ls) for (name, ls), v in samples.items() if name == "dgw_build_info" and v == 1]
    assert labels["version"] == metadata.version("deepinfer-gateway")
    assert labels["python"] == platform.python_version()
    assert re.fullmatch(r"[0-9a-f]{12}|unknown", labels["git_sha"])


def test_process_cpu_is_the_gateways_own(one_worker_gateway: Gateway) -> None:
    """One process: one series, its pid; the several-process case is test_metrics_multiprocess.py."""
    first = scrape(one_worker_gateway.url)
    cpu = {dict(ls)["pid"]: v for (name, ls), v in first.items() if name == "dgw_process_cpu_seconds_total"}
    assert list(cpu) == [str(one_worker_gateway.proc.proc.pid)] and cpu[str(one_worker_gateway.proc.proc.pid)] > 0


def test_a_removed_workers_series_are_gone(one_worker_gateway: Gateway, two_workers: SimCluster) -> None:
    gw = one_worker_gateway
    if httpx.get(gw.url + "/ready").json()["healthy_workers"] < 2:  # this test alone: add the worker here
        r = httpx.post(gw.url + "/admin/workers", headers=ADMIN, json={"url": two_workers.urls[1], **ASCEND})
        assert r.status_code == 201
    time.sleep(0.5)  # a few health checks: the load-report gauges are set
    before = [name for (name, labels) in scrape(gw.url) if (WORKER_LABEL, "asc-1") in labels]
    assert {"dgw_worker_healthy", "dgw_worker_queue_tokens", "dgw_worker_running_requests",
            "dgw_worker_kv_usage_ratio"} <= set(before)

    assert httpx.delete(gw.url + "/admin/workers/asc-1", headers=ADMIN).status_code == 200
    time.sleep(0.5)  # health checks in flight at removal time have landed
    after = scrape(gw.url)
    assert [name for (name, labels) in after if (WORKER_LABEL, "asc-1") in labels] == []
    assert total(after, "dgw_worker_healthy", worker="sm-1") == 1


def test_forget_worker_covers_every_worker_labelled_metric() -> None:
    metrics = GatewayMetrics()
    labelled = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase) and WORKER_LABEL in m._labelnames]
    assert len(labelled) == len([d for d in metric_docs(metrics.registry) if WORKER_LABEL in d.labels]) >= 5
    for metric in labelled:
        for worker in ("w1", "w2"):
            metric.labels(**{name: worker if name == WORKER_LABEL else "x" for name in metric._labelnames})

    metrics.forget_worker("w1")
    families = list(metrics.registry.collect())
    assert not [s for f in families for s in f.samples if s.labels.get(WORKER_LABEL) == "w1"]
    kept = {f.name for f in families for s in f.samples if s.labels.get(WORKER_LABEL) == "w2"}
    assert kept == {next(iter(m.describe())).name for m in labelled}


def test_request_series_are_looked_up_once_per_key() -> None:
    metrics = GatewayMetrics()
    first = metrics.request_series(MODEL, "prefill", "sm100")
    assert metrics.request_series(MODEL, "prefill", "sm100") is first
    assert metrics.request_series(MODEL, "prefill", "ascend950") is not first
    first.ttft.observe(0.2)
    assert metrics.registry.get_sample_value(
        "dgw_time_to_first_token_seconds_count", {"model": MODEL, "pool": "prefill", "hardware": "sm100"}) == 1


# ------------------------------------------------------------------------------ PD

@pytest.fixture(scope="module")
def pd_pair() -> Iterator[SimCluster]:
    cluster = SimCluster("prefill:ascend950,decode:ascend950", time_scale=20.0)
    yield cluster
    cluster.stop()


def test_pd_first_leg_and_last_leg_label_their_own_histograms(
        pd_pair: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    workers = [(url, *spec.split(":")) for url, spec in zip(pd_pair.urls, pd_pair.specs, strict=True)]
    gw = Gateway(tmp_path_factory.mktemp("metrics-pd"), workers,
                 extra_toml=KEYS_TOML + "\n[router]\npd_bypass_tokens = 0\n")
    try:
        gw.wait_ready(2)
        _, prompt, completion = _chat(_client(gw), "A prefill on one worker, the decode on another.", stream=True)
        samples = scrape_until(gw.url, "dgw_requests_total", 1, status="200")
        prefill = {"model": MODEL, "pool": "prefill", "hardware": "ascend950"}
        decode = {"model": MODEL, "pool": "decode", "hardware": "ascend950"}
        for name in ("dgw_time_to_first_token_seconds", "dgw_queue_time_seconds", "dgw_request_prompt_tokens"):
            assert total(samples, name + "_count", **prefill) == 1, name
            assert total(samples, name + "_count", **decode) == 0, name
        for name in ("dgw_request_duration_seconds", "dgw_request_generation_tokens"):
            assert total(samples, name + "_count", **decode) == 1, name
            assert total(samples, name + "_count", **prefill) == 0, name
        assert total(samples, "dgw_request_prompt_tokens_sum", **prefill) == prompt
        assert total(samples, "dgw_request_generation_tokens_sum", **decode) == completion
        assert total(samples, "dgw_inter_token_latency_seconds_count", **decode) >= 1
    finally:
        gw.stop()


# ------------------------------------------------------------------------------ reference

def test_docs_metrics_md_is_generated_from_the_registry() -> None:
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == render(), (
        "docs/metrics.md drifted from the registry: "
        "python -m deepinfer_gateway.gateway.telemetry.metrics_reference > docs/metrics.md")


def test_reference_lists_every_metric_a_live_gateway_exports(one_worker_gateway: Gateway,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    live = {name for name, _ in scrape(one_worker_gateway.url)}
    assert len(live) > 20 and live <= exposed_names(), sorted(live - exposed_names())
    metrics_reference.main()
    printed = capsys.readouterr().out
    for doc in metric_docs():
        assert f"| `{doc.name}` | {doc.type} |" in printed


def test_every_label_is_described_and_an_undescribed_one_fails() -> None:
    used = {label for d in metric_docs() for label in d.labels}
    assert used <= set(LABELS)
    assert set(REQUEST_LABELS) <= used
    registry = reference_registry()
    from prometheus_client import Counter

    Counter("dgw_probe", "a metric with a label the reference does not describe", ["colour"], registry=registry)
    with pytest.raises(ValueError, match="colour"):
        render(registry)


# ------------------------------------------------------------------------------ Grafana

def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


SELECTOR = re.compile(r"\b(dgw_[A-Za-z0-9_]+)(?:\{([^}]*)\})?")


def test_dashboard_has_model_pool_and_hardware_variables_from_labelled_metrics() -> None:
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    names = exposed_names()
    docs = {n: d for d in metric_docs() for n in d.series_names()}
    for label in REQUEST_LABELS:
        var = variables[label]
        assert var["type"] == "query" and var["includeAll"] and var["multi"]
        query = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"])
        assert query is not None, var["query"]
        metric, queried = query.groups()
        assert metric in names and queried == label and label in docs[metric].labels


def test_dashboard_panels_query_only_registry_metrics_and_their_labels() -> None:
    docs = {n: d for d in metric_docs() for n in d.series_names()}
    scrape_labels = {"instance", "job", "le"}
    exprs = _exprs(_dashboard())
    assert exprs
    for title, expr in exprs:
        for name, matchers in SELECTOR.findall(expr):
            assert name in docs, f"{title}: {name} is not in the registry"
            for label in re.findall(r"(\w+)\s*=~?", matchers or ""):
                assert label in docs[name].labels or label in scrape_labels, f"{title}: {name} has no {label}"
            # every per-request histogram follows the model/pool/hardware variables
            if set(REQUEST_LABELS) <= set(docs[name].labels):
                for label in REQUEST_LABELS:
                    assert f'{label}=~"${label}"' in matchers, f"{title}: {name} ignores ${label}"


RULES = ROOT / "deploy" / "prometheus" / "rules" / "dgw-alerts.yml"
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"')


def _rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("source", ["dashboard", "alert rules"])
def test_queries_match_and_group_by_labels_their_metrics_have(source: str) -> None:
    """A misspelt label in a matcher or a `by (...)` selects or groups nothing, silently:
    every label named is one of the queried metrics' own (or a scrape label), and a `reason`
    matcher names a V1Fallback value."""
    docs = {n: d for d in metric_docs() for n in d.series_names()}
    scrape_labels = {"instance", "job", "le"}
    exprs = _exprs(_dashboard()) if source == "dashboard" else _rule_exprs()
    assert exprs
    for title, expr in exprs:
        selectors = SELECTOR.findall(expr)
        if not selectors:
            continue  # up{job=...}: scrape-only
        have = scrape_labels.union(*(docs[name].labels for name, _ in selectors if name in docs))
        for name, matchers in selectors:
            for label, value in MATCHER.findall(matchers or ""):
                assert label in have, f"{title}: {name} has no {label}"
                if name.startswith("dgw_worker_v1_fallbacks") and label == "reason":
                    assert value in {r.value for r in V1Fallback}, f"{title}: no fallback reason {value}"
        for group in GROUPING.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                assert label in have, f"{title}: groups by {label}, which {sorted(have)} lack"


def test_dashboard_compares_ttft_p50_and_p99_by_hardware() -> None:
    exprs = [e for _, e in _exprs(_dashboard())]
    for quantile in ("0.5", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile}, sum by (le, hardware) "
                                f"(rate(dgw_time_to_first_token_seconds_bucket{{") for e in exprs), quantile

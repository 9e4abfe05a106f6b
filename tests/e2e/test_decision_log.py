"""The routing decision trace (`router.decision_log`): a real gateway in front of the sim cluster
writes one line per request, and bench/decision_report.py reads it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Gateway, SimCluster

REPORT = Path(__file__).resolve().parents[2] / "bench" / "decision_report.py"
KEY = "decision-log-admin"
KEYS_TOML = f"""
[[api_keys]]
name = "admin"
key_sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"
admin = true
"""


@pytest.fixture
def traced_gateway(sim_cluster: SimCluster, tmp_path: Path) -> Iterator[tuple[Gateway, Path]]:
    log = tmp_path / "decisions.jsonl"
    roles = [spec.split(":") for spec in sim_cluster.specs]
    gw = Gateway(tmp_path, [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml=f"{KEYS_TOML}[router]\ndecision_log = {json.dumps(str(log))}\n")
    try:
        gw.wait_ready(len(roles))
        yield gw, log
    finally:
        gw.stop()


def _wait_until_indexed(gw: Gateway, seconds: float = 10.0) -> None:
    """KV events reach the index after the reply: wait for them, or the next request's
    prediction races the event stream."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = httpx.get(gw.url + "/admin/index", headers={"authorization": f"Bearer {KEY}"}, timeout=5).json()
        if sum(w["memory_blocks"] for w in stats["workers"].values()) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the index knew no block {seconds}s after the first reply")


def test_each_request_leaves_its_decision_and_the_report_reads_them(traced_gateway: tuple[Gateway, Path]) -> None:
    gw, log = traced_gateway
    prompt = "the same long shared prefix " * 120
    usages = []
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        for i in range(3):
            reply = client.chat.completions.with_raw_response.create(
                model="DeepSeek-V4.1-Flash", max_tokens=4, messages=[{"role": "user", "content": prompt + str(i)}])
            usages.append((reply.headers["x-dgw-worker"], reply.parse().usage))
            _wait_until_indexed(gw)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3
    for line, (worker, usage) in zip(lines, usages, strict=True):
        assert usage is not None and usage.prompt_tokens_details is not None
        assert digest_of(line["worker"]) == worker and line["prompt_tokens"] == usage.prompt_tokens
        assert line["reported"]["memory"] + line["reported"]["store"] == usage.prompt_tokens_details.cached_tokens
        assert {digest_of(c["worker"]) for c in line["candidates"]} >= {worker} and len(line["candidates"]) == 3
        assert all(c["estimate_s"] is not None and c["estimate_s"] > 0 for c in line["candidates"])  # estimated_ttft
        assert 0 < line["queue_s"] <= line["first_token_s"] and line["loop_stall_s"] >= 0
        for c in line["candidates"]:  # one request at a time: nothing booked, the queue is the report's
            assert c["booked_tokens"] == 0 and c["reported_tokens"] == c["queued_tokens"]
            assert 0 <= c["load_age_s"] < 10
    assert lines[2]["predicted"]["memory"] > 0 and lines[2]["reported"]["memory"] > 0  # the shared prefix
    out = subprocess.run([sys.executable, str(REPORT), str(log), "--time-scale", "20"], capture_output=True,
                         text=True, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["decisions"] == 3 and sum(w["requests"] for w in summary["workers"].values()) == 3

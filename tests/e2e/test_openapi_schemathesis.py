"""schemathesis (PyPI) against the live `/openapi.json` of a gateway process in front of sim
workers: generated bodies (valid and invalid), and every answer checked against the document:
no server error, status codes, content types, bodies and headers as declared."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepinfer_gateway.gateway.serving.auth import hash_key
from harness.launch import Gateway, SimCluster

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance")
MAX_EXAMPLES = 10
ADMIN_KEY = "schemathesis-admin"


@pytest.fixture(scope="module")
def gateway(sim_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway of its own: the run adds and removes workers and switches routing policies."""
    roles = [spec.split(":") for spec in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("gw"),
                 [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml=f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{hash_key(ADMIN_KEY)}"\nadmin = true\n')
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


@pytest.mark.timeout(600)  # the run's own bound below: ~600 requests, generated and checked on the CPU
def test_the_live_schema_holds_for_generated_requests(gateway: Gateway, tmp_path: Path) -> None:
    st = Path(sys.executable).with_name("st")
    command = [str(st), "run", gateway.url + "/openapi.json", "--checks", CHECKS,
               "--max-examples", str(MAX_EXAMPLES), "--phases", "examples,coverage,fuzzing", "--seed", "23",
               "--request-timeout", "30", "-H", f"Authorization: Bearer {ADMIN_KEY}",
               "--no-color", "--generation-database", "none",
               "--report", "junit", "--report-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert summary is not None, run.stdout[-6000:]
    generated, passed = map(int, summary.groups())
    assert generated >= 500 and passed == generated, run.stdout[-6000:]
    assert "✅ Fuzzing" in run.stdout and "✅ Coverage" in run.stdout, run.stdout[-3000:]
    assert "Selected: 28/28" in run.stdout, run.stdout[-3000:]  # the conversations routes and cancel included
    assert "Authentication failed" not in run.stdout, run.stdout[-3000:]  # every route reached, admin too
    print(run.stdout[-2500:])  # the figures, under pytest -s


def test_count_tokens_refuses_what_its_schema_does_not_list(gateway: Gateway) -> None:
    """The schema says additionalProperties: false; the route used to count and ignore such a field."""
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}
    response = httpx.post(gateway.url + "/v1/messages/count_tokens", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 400
    assert response.json()["type"] == "error" and "bogus" in response.json()["error"]["message"]
    del body["bogus"]
    assert httpx.post(gateway.url + "/v1/messages/count_tokens", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["input_tokens"] > 0

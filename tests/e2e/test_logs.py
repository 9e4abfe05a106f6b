"""Structured JSON logs: request id in every line of a request, in the response header, at the worker."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deepinfer_gateway.gateway.telemetry.logs import (
    JsonFormatter,
    bound_request_id,
    configure_logging,
    valid_request_id,
)
from harness.launch import free_port, wait_for_port
from tests.fault_doubles import FaultyWorker


def test_json_formatter_carries_the_request_id_and_extra_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("dgw-test-json")
    log.addHandler(handler)
    log.propagate = False
    try:
        with bound_request_id("rid-1"):
            log.warning("worker %s failed", "w1", extra={"worker": "w1", "attempt": 2})
        log.error("outside")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("with traceback")
    finally:
        log.removeHandler(handler)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "worker w1 failed" and first["request_id"] == "rid-1"
    assert first["worker"] == "w1" and first["attempt"] == 2 and first["level"] == "warning"
    assert "request_id" not in second
    assert "ValueError: boom" in third["exc"]


def test_request_id_validation() -> None:
    assert valid_request_id("abc-123")
    assert not valid_request_id("")
    assert not valid_request_id(None)
    assert not valid_request_id("x" * 129)
    assert not valid_request_id("bad\nline")


def test_configure_logging_rejects_unknown_formats() -> None:
    with pytest.raises(ValueError):
        configure_logging("info", "xml")


def test_gateway_json_logs_end_to_end(tmp_path: Path) -> None:
    """`serve --log-format json`: access lines and request-path warnings are JSON with the request id."""
    bad = FaultyWorker("garbage-after", after=2)
    port = free_port()
    config = tmp_path / "gw.toml"
    config.write_text(f'port = {port}\n[health]\ninterval_s = 0.2\n[[workers]]\nurl = "{bad.url}"\n')
    log_path = tmp_path / "gw.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "deepinfer_gateway", "--log-level", "info",
                                 "--log-format", "json", "serve", "--config", str(config)],
                                stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if json.load(r)["healthy_workers"]:
                    break
            time.sleep(0.1)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", headers={"x-request-id": "req-json-42"},
            data=json.dumps({"model": "DeepSeek-V4.1-Flash", "stream": True, "max_tokens": 8,
                             "messages": [{"role": "user", "content": "hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["x-request-id"] == "req-json-42"
            body = r.read()
        assert b'"error"' in body
        time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        bad.stop()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert lines, log_path.read_text()[:2000]
    mine = [x for x in lines if x.get("request_id") == "req-json-42"]
    access = [x for x in mine if x["logger"] == "deepinfer_gateway.access"]
    assert len(access) == 1
    assert access[0]["status"] == 200 and access[0]["path"] == "/v1/chat/completions"
    assert access[0]["worker"] and access[0]["duration_ms"] > 0
    warnings = [x for x in mine if x["level"] == "warning"]
    assert warnings, mine  # the request path's "failed after the first token" line
    # Every line of the log is JSON (uvicorn's own lines included).
    assert all(line.startswith("{") for line in log_path.read_text().splitlines() if line.strip())

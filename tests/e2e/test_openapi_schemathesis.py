"""schemathesis (PyPI) against the live `/openapi.json` of a gateway process in front of sim
workers: generated bodies (valid and invalid), and every answer checked against the document:
no server error, status codes, content types, bodies and headers as declared."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from deepinfer_gateway.launch import Gateway

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance")
MAX_EXAMPLES = 10


def test_the_live_schema_holds_for_generated_requests(sim_gateway: Gateway, tmp_path: Path) -> None:
    st = Path(sys.executable).with_name("st")
    command = [str(st), "run", sim_gateway.url + "/openapi.json", "--checks", CHECKS,
               "--max-examples", str(MAX_EXAMPLES), "--phases", "examples,fuzzing", "--seed", "23",
               "--request-timeout", "30", "--no-color", "--generation-database", "none",
               # The admin routes change the shared test gateway's workers and policies.
               "--exclude-path-regex", "^/admin/",
               "--report", "junit", "--report-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    summary = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert summary is not None, run.stdout[-6000:]
    generated, passed = map(int, summary.groups())
    assert generated >= 50 and passed == generated, run.stdout[-6000:]
    assert "✅ Fuzzing" in run.stdout, run.stdout[-3000:]
    print(run.stdout[-2500:])  # the figures, under pytest -s

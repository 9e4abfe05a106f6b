"""The shipped alert rules, checked and unit-tested by the real promtool (Debian's
`prometheus` package, installed by the project's set-up; under CI=true it never skips)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules" / "dgw-alerts.yml"
RULE_TESTS = PROMETHEUS / "rules-tests" / "dgw-alerts-test.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool missing (system-packages.txt: prometheus); CI must never skip it")
        pytest.skip("promtool missing (system-packages.txt: prometheus)")
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=RULE_TESTS.parent)


def test_rules_pass_promtool_check() -> None:
    done = run("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_pass_their_unit_tests() -> None:
    done = run("test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert len(alerts) >= 10
    assert alerts - firing == set(), "alerts without a case where they fire"
    assert alerts - quiet == set(), "alerts without a case where they stay quiet"


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: the same file expecting DgwHighErrorRate where it must stay quiet."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(RULES)]
    quiet = next(c for t in tests["tests"] for c in t["alert_rule_test"]
                 if c["alertname"] == "DgwHighErrorRate" and not c["exp_alerts"])
    quiet["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    broken = tmp_path / "broken-test.yml"
    broken.write_text(yaml.safe_dump(tests))
    done = subprocess.run([promtool(), "test", "rules", str(broken)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "DgwHighErrorRate" in done.stdout + done.stderr

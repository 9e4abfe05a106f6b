"""The `deepinfer-gateway` command line as a user meets it: help, logging flags on either
side of the command, configuration errors (exit 2, one line, no traceback), and `serve`
configured by flags, the environment and a secrets directory in front of real sim workers."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deepinfer_gateway.process.cli import build_parser
from harness.launch import SimCluster, free_port, wait_for_healthy_workers, wait_for_port

CLI = [sys.executable, "-m", "deepinfer_gateway"]
MODEL = "DeepSeek-V4.1-Flash"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DGW_")}
    return {**env, **extra}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=60, env=env or clean_env(),
                          check=False)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


# ------------------------------------------------------------------------------ help

def test_top_level_help_is_written_for_users() -> None:
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for command in ("demo", "serve", "epp", "worker", "sim-cluster", "bench", "simulate", "warm-cache"):
        assert f"\n    {command} " in out.stdout, command
    assert "examples:\n  deepinfer-gateway demo" in out.stdout
    assert "docs/config.md" in out.stdout
    assert "Argument parsing only" not in out.stdout  # the module docstring is for developers


def test_every_flag_of_every_command_has_help_and_its_default() -> None:
    missing = []
    for path, parser in commands(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
                continue
            text = formatter._get_help_string(action) or ""
            has_default = "(default" in text or "(required" in text or action.required or not action.option_strings
            if not action.help or not has_default:
                missing.append(f"{' '.join(path) or '(top)'} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


@pytest.mark.parametrize("command",
                         ["demo", "serve", "epp", "worker", "sim-cluster", "bench", "simulate", "warm-cache"])
def test_each_command_prints_its_help(command: str) -> None:
    out = run_cli(command, "--help")
    assert out.returncode == 0 and "--log-level" in out.stdout and "(default:" in out.stdout, out.stderr


def test_logging_flags_go_before_or_after_the_command() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--log-level", "debug"]).log_level == "debug"
    assert parse(["--log-level", "warning", "serve"]).log_level == "warning"
    assert parse(["--log-level", "error", "serve", "--log-level", "DEBUG"]).log_level == "debug"
    assert parse(["serve"]).log_level == "info"
    assert parse(["worker", "--log-format", "json"]).log_format == "json"
    assert parse(["--log-format", "json", "worker"]).log_format == "json"


# ------------------------------------------------------------------------------ configuration errors

@pytest.mark.parametrize(("toml", "env", "line"), [
    ("port = 70000\n", {}, "config error: port: Input should be less than or equal to 65535"),
    ("prot = 8000\n", {}, "config error: prot: unknown setting"),
    ("port = \n", {}, "invalid TOML: Invalid value (at line 1, column 8)"),
    ('[router]\npolicy = "fastest"\n', {}, "config error: router.policy: unknown routing policy 'fastest'"),
    ('[router.pool_policies]\nagents = "fastest"\n', {},
     "config error: router.pool_policies.agents: unknown routing policy 'fastest'"),
    ('[router.policy]\nname = "estimated_ttft"\nguard_ratio = 0\n', {},
     "config error: router.policy.guard_ratio: Input should be greater than or equal to 1"),
    ("", {"DGW_ROUTER__DECODE_POLICY": "fastest"},
     "config error: router.decode_policy: unknown routing policy 'fastest'"),
    ("", {"DGW_WORKERS": "http://10.0.0.5:8100"}, "config error: workers: DGW_WORKERS is not valid JSON"),
    ("", {"DGW_PROCESSES": "many"}, 'config error: processes: expected a number of processes, or "auto"'),
    ("processes = 2\nredis.cluster = true\n", {}, "config error: redis.cluster: needs redis.url"),
    (None, {}, "no such file"),
])
def test_config_errors_exit_2_with_one_line_and_no_traceback(tmp_path: Path, toml: str | None,
                                                             env: dict[str, str], line: str) -> None:
    path = tmp_path / "gateway.toml"
    if toml is not None:
        path.write_text(toml)
    out = run_cli("serve", "--log-level", "debug", "--config", str(path), env=clean_env(**env))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = [text for text in out.stderr.splitlines() if text.startswith("config error: ")]
    assert len(errors) == 1 and line in errors[0], out.stderr
    if toml is None:
        assert errors[0] == f"config error: {path}: no such file"


def test_bad_flags_exit_2_with_usage() -> None:
    for args, message in [(["--worker-url", "gpu@http://10.0.0.5:8100"], "argument --worker-url"),
                          (["--policy", "fastest"], "argument --policy: invalid choice"),
                          (["--processes", "-1"], "argument --processes: '-1': expected a number of processes"),
                          (["--secrets-dir", "/nonexistent-dgw-secrets"], "config error: secrets_dir")]:
        out = run_cli("serve", *args)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------------------------ serve, end to end

class Served:
    """A `serve` child process; its stderr goes to a file (a long-lived pipe would fill)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(CLI + ["serve", "--port", str(self.port)] + args, env=env,
                                         stderr=stderr, start_new_session=True)
        wait_for_port(self.port, timeout=30)

    def wait_ready(self, healthy: int, timeout: float = 15.0) -> None:
        try:
            wait_for_healthy_workers(self.url, healthy, timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {self.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def worker_flags(cluster: SimCluster) -> list[str]:
    flags = []
    for spec, url in zip(cluster.specs, cluster.urls, strict=True):
        flags += ["--worker-url", f"{spec}@{url}"]
    return flags


def chat(url: str, key: str) -> str | None:
    with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30) as client:
        reply = client.chat.completions.create(model=MODEL, max_tokens=4,
                                               messages=[{"role": "user", "content": "hello"}])
    return reply.choices[0].message.content


def test_serve_with_worker_urls_and_an_api_key(sim_cluster: SimCluster, tmp_path: Path) -> None:
    served = Served(worker_flags(sim_cluster) + ["--api-key", "sk-cli-key", "--log-level", "debug",
                                                 "--policy", "round_robin"],
                    tmp_path / "serve.log", clean_env())
    try:
        served.wait_ready(len(sim_cluster.urls))
        assert chat(served.url, "sk-cli-key") is not None
        with pytest.raises(openai.AuthenticationError) as e:
            chat(served.url, "sk-other")
        assert e.value.status_code == 401
        without_key = urllib.request.Request(served.url + "/v1/chat/completions", method="POST",
                                             data=json.dumps({"model": MODEL, "messages": []}).encode(),
                                             headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(without_key, timeout=10)
        assert refused.value.code == 401 and "error" in json.load(refused.value)
    finally:
        served.stop()
    log = served.log.read_text()
    assert " DEBUG " in log  # --log-level after the command took effect
    assert "sk-cli-key" not in log


def test_serve_takes_keys_from_a_secrets_directory_and_settings_from_the_environment(
        sim_cluster: SimCluster, tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    records = [{"name": "ops", "key_sha256": hashlib.sha256(b"sk-ops").hexdigest(), "admin": True}]
    (secrets / "api_keys").write_text(json.dumps(records) + "\n")
    workers = [{"url": url, "role": spec.split(":")[0], "hardware": spec.split(":")[1]}
               for spec, url in zip(sim_cluster.specs, sim_cluster.urls, strict=True)]
    env = clean_env(DGW_SECRETS_DIR=str(secrets), DGW_WORKERS=json.dumps(workers),
                    DGW_ROUTER__POLICY="power_of_two", DGW_HEALTH__INTERVAL_S="0.2")
    served = Served(["--log-level", "warning"], tmp_path / "serve.log", env)
    try:
        served.wait_ready(len(workers))
        assert chat(served.url, "sk-ops") is not None
        with pytest.raises(openai.AuthenticationError):
            chat(served.url, "sk-cli-key")
        request = urllib.request.Request(served.url + "/admin/routing", headers={"Authorization": "Bearer sk-ops"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.load(r)["policy"] == "power_of_two"
    finally:
        served.stop()

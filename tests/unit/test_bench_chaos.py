"""The pure parts of bench/chaos.py: host plan, session trace, figures, compose parsing, the
client-side spread's choices."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _chaos_cluster as cluster
import _chaos_figures as figures
import _chaos_load as load
import _chaos_workload as workload
import _netns as netns

from deepinfer_gateway.loadgen.client import classify
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest

# ------------------------------------------------------------------ hosts

def test_plan_gives_each_host_a_namespace_and_an_address_of_the_run() -> None:
    hosts = netns.plan("dgwc42", ["client", "redis", "gw1"])
    assert [(h.netns, h.ip) for h in hosts.values()] == [
        ("dgwc42-client", "10.77.0.10"), ("dgwc42-redis", "10.77.0.11"), ("dgwc42-gw1", "10.77.0.12")]
    assert all(len(h.port_name) <= 15 for h in hosts.values())  # IFNAMSIZ


@pytest.mark.parametrize("names", [["a", "a"], ["sw"], ["Upper"], ["averyverylongname"], ["1st"]])
def test_plan_refuses_names_that_would_clash_or_not_fit(names: list[str]) -> None:
    with pytest.raises(ValueError):
        netns.plan("dgwc1", names)


def test_plan_refuses_a_run_name_the_sweep_would_not_recognise() -> None:
    with pytest.raises(ValueError):
        netns.plan("chaos", ["a"])


def test_hosts_file_names_every_host() -> None:
    text = netns.hosts_file(netns.plan("dgwc7", ["redis", "gw1"]).values())
    assert "10.77.0.10 redis\n" in text and "10.77.0.11 gw1\n" in text and text.startswith("127.0.0.1 localhost")


def test_stale_namespaces_are_those_of_runs_whose_process_is_gone() -> None:
    names = ["dgwc10-sw", "dgwc10-gw1", "dgwc11-sw", "other-ns", "dgwcx-sw"]
    assert netns.stale_namespaces(names, alive=lambda pid: pid == 11) == ["dgwc10-sw", "dgwc10-gw1"]
    assert netns.run_of("dgwc10-gw1") == 10 and netns.run_of("other-ns") is None


# ------------------------------------------------------------------ session trace

def test_a_follow_up_turn_extends_the_previous_turns_blocks() -> None:
    st = workload.session_trace(workload.SessionLoad(duration_s=10, session_interval_s=2, turns=3, turn_gap_s=3))
    requests = st.trace.requests
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(r.arrival_s < 10 for r in requests)
    for r in requests:
        previous = st.previous[r.index]
        if st.turn_of[r.index] == 0:
            assert previous is None
            continue
        assert previous is not None and st.turn_of[previous] == st.turn_of[r.index] - 1
        before = requests[previous].hash_ids
        assert before is not None and r.hash_ids is not None
        assert r.hash_ids[:len(before)] == before and len(r.hash_ids) == len(before) + 2  # answer + user blocks
        assert r.input_length == requests[previous].input_length + 256


def test_sessions_share_no_block() -> None:
    st = workload.session_trace(workload.SessionLoad(duration_s=6, session_interval_s=1.5, turns=1))
    firsts = [set(r.hash_ids or ()) for r in st.trace.requests]
    assert len(firsts) == 4 and all(not (a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:])


def test_segments_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="user_tokens"):
        workload.session_trace(workload.SessionLoad(duration_s=5, user_tokens=100))


# ------------------------------------------------------------------ figures

def _record(status: str = "ok", error: str | None = None, prompt: int | None = 100, http: int | None = None
            ) -> RequestRecord:
    return RequestRecord(index=0, arrival_s=0.0, status=status, error=error, prompt_tokens=prompt, http_status=http)


def test_outcomes_tell_answered_failed_and_lost_apart() -> None:
    records = [_record(), _record(prompt=None),  # a clean end without usage: not an answer
               _record("error", RecordError.HTTP_4XX, None, 401), _record("error", RecordError.STREAM, None),
               _record("error", RecordError.CONNECTION, None), _record("error", RecordError.CANCELLED, None),
               _record("error", RecordError.TIMEOUT, None)]
    t = figures.tally(records)
    assert (t.total, t.answered, t.failed, t.lost) == (7, 1, 3, 3)
    assert t.failed_by_kind == {"connection": 1, "http_4xx:401": 1, "stream": 1}


def _samples(rates: list[tuple[float, float]]) -> list[figures.HitSample]:
    return [figures.HitSample(t, int(rate * 1000), 1000) for t, rate in rates]


def test_recovery_is_where_the_windows_stay_within_tolerance() -> None:
    before = 0.8
    low, high = 0.3, 0.79  # 0.79 >= 0.9 * 0.8
    samples = _samples([(10 + 0.25 * k, low if k < 20 else high) for k in range(80)])  # recovers at 15 s
    assert figures.recovery_s(samples, 10, 30, before, window_s=2, step_s=0.5) == 5.0


def test_recovery_that_does_not_last_counts_from_the_last_recovery() -> None:
    pattern = [(10 + 0.25 * k, 0.79 if k < 8 or k >= 40 else 0.2) for k in range(80)]  # dips from 12 s to 20 s
    assert figures.recovery_s(_samples(pattern), 10, 30, 0.8, window_s=2, step_s=0.5) == 10.0


def test_no_recovery_by_the_end_of_the_phase_is_none() -> None:
    samples = _samples([(10 + 0.25 * k, 0.79 if k < 60 else 0.1) for k in range(80)])
    assert figures.recovery_s(samples, 10, 30, 0.8, window_s=2) is None
    assert figures.recovery_s([], 10, 30, 0.8, window_s=2) is None  # no answered follow-up at all


def test_a_window_without_answers_is_not_recovered() -> None:
    samples = _samples([(10 + 0.25 * k, 0.8) for k in range(8)] + [(25 + 0.25 * k, 0.8) for k in range(20)])
    assert figures.recovery_s(samples, 10, 30, 0.8, window_s=2, step_s=0.5) == 15.0  # answers again at 25 s


def test_hit_rate_weighs_by_prompt_tokens() -> None:
    assert figures.hit_rate([figures.HitSample(0, 90, 100), figures.HitSample(0, 0, 900)]) == 0.09
    assert figures.hit_rate([]) is None


# ------------------------------------------------------------------ shipped files

def test_compose_interpolation() -> None:
    env = {"PW": "s3cret", "EMPTY": ""}
    assert cluster.compose_expand("--requirepass ${PW}", env) == "--requirepass s3cret"
    assert cluster.compose_expand("${EMPTY:-x} ${MISSING-y} $PW $$HOME", env) == "x y s3cret $HOME"


COMPOSE = """
services:
  secrets:
    entrypoint: ["sh", "-c"]
    command:
      - |
        [ -s /run/s/pw ] || printf 'pw%s' $$((6*7)) > /run/s/pw
    volumes: ["vault:/run/s"]
  redis:
    command: ["sh", "-c", "exec docker-entrypoint.sh redis-server /etc/r.conf --requirepass \\"$$(cat /run/s/pw)\\""]
    volumes: ["./r.conf:/etc/r.conf:ro", "data:/data", "vault:/run/s:ro"]
  gateway-1:
    environment:
      DGW_REDIS__PASSWORD_FILE: /run/s/pw
      DGW_LOG_LEVEL: ${DGW_LOG_LEVEL:-info}
    volumes: ["vault:/run/s:ro"]
"""


def test_compose_paths_become_host_paths(tmp_path: Path) -> None:
    (tmp_path / "compose.yml").write_text(COMPOSE)
    compose = cluster.ComposeFile(tmp_path / "volumes", {"DGW_LOG_LEVEL": "warning"}, tmp_path / "compose.yml")
    vault = tmp_path / "volumes" / "vault"
    assert compose.environment("gateway-1") == {"DGW_REDIS__PASSWORD_FILE": f"{vault}/pw", "DGW_LOG_LEVEL": "warning"}
    assert dict(compose.mounts("redis")) == {"/etc/r.conf": tmp_path / "r.conf", "/data": tmp_path / "volumes" / "data",
                                            "/run/s": vault}
    assert compose.script("secrets").strip() == f"[ -s {vault}/pw ] || printf 'pw%s' $((6*7)) > {vault}/pw"
    script = cluster.redis_script(compose, "/usr/bin/redis-server", tmp_path / "d", tmp_path / "r.log")
    assert script == (f"cd {tmp_path}/d && exec /usr/bin/redis-server {tmp_path}/r.conf"
                      f' --requirepass "$(cat {vault}/pw)" --protected-mode no --logfile {tmp_path}/r.log')


def test_a_redis_command_without_redis_server_is_refused(tmp_path: Path) -> None:
    (tmp_path / "compose.yml").write_text('services:\n  redis:\n    command: ["valkey-server"]\n')
    compose = cluster.ComposeFile(tmp_path / "volumes", {}, tmp_path / "compose.yml")
    with pytest.raises(ValueError, match="redis-server"):
        cluster.redis_script(compose, "/usr/bin/redis-server", tmp_path, tmp_path / "log")


def test_the_shipped_compose_file_gives_redis_its_config_and_password(tmp_path: Path) -> None:
    compose = cluster.ComposeFile(tmp_path, {})
    script = cluster.redis_script(compose, "redis-server", tmp_path, tmp_path / "log")
    assert str(cluster.REPO / "deploy") in script
    assert "--user default off" in script and "--user gateway on" in script  # the ACL users, passwords from the vault
    assert compose.environment(cluster.GATEWAY_SERVICE)["DGW_REDIS__PASSWORD_FILE"].startswith(str(tmp_path))
    assert compose.environment(cluster.WORKER_SERVICE)["DGW_WORKER_TOKEN_FILE"].startswith(str(tmp_path))


# ------------------------------------------------------------------ load

class ConnectError(Exception):
    """Named as httpx's: a connection that could not be opened."""


class APIConnectionError(Exception):
    pass


def test_the_load_generator_tells_a_connection_never_opened_from_one_that_broke() -> None:
    try:
        try:
            raise ConnectError("refused")
        except ConnectError as inner:
            raise APIConnectionError("Connection error.") from inner
    except APIConnectionError as exc:
        assert classify(exc) == (RecordError.CONNECT, None)
    assert classify(ConnectError("refused")) == (RecordError.CONNECT, None)
    assert classify(APIConnectionError("reset after the request was sent")) == (RecordError.CONNECTION, None)


def test_spread_takes_the_least_busy_replica_and_skips_one_marked_down() -> None:
    spread = load.Spread([object(), object()])  # choices only: no request sent
    spread.inflight = [3, 1]
    assert spread._pick([]) == 1
    assert spread._pick([1]) == 0  # already tried: the other one
    spread.inflight = [0, 0]
    assert {spread._pick([]) for _ in range(4)} == {0, 1}  # ties taken in turn
    spread._failed(1)
    assert spread.down_until[1] == 0.0  # one failure: not yet
    spread._failed(1)
    assert spread.down_until[1] > 0 and all(spread._pick([]) == 0 for _ in range(3))
    spread._failed(0)
    spread._failed(0)
    assert spread._pick([]) in (0, 1)  # every replica down: tried anyway
    assert spread._pick([0, 1]) is None


def test_until_stopped_ends_the_iteration_once_stopped() -> None:
    stop = threading.Event()
    requests = [TraceRequest(i, float(i), 10, 1) for i in range(5)]
    trace = load.UntilStopped(requests, stop)
    seen = []
    for r in trace:
        seen.append(r.index)
        if r.index == 1:
            stop.set()
    assert seen == [0, 1] and len(trace) == 5 and trace[4] is requests[4]

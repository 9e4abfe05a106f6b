"""supervisor.py's pure parts: the process count, the restart backoff, and the refusal to
run several processes without anything to share their state through."""

from __future__ import annotations

import pytest

from deepinfer_gateway.config import ConfigError, GatewaySettings, RedisSettings
from deepinfer_gateway.infra import redis_process
from deepinfer_gateway.process.supervisor import MAX_RESTART_DELAY_S, Supervisor, resolve_processes, restart_delay_s


def test_auto_and_zero_mean_one_process_per_available_cpu() -> None:
    assert resolve_processes("auto", cpus=6) == 6
    assert resolve_processes(0, cpus=3) == 3
    assert resolve_processes(4, cpus=1) == 4  # a count is taken as given
    assert resolve_processes("auto") >= 1


def test_restart_backoff_is_immediate_once_then_doubles_to_a_cap() -> None:
    delays = [restart_delay_s(n) for n in range(1, 10)]
    assert delays[:5] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == MAX_RESTART_DELAY_S and delays == sorted(delays)


def test_several_processes_without_redis_or_a_server_binary_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_binary() -> str:
        raise redis_process.NoRedisServerBinary("none of redis-server, valkey-server is on the PATH")

    monkeypatch.setattr(redis_process, "redis_server_binary", no_binary)
    with pytest.raises(ConfigError) as e:
        Supervisor(GatewaySettings(processes=2), 2, log_level="info", log_format="text").run()
    ((where, reason),) = e.value.problems
    assert where == "processes" and "redis.url" in reason and "valkey-server" in reason


def test_several_processes_on_redis_cluster_need_its_url() -> None:
    with pytest.raises(ConfigError) as e:
        settings = GatewaySettings(processes=2, redis=RedisSettings(cluster=True))
        Supervisor(settings, 2, log_level="info", log_format="text").run()
    assert e.value.problems == [("redis.cluster", "needs redis.url")]


@pytest.mark.parametrize("value", [-1, "-2", "many", 1.5, True])
def test_the_processes_setting_takes_a_count_or_auto(value: object) -> None:
    with pytest.raises(ValueError, match="number of processes"):
        GatewaySettings(processes=value)
    assert GatewaySettings(processes=" AUTO ").processes == "auto"
    assert GatewaySettings(processes="3").processes == 3

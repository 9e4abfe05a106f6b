"""load_settings: every setting reachable from the environment (nested ones too), the
precedence of its sources, the secrets directory, and errors that name the field."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from deepinfer_gateway.config import (
    ConfigError,
    GatewaySettings,
    RedisSettings,
    RouterSettings,
    load_settings,
    reference,
    unknown_environment,
)
from deepinfer_gateway.config.policies import (
    CacheAwareConfig,
    EstimatedTtftConfig,
    LeastLoadConfig,
    PowerOfTwoConfig,
    PrefixApproxConfig,
    RoundRobinConfig,
    SessionAffinityConfig,
)
from deepinfer_gateway.config.reference import render


@pytest.fixture(autouse=True)
def _no_dgw_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees only the DGW_* variables it sets."""
    for name in list(os.environ):
        if name.upper().startswith("DGW_"):
            monkeypatch.delenv(name)
    yield


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(excinfo.value.problems)


def key_record(name: str, key: str, **fields: object) -> dict[str, object]:
    return {"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(), **fields}


# ------------------------------------------------------------------------------ environment

def test_environment_reaches_nested_and_list_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGW_ROUTER__POLICY", "round_robin")
    monkeypatch.setenv("DGW_ROUTER__POOL_POLICIES", '{"agents": "cache_aware"}')
    monkeypatch.setenv("DGW_MODEL_NAMES", '["a", "b"]')
    monkeypatch.setenv("DGW_TRACING__ENABLED", "true")
    monkeypatch.setenv("DGW_HEALTH__INTERVAL_S", "0.5")
    monkeypatch.setenv("DGW_IMAGES__ALLOW", '["10.0.0.0/8"]')
    monkeypatch.setenv("DGW_WORKERS", '[{"url": "http://10.0.0.5:8100/", "role": "prefill", "hardware": "ascend950"}]')
    monkeypatch.setenv("DGW_API_KEYS", json.dumps([key_record("ops", "k1", admin=True)]))
    monkeypatch.setenv("dgw_port", "9001")  # names are case-insensitive
    monkeypatch.setenv("DGW_TOKENIZER_PATH", "null")  # an optional setting back to none
    s = load_settings()
    assert s.router.policy == RoundRobinConfig() and s.router.pool_policies == {"agents": CacheAwareConfig()}
    assert s.router.decode_policy == RouterSettings().decode_policy  # the rest of the table keeps its defaults
    assert s.model_names == ("a", "b") and s.tracing.enabled is True and s.health.interval_s == 0.5
    assert s.images.allow == ("10.0.0.0/8",)
    (worker,) = s.workers
    assert (worker.url, str(worker.role), str(worker.hardware)) == ("http://10.0.0.5:8100", "prefill", "ascend950")
    assert s.api_keys[0].name == "ops" and s.api_keys[0].admin
    assert s.port == 9001 and s.tokenizer_path is None


def test_policies_as_names_or_tables_with_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = toml(tmp_path, '[router]\nsession_affinity = true\n'
                          '[router.policy]\nname = "estimated_ttft"\nstick_ratio = 2.0\n'
                          '[router.pool_policies.agents]\nname = "prefix_approx"\ncapacity = 500\n')
    s = load_settings(path)
    assert s.router.policy == EstimatedTtftConfig(stick_ratio=2.0) and s.router.decode_policy == LeastLoadConfig()
    assert s.router.pool_policies == {"agents": PrefixApproxConfig(capacity=500)}
    assert s.router.session_affinity == SessionAffinityConfig(enabled=True)
    monkeypatch.setenv("DGW_ROUTER__DECODE_POLICY", '{"name": "power_of_two", "choices": 3}')
    monkeypatch.setenv("DGW_ROUTER__POLICY__GUARD_TOKENS", "1000")  # one key of the file's table
    s = load_settings(path)
    assert s.router.decode_policy == PowerOfTwoConfig(choices=3)
    assert s.router.policy == EstimatedTtftConfig(stick_ratio=2.0, guard_tokens=1000)
    # serve --policy
    assert load_settings(path, {"router": {"policy": "round_robin"}}).router.policy == RoundRobinConfig()


def test_every_top_level_setting_has_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set each field from DGW_<FIELD> to a value other than its default; each must arrive."""
    defaults = GatewaySettings()
    values = {"host": "0.0.0.0", "port": "9", "processes": "auto", "model_names": '["m"]',
              "model_aliases": '{"x": "m"}',
              "tokenizer_path": "/t", "context_limit": "7", "max_body_bytes": "4096", "images": '{"max_images": 1}',
              "client_connections": '{"max_connections": 9}',
              "redis": '{"url": "redis://r:6379/0", "cluster": true}', "kv_writer_lease_s": "9",
              "workers": '[{"url": "http://w:1"}]', "discovery": '[{"name": "pool.example"}]', "max_attempts": "9",
              "router": '{"policy": "least_load"}', "flow_control": '{"enabled": true}',
              "session_capacity": '{"enabled": true}',
              "admin_keys_required": "false", "health": '{"interval_s": 9}', "connect_timeout_s": "9",
              "first_event_timeout_s": "9", "between_events_timeout_s": "9", "shutdown_delay_s": "9",
              "shutdown_grace_s": "9", "api_keys": json.dumps([key_record("a", "k")]), "api_keys_in_redis": "true",
              "allow_unauthenticated": "true",
              "log_format": "json", "access_log": "false", "tracing": '{"enabled": true}',
              "worker_token": "tok", "worker_token_file": "/run/secrets/worker-token",
              "responses": '{"max_per_key": 5}', "conversations": '{"max_per_key": 5}', "worker_protocol": "v1",
              "admin_worker_hosts": '["10.0.0.0/8"]', "metrics_port": "9100", "api_docs": "false"}
    assert set(values) == set(GatewaySettings.model_fields), "a new setting: add it here"
    for name, value in values.items():
        monkeypatch.setenv(f"DGW_{name.upper()}", value)
    s = load_settings()
    unchanged = [name for name in values if getattr(s, name) == getattr(defaults, name)]
    assert unchanged == []


def test_unknown_dgw_variables_warn_and_are_ignored(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DGW_PROT", "9000")  # a typo of DGW_PORT
    monkeypatch.setenv("DGW_LOG_LEVEL", "debug")  # the CLI's: no warning
    monkeypatch.setenv("DGW_CACHE_DIR", "/tmp")  # the start-up cache's: no warning
    with caplog.at_level(logging.WARNING, logger="deepinfer_gateway.config"):
        s = load_settings()
    assert s.port == 8000
    assert unknown_environment(os.environ) == ["DGW_PROT"]
    assert [r.getMessage() for r in caplog.records] == [
        "ignored environment variables, not settings (docs/config.md): DGW_PROT"]


def test_an_unknown_key_inside_a_setting_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGW_ROUTER__POLCY", "round_robin")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert problems(e) == {"router.polcy": "unknown setting (from DGW_ROUTER__POLCY)"}


def test_constructing_settings_directly_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only load_settings layers the environment in; GatewaySettings(...) is what it is given."""
    monkeypatch.setenv("DGW_PORT", "9001")
    assert GatewaySettings().port == 8000
    assert load_settings().port == 9001


# ------------------------------------------------------------------------------ precedence

def test_precedence_flags_over_environment_over_secrets_over_toml_over_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = toml(tmp_path, 'port = 1\nredis.url = "redis://toml:1"\nshutdown_grace_s = 5.0\n'
                          'context_limit = 11\n'
                          '[router]\npolicy = "round_robin"\ndecode_policy = "round_robin"\n')
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "redis").write_text('{"url": "redis://secret:1"}\n')
    (secrets / "context_limit").write_text("12")
    (secrets / "shutdown_grace_s").write_text("6")
    monkeypatch.setenv("DGW_PORT", "2")
    monkeypatch.setenv("DGW_ROUTER__POLICY", "least_load")
    monkeypatch.setenv("DGW_CONTEXT_LIMIT", "13")

    s = load_settings(path, secrets_dir=secrets)
    assert s.port == 2  # environment over TOML
    assert s.context_limit == 13  # environment over secrets
    assert s.redis.url == "redis://secret:1" and s.shutdown_grace_s == 6.0  # secrets over TOML
    assert (s.router.policy.name, s.router.decode_policy.name) == ("least_load", "round_robin")  # tables merge
    assert s.max_attempts == GatewaySettings().max_attempts  # nobody set it: the default

    flags = {"port": 3, "redis": {"url": None}, "router": {"policy": "power_of_two", "decode_policy": None}}
    s = load_settings(path, flags, secrets_dir=secrets)
    assert s.port == 3 and s.router.policy.name == "power_of_two"  # flags over everything
    assert s.redis.url == "redis://secret:1" and s.router.decode_policy.name == "round_robin"  # None: no flag


def test_loaded_settings_are_plain_frozen_gateway_settings(tmp_path: Path) -> None:
    s = load_settings(toml(tmp_path, "port = 1\n"))
    assert type(s) is GatewaySettings and s == GatewaySettings(port=1)
    with pytest.raises(ValidationError):
        s.port = 2  # type: ignore[misc]


# ------------------------------------------------------------------------------ secrets directory

def kubernetes_secret_volume(root: Path, files: dict[str, str]) -> Path:
    """A directory laid out as the kubelet mounts a Secret: each key a symlink into a
    timestamped directory through `..data`."""
    root.mkdir()
    stamped = root / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir()
    for name, text in files.items():
        (stamped / name).write_text(text)
    (root / "..data").symlink_to(stamped.name)
    for name in files:
        (root / name).symlink_to(f"..data/{name}")
    return root


def test_secrets_directory_supplies_api_keys_as_a_kubernetes_secret_mounts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = [key_record("team-a", "sk-a", models=["DeepSeek-V4.1-Flash"]), key_record("ops", "sk-ops", admin=True)]
    secrets = kubernetes_secret_volume(tmp_path / "secrets", {"api_keys": json.dumps(records, indent=2) + "\n"})
    path = toml(tmp_path, 'api_keys_in_redis = false\n[[api_keys]]\nname = "from-toml"\n'
                          f'key_sha256 = "{"0" * 64}"\n')

    by_argument = load_settings(path, secrets_dir=secrets)
    monkeypatch.setenv("DGW_SECRETS_DIR", str(secrets))
    by_environment = load_settings(path)
    for s in (by_argument, by_environment):
        assert [(k.name, k.key_sha256, k.models, k.admin) for k in s.api_keys] == [
            ("team-a", hashlib.sha256(b"sk-a").hexdigest(), ("DeepSeek-V4.1-Flash",), False),
            ("ops", hashlib.sha256(b"sk-ops").hexdigest(), (), True)]


def test_secrets_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(secrets_dir=tmp_path / "absent")
    assert problems(e) == {"secrets_dir": f"{tmp_path / 'absent'} is not a directory"}
    (tmp_path / "api_keys").write_text("[{not json")
    with pytest.raises(ConfigError) as e:
        load_settings(secrets_dir=tmp_path)
    assert problems(e) == {"api_keys": "the secrets directory's file api_keys is not valid JSON"}
    (tmp_path / "api_keys").write_text('[{"name": "k", "key_sha256": "abc"}]')
    with pytest.raises(ConfigError) as e:
        load_settings(secrets_dir=tmp_path)
    assert list(problems(e)) == ["api_keys[0].key_sha256"]


# ------------------------------------------------------------------------------ errors

@pytest.mark.parametrize(("text", "where", "reason"), [
    ("port = 70000\n", "port", "Input should be less than or equal to 65535 (got 70000)"),
    ("prot = 8000\n", "prot", "unknown setting"),
    ('[router]\npolicy = "fastest"\n', "router.policy", ("unknown routing policy 'fastest'; choose one of "
                                                        "cache_aware, estimated_ttft, least_load, power_of_two, "
                                                        "prefix_approx, round_robin")),
    ('[router]\ndecode_policy = "fastest"\n', "router.decode_policy", "unknown routing policy 'fastest'"),
    ('[router.pool_policies]\nagents = "fastest"\n', "router.pool_policies.agents",
     "unknown routing policy 'fastest'"),
    ('[router.policy]\nname = "estimated_ttft"\nstick_ratio = 0.5\n', "router.policy.stick_ratio",
     "Input should be greater than or equal to 1 (got 0.5)"),
    ('[router.policy]\nname = "least_load"\nstick_ratio = 2\n', "router.policy.stick_ratio", "unknown setting"),
    ('[router.policy]\nmin_match = 0.2\n', "router.policy", "a policy table needs a name: one of cache_aware, "),
    ('[router.pool_policies.agents]\nname = "prefix_approx"\ncapacity = 0\n', "router.pool_policies.agents.capacity",
     "Input should be greater than or equal to 1"),
    ('[router.session_affinity]\nenabled = true\nmax_queue_tokens = -1\n', "router.session_affinity.max_queue_tokens",
     "Input should be greater than or equal to 0"),
    ('[[workers]]\nurl = "10.0.0.5:8100"\n', "workers[0].url", "worker url must start with http:// or https://"),
    ("api_keys_in_redis = true\n", "api_keys_in_redis", "needs redis.url"),
    (f'[[api_keys]]\nname = "batch"\nkey_sha256 = "{"1" * 64}"\nservice_tier = "flex"\n', "api_keys",
     "service_tier of batch needs flow_control.enabled"),
    # two keys of one name (stored state was once the name's) or two records of one key
    (f'[[api_keys]]\nname = "a"\nkey_sha256 = "{"1" * 64}"\n[[api_keys]]\nname = "a"\nkey_sha256 = "{"2" * 64}"\n',
     "api_keys", "each key needs its own name; repeated: a"),
    (f'[[api_keys]]\nname = "a"\nkey_sha256 = "{"1" * 64}"\n[[api_keys]]\nname = "b"\nkey_sha256 = "{"1" * 64}"\n',
     "api_keys", "each key needs its own key_sha256; repeated: 1 digest(s)"),
    ('[[workers]]\nurl = "http://a:1"\nengine = "openai"\nrole = "prefill"\n', "workers[0]",
     "an openai worker serves whole requests"),
    ('[[workers]]\nurl = "http://a:1"\nengine = "vllm"\nkv_format = "deepseek-v4"\n', "workers[0]",
     'kv_format "vllm:..." belongs to vllm workers'),
    ('[[workers]]\nurl = "http://a:1"\nkv_format = "vllm:m:128"\n', "workers[0]",
     'kv_format "vllm:..." belongs to vllm workers'),
    # one variant per engine: a key of another engine is unknown
    ('[[workers]]\nurl = "http://a:1"\nmodel = "m"\n', "workers[0].model", "unknown setting"),
    ('[[workers]]\nurl = "http://a:1"\nengine = "openai"\nkv_events_topic = "t"\n', "workers[0].kv_events_topic",
     "unknown setting"),
    ('[[workers]]\nurl = "http://a:1"\nengine = "sglang"\n', "workers[0]", "Input tag 'sglang' found using"),
])
def test_bad_settings_name_the_field(tmp_path: Path, text: str, where: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(toml(tmp_path, text))
    assert list(problems(e)) == [where]
    assert problems(e)[where].startswith(reason)


def test_bad_files_and_environment_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path / "absent.toml")
    assert problems(e) == {str(tmp_path / "absent.toml"): "no such file"}
    with pytest.raises(ConfigError) as e:
        load_settings(toml(tmp_path, "port = \n"))
    assert problems(e) == {str(tmp_path / "gateway.toml"): "invalid TOML: Invalid value (at line 1, column 8)"}
    monkeypatch.setenv("DGW_WORKERS", "http://10.0.0.5:8100")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert problems(e) == {"workers": "DGW_WORKERS is not valid JSON"}
    monkeypatch.delenv("DGW_WORKERS")
    monkeypatch.setenv("DGW_PORT", "eighty")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert problems(e) == {"port": "Input should be a valid integer, unable to parse string as an integer "
                                   "(got 'eighty') (from DGW_PORT)"}


def test_a_plain_key_put_where_its_digest_belongs_stays_out_of_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGW_API_KEYS", '[{"name": "a", "key_sha256": "sk-live-1234"}]')
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert list(problems(e)) == ["api_keys[0].key_sha256"] and "sk-live-1234" not in str(e.value)


# ------------------------------------------------------------------------------ the [redis] section and its old keys

REDIS_TOML = ('[redis]\nurl = "redis://gateway@r:6379/0"\ncluster = true\npassword = "pw"\npassword_file = "/run/p"\n'
              'timeout_s = 2\n')
OLD_REDIS_TOML = ('redis_url = "redis://gateway@r:6379/0"\nredis_cluster = true\nredis_password = "pw"\n'
                  'redis_password_file = "/run/p"\nredis_timeout_s = 2\n')


def test_the_redis_section_from_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = toml(tmp_path, REDIS_TOML)
    assert load_settings(path).redis == RedisSettings(url="redis://gateway@r:6379/0", cluster=True, password="pw",
                                                      password_file="/run/p", timeout_s=2)
    monkeypatch.setenv("DGW_REDIS__TIMEOUT_S", "3")  # one key of the file's table
    s = load_settings(path)
    assert s.redis.timeout_s == 3 and s.redis.url == "redis://gateway@r:6379/0"


def test_old_flat_redis_keys_load_the_same_settings_and_warn_once(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    new = toml(tmp_path, REDIS_TOML)
    old = tmp_path / "old.toml"
    old.write_text(OLD_REDIS_TOML)
    with caplog.at_level(logging.WARNING, logger="deepinfer_gateway.config"):
        assert load_settings(new) == load_settings(old)
    assert [r.getMessage() for r in caplog.records] == [
        "renamed settings, read under their old names; use the new ones (docs/config.md): redis_url -> redis.url, "
        "redis_cluster -> redis.cluster, redis_password -> redis.password, redis_password_file -> "
        "redis.password_file, redis_timeout_s -> redis.timeout_s"]


def test_old_redis_variables_and_secret_files_still_read_at_their_rank(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = toml(tmp_path, '[redis]\nurl = "redis://file:1"\n')
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "redis_password").write_text("s3cret\n")
    monkeypatch.setenv("DGW_REDIS_URL", "redis://env:1")
    monkeypatch.setenv("DGW_REDIS_TIMEOUT_S", "4")
    with caplog.at_level(logging.WARNING, logger="deepinfer_gateway.config"):
        s = load_settings(path, secrets_dir=secrets)
    assert (s.redis.url, s.redis.timeout_s, s.redis.password) == ("redis://env:1", 4, "s3cret")  # env over the file
    assert unknown_environment(os.environ) == []  # an old name is no unknown variable
    assert caplog.records[-1].getMessage().endswith(
        "DGW_REDIS_URL -> DGW_REDIS__URL, DGW_REDIS_TIMEOUT_S -> DGW_REDIS__TIMEOUT_S, "
        'secrets file redis_password -> secrets file redis holding {"password": ...}')
    assert load_settings(path, {"redis": {"url": "redis://flag:1"}}).redis.url == "redis://flag:1"  # a flag over both
    monkeypatch.setenv("DGW_REDIS_TIMEOUT_S", "-1")  # a bad value names the variable it came from
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert problems(e) == {"redis.timeout_s": "Input should be greater than 0 (got '-1') (from DGW_REDIS_TIMEOUT_S)"}


def test_one_source_giving_a_setting_under_both_names_is_an_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(toml(tmp_path, 'redis_url = "redis://a:1"\n[redis]\nurl = "redis://b:1"\n'))
    assert problems(e) == {"redis.url": "also given as redis_url, its old name: keep redis.url"}
    monkeypatch.setenv("DGW_REDIS_URL", "redis://a:1")
    monkeypatch.setenv("DGW_REDIS__URL", "redis://b:1")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert problems(e) == {"redis.url": "also given as redis_url, its old name: keep redis.url"}


# ------------------------------------------------------------------------------ generated reference

def test_docs_config_md_is_generated_from_the_settings_models() -> None:
    committed = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    assert committed == render(), (
        "docs/config.md drifted from the settings models: "
        "python -m deepinfer_gateway.config.reference > docs/config.md")


def test_the_reference_names_every_setting_with_its_variable() -> None:
    text = render()
    for name, field in GatewaySettings.model_fields.items():
        assert f"| `{name}` |" in text and f"`DGW_{name.upper()}`" in text and str(field.description) in text
    for name in RouterSettings.model_fields:
        assert f"| `router.{name}` |" in text and f"`DGW_ROUTER__{name.upper()}`" in text


def test_a_setting_without_a_description_stops_the_generator() -> None:
    from pydantic import BaseModel

    class Undocumented(BaseModel):
        documented: int = Field(1, description="Has one.")
        bare: int = 2

    with pytest.raises(ValueError, match=r"bare has no description"):
        list(reference._sections(Undocumented, ()))

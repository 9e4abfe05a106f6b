"""Loading the settings models (models.py) from their sources.

`load_settings` layers its sources, highest first: explicit overrides (the CLI flags),
`DGW_*` environment variables, files in the secrets directory, the TOML file, defaults.
Every setting has an environment variable: `DGW_<FIELD>`, nested fields joined by `__`
(`DGW_ROUTER__POLICY=round_robin`), lists and tables as JSON
(`DGW_MODEL_NAMES='["a","b"]'`, `DGW_WORKERS='[{"url": "http://10.0.0.5:8100"}]'`).
Problems come back as one `ConfigError` naming each field (and the variable it came from);
unknown `DGW_*` names draw a warning. A setting that moved into a section is still read under
its old name, with a warning (renamed.py).
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from deepinfer_gateway.config.models import GatewaySettings, WorkerEngine
from deepinfer_gateway.config.policies import POLICIES
from deepinfer_gateway.config.renamed import RENAMED, GivenTwice, into_sections, new_name

log = logging.getLogger(__name__)

ENV_PREFIX = "DGW_"
ENV_NESTED_DELIMITER = "__"
SECRETS_DIR_ENV = "DGW_SECRETS_DIR"
# DGW_* variables that other parts of the program read; any other DGW_* name that is no
# setting draws a warning (a typo must not pass silently, an unrelated tool's variable must
# not stop the gateway).
PROCESS_ENV = frozenset({"DGW_LOG_LEVEL", SECRETS_DIR_ENV, "DGW_CACHE_DIR", "DGW_PREPARE_OFFLOAD", "DGW_TRACE_MIRROR"})


class ConfigError(ValueError):
    """Settings that cannot be loaded: each problem as (where, reason)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{where}: {reason}" for where, reason in problems))


class _Layered(BaseSettings, GatewaySettings):
    """GatewaySettings read from the environment, the secrets directory and TOML data."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER,
                                      env_parse_none_str="null", extra="forbid", frozen=True)

    # The old names of settings now in a section (renamed.py), declared so that every source
    # reads them; _Renamed moves each into its section, so they stay None here.
    redis_url: Any = None
    redis_cluster: Any = None
    redis_password: Any = Field(None, repr=False)
    redis_password_file: Any = None
    redis_timeout_s: Any = None


assert set(RENAMED) <= set(_Layered.model_fields), "declare each renamed key on _Layered"


class _Renamed(PydanticBaseSettingsSource):
    """A source with the old keys it gives moved into their sections (renamed.py); each old
    name found is added to `found` as (old, new), spelled as `name` spells a key in that source."""

    def __init__(self, source: PydanticBaseSettingsSource, found: list[tuple[str, str]],
                 name: Callable[[str], str] = str):
        super().__init__(source.settings_cls)
        self.source, self.found, self.name = source, found, name

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.source.get_field_value(field, field_name)

    def _set_current_state(self, state: dict[str, Any]) -> None:
        self.source._set_current_state(state)

    def _set_settings_sources_data(self, states: dict[str, dict[str, Any]]) -> None:
        self.source._set_settings_sources_data(states)

    def __call__(self) -> dict[str, Any]:
        values, old = into_sections(self.source())
        self.found += [(self.name(key), self.name(new_name(key))) for key in old]
        return values


def _env_spelling(key: str) -> str:
    """A key as its environment variable: `redis.url` -> DGW_REDIS__URL."""
    return env_name(*key.split("."))


def _secret_spelling(key: str) -> str:
    """A key as the secrets directory holds it: a file per top-level setting, a section as JSON."""
    section, _, inner = key.partition(".")
    return f'secrets file {section} holding {{"{inner}": ...}}' if inner else f"secrets file {key}"


def _layers(toml: dict[str, Any], secrets_dir: Path | None, found: list[tuple[str, str]]) -> type[_Layered]:
    """The sources, highest first: init arguments (CLI flags), DGW_* environment, secrets, TOML."""

    class Layers(_Layered):
        @classmethod
        def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                       env_settings: PydanticBaseSettingsSource,
                                       dotenv_settings: PydanticBaseSettingsSource,
                                       file_secret_settings: PydanticBaseSettingsSource,
                                       ) -> tuple[PydanticBaseSettingsSource, ...]:
            # Secret files are named after the field alone (`api_keys`), as a Kubernetes
            # Secret's keys are, not after the environment variable.
            secrets = ((_Renamed(SecretsSettingsSource(settings_cls, secrets_dir=secrets_dir, env_prefix=""), found,
                                 _secret_spelling),)
                       if secrets_dir else ())
            return (_Renamed(init_settings, found), _Renamed(env_settings, found, _env_spelling), *secrets,
                    _Renamed(InitSettingsSource(settings_cls, init_kwargs=toml), found))

    return Layers


def load_settings(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None, *,
                  secrets_dir: str | Path | None = None) -> GatewaySettings:
    """Settings from, highest first: `overrides` (None values skipped, nested tables merged),
    DGW_* environment, files in `secrets_dir` (default: $DGW_SECRETS_DIR), the TOML file at
    `path`, defaults. Raises ConfigError."""
    toml = _read_toml(Path(path)) if path else {}
    secrets = secrets_dir if secrets_dir is not None else os.environ.get(SECRETS_DIR_ENV) or None
    if secrets is not None and not Path(secrets).is_dir():
        raise ConfigError([("secrets_dir", f"{secrets} is not a directory")])
    unknown = unknown_environment(os.environ)
    if unknown:
        log.warning("ignored environment variables, not settings (docs/config.md): %s", ", ".join(unknown))
    found: list[tuple[str, str]] = []
    try:
        layered = _layers(toml, Path(secrets) if secrets else None, found)(**_without_none(overrides or {}))
    except ValidationError as e:
        raise ConfigError([_problem(error) for error in e.errors()]) from None
    except SettingsError as e:
        raise ConfigError([_settings_problem(e)]) from None
    except GivenTwice as e:
        raise ConfigError([(e.new, f"also given as {e.old}, its old name: keep {e.new}")]) from None
    finally:
        if found:
            log.warning("renamed settings, read under their old names; use the new ones (docs/config.md): %s",
                        ", ".join(f"{old} -> {new}" for old, new in dict.fromkeys(found)))
    return GatewaySettings.model_validate({name: value for name, value in layered if name not in RENAMED})


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """DGW_* variable names that name no setting and are not read elsewhere."""
    fields = {name.upper() for name in (*GatewaySettings.model_fields, *RENAMED)}
    unknown = []
    for name in environ:
        upper = name.upper()
        setting = upper.removeprefix(ENV_PREFIX).split(ENV_NESTED_DELIMITER, 1)[0]
        if upper.startswith(ENV_PREFIX) and upper not in PROCESS_ENV and setting not in fields:
            unknown.append(name)
    return sorted(unknown)


def env_name(*path: str) -> str:
    """The environment variable of a setting: env_name("router", "policy") == "DGW_ROUTER__POLICY"."""
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(path).upper()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([(str(path), "no such file")]) from None
    except OSError as e:
        raise ConfigError([(str(path), e.strerror or str(e))]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([(str(path), f"invalid TOML: {e}")]) from None


def _without_none(values: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides left unset (None) are no override; nested tables merge with the other sources."""
    out = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            value = _without_none(value)
        if value is not None and value != {}:
            out[key] = value
    return out


def _problem(error: Any) -> tuple[str, str]:
    loc = _without_policy_tag(error["loc"])
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if error["type"] == "extra_forbidden":
        reason = "unknown setting"
    else:
        reason = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        secret_ish = any(word in where for word in ("url", "key", "password", "token"))
        if isinstance(given, str | int | float) and len(repr(given)) <= 40 and not secret_ish \
                and repr(given) not in reason:
            reason += f" (got {given!r})"
    names = [str(part) for part in loc if not isinstance(part, int)]
    environ = _upper_environ()
    from_env = [env_name(*names[:n]) for n in range(len(names), 0, -1) if env_name(*names[:n]) in environ]
    from_env += [env_name(old) for old in RENAMED if new_name(old) == ".".join(names) and env_name(old) in environ]
    if from_env:
        reason += f" (from {from_env[0]})"
    if not where and ": " in reason:  # a model-level check names its field as "field: reason"
        where, reason = reason.split(": ", 1)
    return where or "settings", reason


def _without_policy_tag(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """pydantic puts a policy table's variant name in the error location
    (router.policy.estimated_ttft.stick_ratio), and a worker entry's engine (workers.0.vllm.url);
    the TOML key has none."""
    out: list[Any] = []
    for part in loc:
        in_policy = out[-1:] in (["policy"], ["decode_policy"]) or out[-2:-1] == ["pool_policies"]
        in_worker = out[:1] == ["workers"] and len(out) == 2 and isinstance(out[1], int)
        if not (part in POLICIES and in_policy and out[:1] == ["router"]) and not (in_worker and part in _ENGINES):
            out.append(part)
    return tuple(out)


_ENGINES = frozenset(str(engine) for engine in WorkerEngine)


def _upper_environ() -> set[str]:
    return {name.upper() for name in os.environ}


def _settings_problem(error: SettingsError) -> tuple[str, str]:
    """pydantic-settings reports a value it could not decode as JSON by field and source."""
    found = re.search(r'field "([^"]+)" from source "(\w+)"', str(error))
    if not found:
        return "settings", str(error)
    field, source = found.groups()
    if source == "EnvSettingsSource":
        return field, f"{env_name(field)} is not valid JSON"
    if source == "SecretsSettingsSource":
        return field, f"the secrets directory's file {field} is not valid JSON"
    return field, f"cannot decode the value from {source}"

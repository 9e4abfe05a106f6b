"""The gateway's settings, one package: the models (models.py) with the routing policies'
variants (policies.py), loading them from their sources (loading.py), the old names of
settings that moved into a section (renamed.py), and the generator of docs/config.md
(reference.py). The rest of the program imports its configuration from here.
"""

from deepinfer_gateway.config.flow import FlowControlSettings, ServiceTier
from deepinfer_gateway.config.loading import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    PROCESS_ENV,
    SECRETS_DIR_ENV,
    ConfigError,
    env_name,
    load_settings,
    unknown_environment,
)
from deepinfer_gateway.config.models import (
    DEFAULT_HARDWARE_COSTS,
    ApiKey,
    ClientConnectionSettings,
    DgwWorkerSpec,
    DiscoverySpec,
    GatewaySettings,
    HardwareCost,
    HealthSettings,
    ImageSettings,
    OpenAIWorkerSpec,
    RedisSettings,
    ResponsesSettings,
    RouterSettings,
    TracingSettings,
    VllmWorkerSpec,
    WorkerEngine,
    WorkerSpec,
    WorkerSpecVariant,
    parse_worker_spec,
)
from deepinfer_gateway.config.sessions import SessionCapacitySettings

__all__ = [
    "DEFAULT_HARDWARE_COSTS", "ENV_NESTED_DELIMITER", "ENV_PREFIX", "PROCESS_ENV", "SECRETS_DIR_ENV",
    "ApiKey", "ClientConnectionSettings", "FlowControlSettings", "ServiceTier", "SessionCapacitySettings",
    "ConfigError", "DiscoverySpec", "GatewaySettings", "HardwareCost",
    "HealthSettings", "ImageSettings", "RedisSettings", "ResponsesSettings", "RouterSettings", "TracingSettings",
    "WorkerEngine", "WorkerSpec", "WorkerSpecVariant", "DgwWorkerSpec", "VllmWorkerSpec", "OpenAIWorkerSpec",
    "parse_worker_spec", "env_name", "load_settings", "unknown_environment",
]

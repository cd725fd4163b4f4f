"""The gateway's settings: its one YAML file, validated into typed models, identified by its sha256 digest.

The ground floor of the gateway: nothing here imports the flow, the policies or the proxy. `base.py` (the model
base, `ConfigError`), `names.py` (the policy names a config may give, one registry per kind), `strict_yaml.py`
(the reader), `sections.py` (flowControl, saturation, usageLimit, eviction, admission, picker, ...),
`engine.py`, `pools.py` and `keys.py` (their sections), `document.py` (`GatewayConfig`, the whole file) and
`loading.py` (`LoadedConfig`: a validated file with its digest and resolved keys; `load_config`).
"""

from gateway.settings.base import ConfigError, SettingsModel
from gateway.settings.document import GatewayConfig
from gateway.settings.engine import EngineSettings, ReplicaEngine
from gateway.settings.loading import (DEFAULT_CONFIG_PATH, LoadedConfig, load_config, parse_config, with_admission,
                                      with_replicas)
from gateway.settings.pools import PoolSettings
from gateway.settings.sections import (Admission, BandSettings, Eviction, FlowControlSettings, Health, Metrics,
                                       Objective, Picker, Quota, Saturation, Upstream, UsageLimit)

__all__ = ["Admission", "BandSettings", "ConfigError", "DEFAULT_CONFIG_PATH", "EngineSettings", "Eviction",
           "FlowControlSettings", "GatewayConfig", "Health", "LoadedConfig", "Metrics", "Objective", "Picker",
           "PoolSettings", "Quota", "ReplicaEngine", "Saturation", "SettingsModel", "Upstream", "UsageLimit",
           "load_config", "parse_config", "with_admission", "with_replicas"]

"""The typed configuration of every command: options declared once (``options``), read from
flags, ``GOSSIPMESH_*`` variables and TOML files (``sources``) into one config per command
(``configs``)."""

from gossipmesh.config.configs import (
    DEFAULT_STEPS,
    Averaging,
    ConfigError,
    KeygenConfig,
    LocalSGD,
    MeshConfig,
    NodeConfig,
    Options,
    ReportConfig,
    SimulateConfig,
    TopologyConfig,
    TrainConfig,
)
from gossipmesh.config.sources import (
    CONFIG_ENV,
    ENV_PREFIX,
    add_options,
    as_flags,
    from_namespace,
    load,
    node_config,
    summary,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_STEPS",
    "ENV_PREFIX",
    "Averaging",
    "ConfigError",
    "KeygenConfig",
    "LocalSGD",
    "MeshConfig",
    "NodeConfig",
    "Options",
    "ReportConfig",
    "SimulateConfig",
    "TopologyConfig",
    "TrainConfig",
    "add_options",
    "as_flags",
    "from_namespace",
    "load",
    "node_config",
    "summary",
]

"""One typed argument set with PaddleNLP's key names, loaded from YAML plus `key=value` overrides."""
from .loader import (OVERRIDE, ConfigError, config_and_overrides, config_from_values, config_to_dict, load_config,
                     parse_overrides)
from .rl_config import RLConfig

__all__ = ["RLConfig", "ConfigError", "load_config", "parse_overrides", "OVERRIDE", "config_and_overrides",
           "config_to_dict", "config_from_values"]

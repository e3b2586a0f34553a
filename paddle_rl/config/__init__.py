"""One typed argument set with PaddleNLP's key names, loaded from YAML plus `key=value` overrides."""
from dataclasses import dataclass

from .algorithm_args import AlgorithmArgs
from .critic_args import CriticArgs
from .data_args import DataArgs
from .logging_args import LoggingArgs
from .model_args import ModelArgs
from .parallel_args import ParallelArgs
from .reward_args import RewardArgs
from .rollout_args import RolloutArgs
from .training_args import TrainingArgs


@dataclass
class RLConfig(ModelArgs, DataArgs, RolloutArgs, AlgorithmArgs, CriticArgs, RewardArgs, TrainingArgs, ParallelArgs,
               LoggingArgs):
    """Every key of a run. Groups live in *_args.py; each group validates its own keys in `_validate_<group>`."""


from .loader import ConfigError, check_paths, config_to_dict, load_config, parse_overrides  # noqa: E402

__all__ = ["RLConfig", "ConfigError", "load_config", "parse_overrides", "check_paths", "config_to_dict"]

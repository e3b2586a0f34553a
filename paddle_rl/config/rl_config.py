"""RLConfig: every key group of a run in one dataclass (the groups and their checks live in *_args.py)."""
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

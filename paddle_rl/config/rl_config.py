"""RLConfig: every key group of a run in one dataclass (the groups and their checks live in *_args.py).

Each group declares its keys (type, default, help, choices, spellings: fields.py) and checks its own keys in one
method; the loader runs the RESOLVERS (keys whose value, left unset, follows from others; each writes only its
own keys) and then the CHECKS, listed here, in order. A check reads and reports, never writes. What concerns
keys of several groups is resolved and checked here, naming every group it reads.

Options of the algorithm's registered pieces (estimators, losses, KL estimators, aggregations) and of the reward
rules are checked where those pieces are registered, when the Objective and the reward are built (before any
model loads): the registries declare which options each piece reads.
"""
import logging
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

logger = logging.getLogger("paddle_rl")


@dataclass
class RLConfig(ModelArgs, DataArgs, RolloutArgs, AlgorithmArgs, CriticArgs, RewardArgs, TrainingArgs, ParallelArgs,
               LoggingArgs):
    """Every key of a run."""

    # ---------------------------------------------------------------- across groups
    def _resolve_precision_dtypes(self, given) -> None:
        """rollout_dtype and save_dtype auto (rollout, training) follow bf16 (model)."""
        if self.rollout_dtype == "auto":
            self.rollout_dtype = "bfloat16" if self.bf16 else "float32"
        elif self.bf16 and self.rollout_dtype == "float32":
            logger.info("rollout_dtype: float32 with bf16: true: the rollout decodes in float32, training runs in "
                        "bf16 (the rollout's log-probs then differ from the trainer's by the bf16 rounding)")
        if self.save_dtype == "auto":
            self.save_dtype = "bfloat16" if self.bf16 else "float32"

    def _check_across(self, errors) -> None:
        """Keys of several groups together."""
        # algorithm x rollout
        if self.enable_overlong_reward_buffer and self.overlong_reward_buffer > self.max_dec_len:
            errors.append(f"overlong_reward_buffer: {self.overlong_reward_buffer} exceeds max_dec_len "
                          f"{self.max_dec_len}")
        if self.rollout_correction and self.reuse_rollout_logprobs == "on":
            errors.append("reuse_rollout_logprobs: on makes the old log-probs the rollout's own, so rollout_is / "
                          "rollout_rs / rollout_token_veto_threshold would compare them with themselves; set it to "
                          "auto or off")
        if self.async_rollout and self.dynamic_sampling:
            errors.append("async_rollout: not with dynamic_sampling (its extra generation rounds wait on the "
                          "rewards of the round before)")
        # training x data / rollout
        total = self.max_prompt_len + self.max_dec_len
        if self.max_length > 0 and total > self.max_length:
            errors.append(f"max_length: {self.max_length} is shorter than max_prompt_len ({self.max_prompt_len}) + "
                          f"max_dec_len ({self.max_dec_len}) = {total}; raise max_length or set it to -1")
        # training x parallel
        if self.use_remove_padding and self.pipeline_parallel_degree > 1:
            errors.append("use_remove_padding: packed micro-batches are not supported with pipeline_parallel_degree "
                          f"{self.pipeline_parallel_degree} (the stages exchange padded activations); set it to false")

    @property
    def resolved_loss_scale_factor(self) -> float:
        """loss_scale_factor (algorithm), default max_dec_len (rollout)."""
        return float(self.max_dec_len if self.loss_scale_factor is None else self.loss_scale_factor)


# run by the loader in this order (explicit: nothing is found by its name)
RLConfig.RESOLVERS = (CriticArgs._resolve_critic, RewardArgs._resolve_reward_model,
                      ParallelArgs._resolve_sharding_degree, RLConfig._resolve_precision_dtypes)
RLConfig.CHECKS = (ModelArgs._validate_model, DataArgs._validate_data, RolloutArgs._validate_rollout,
                   AlgorithmArgs._validate_algorithm, AlgorithmArgs._validate_rollout_correction,
                   CriticArgs._validate_critic, RewardArgs._validate_reward, TrainingArgs._validate_training,
                   ParallelArgs._validate_parallel, LoggingArgs._validate_logging, RLConfig._check_across)

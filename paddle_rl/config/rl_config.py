"""RLConfig: every key group of a run in one dataclass (the groups and their checks live in *_args.py).

Each group declares its keys (type, default, help, choices, spellings: fields.py) and checks its own keys in one
method; the loader runs the RESOLVERS (keys whose value, left unset, follows from others; each writes only its
own keys) and then the CHECKS, listed here, in order. A check reads and reports, never writes. What concerns
keys of several groups is resolved and checked here, naming every group it reads.

The keys the algorithm's registered pieces read (estimators, policy losses, aggregation modes: `grpo_eps`,
`gamma`, `clip_range_ratio_low`, ...), and those the built-in reward rules read (`cosine_max_len`,
`repetition_n_grams`, ...), are no group's fields: each piece declares them where it registers
(options.py), the loader reads them from that registry, RLConfig answers them (`config.gamma`), and their declared
checks run here with the groups' (`_check_declared`). The names a config chooses (advantage_estimator,
policy_loss, ...) and the reward rules' names are checked by their registries when the Objective and the reward
are built (before any model loads).
"""
import dataclasses
import logging
from dataclasses import dataclass

from .algorithm_args import AlgorithmArgs
from .critic_args import CriticArgs
from .data_args import DataArgs
from .logging_args import LoggingArgs
from .fields import ALIASES, declared_errors
from .model_args import ModelArgs
from .options import PIECE_OPTIONS
from .parallel_args import ParallelArgs
from .precision_args import PrecisionArgs
from .reward_args import RewardArgs
from .rollout_args import RolloutArgs
from .training_args import TrainingArgs

logger = logging.getLogger("paddle_rl")


@dataclass
class RLConfig(ModelArgs, PrecisionArgs, DataArgs, RolloutArgs, AlgorithmArgs, CriticArgs, RewardArgs, TrainingArgs,
               ParallelArgs, LoggingArgs):
    """Every key of a run: the groups' fields, and the options of registered pieces (options.py), which a config
    holds as attributes once a file sets them and answers with their declared default before."""

    def __getattr__(self, name):   # only for a name that is no field and was not set
        declared = PIECE_OPTIONS.get(name)
        if declared is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return declared.default

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
        # precision x model / rollout
        if self.fp16 and self.bf16:
            errors.append("fp16: true with bf16: true; choose one half precision (bf16 keeps float32's range and "
                          "needs no loss scaling, fp16 has 3 more bits of mantissa)")
        if self.fp16 and self.rollout_dtype == "bfloat16":
            errors.append("rollout_dtype: bfloat16 with fp16: true; the fp16 run's rollout decodes in float32 "
                          "(rollout_dtype auto or float32)")
        # model x parallel
        if "enable_release_grads" in self.sharding_options and not self.release_grads:
            errors.append("sharding_parallel_config: enable_release_grads frees the gradients after each step, and "
                          "release_grads: false keeps them; set one of them differently")
        # training x parallel
        if self.use_remove_padding and self.pipeline_parallel_degree > 1:
            errors.append("use_remove_padding: packed micro-batches are not supported with pipeline_parallel_degree "
                          f"{self.pipeline_parallel_degree} (the stages exchange padded activations); set it to false")
        if self.context_parallel_degree > 1 and self.share_prompt_prefix and not self.use_remove_padding:
            errors.append(f"context_parallel_degree {self.context_parallel_degree} with share_prompt_prefix: true on "
                          "padded micro-batches: the shared-prompt pass hands each prompt's last hidden state and keys "
                          "to a second pass, which a split of the tokens does not; set share_prompt_prefix: false, or "
                          "use_remove_padding: true (packing shares each prompt in one pass)")

    def _check_declared(self, errors) -> None:
        """The checks declared beside keys (fields.arg's `check`): the options of registered pieces, and any group
        field that declares one."""
        for f in dataclasses.fields(RLConfig):
            errors += declared_errors(f.name, getattr(self, f.name), self, f.metadata)
        for declared in PIECE_OPTIONS:
            errors += declared.errors(self)


# run by the loader in this order (explicit: nothing is found by its name)
RLConfig.RESOLVERS = (CriticArgs._resolve_critic, RewardArgs._resolve_reward_model,
                      ParallelArgs._resolve_sharding_degree, RLConfig._resolve_precision_dtypes)
RLConfig.CHECKS = (ModelArgs._validate_model, PrecisionArgs._validate_precision, DataArgs._validate_data, RolloutArgs._validate_rollout,
                   AlgorithmArgs._validate_algorithm, RLConfig._check_declared,
                   AlgorithmArgs._validate_rollout_correction, CriticArgs._validate_critic, RewardArgs._validate_reward,
                   TrainingArgs._validate_training, ParallelArgs._validate_parallel, LoggingArgs._validate_logging,
                   RLConfig._check_across)
PIECE_OPTIONS.group_keys = frozenset(f.name for f in dataclasses.fields(RLConfig)) | frozenset(
    alias for f in dataclasses.fields(RLConfig) for alias in f.metadata.get(ALIASES, ()))

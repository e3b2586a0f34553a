"""Other frameworks' spellings of a run, read as this suite's keys: ms-swift's `swift rlhf` arguments, verl's dotted
(Hydra) keys, and the `train.sh` flags of verl-based recipes (`--model --rollout_n --epochs --reward_func FILE`).

A config file, `key=value` overrides and `--key value` flags may each use them, mixed with this suite's own keys.
The loader calls `translate(raw, ours)` on everything it read before it reads any key: each foreign key becomes the
key (or keys) here that act the same, and a line names each translation (`num_generations 8 -> rollout_n 8`); a key
with no equivalent is named with what happens to it (ignored, with the reason) and one that would change the run
in a way this suite cannot is refused by name. A foreign key and a key of ours that both set the same thing to
different values is an error. The tables are the reference (docs/formats.md lists them).

Meanings (the peers' own documentation): ms-swift's GRPO arguments (TRL's GRPOConfig underneath); verl's
ppo_trainer.yaml; the recipes' train.sh defaults (configs/verl_train_sh.yaml holds them in verl's spelling).
"""
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .rl_config import RLConfig

# the roots of verl's config tree; a nested mapping under one of them is flattened into dotted keys
VERL_ROOTS = ("data", "actor_rollout_ref", "algorithm", "trainer", "critic", "reward_model", "custom_reward_function")

SWIFT, VERL, TRAIN_SH = "ms-swift", "verl", "train.sh"


class SpellingError(ValueError):
    """A foreign key that this suite refuses (the message names the key and why)."""


def _same(value):
    return value


def _paths(value) -> str:
    """Dataset files: a list (ms-swift, verl) as this suite's comma-separated string."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _true(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


@dataclass
class Translation:
    """What `translate` made of a raw config: the values in this suite's keys, and the lines to show."""
    values: Dict[str, Any]
    lines: List[str] = field(default_factory=list)      # "foreign value -> ours value"
    ignored: List[str] = field(default_factory=list)    # "foreign value: what happens"
    errors: List[str] = field(default_factory=list)


class _Work:
    """The foreign keys of one config being translated: rules pop what they read and set what they make."""

    def __init__(self, foreign: Dict[str, Tuple[str, Any]], given: Dict[str, Any]):
        self.foreign = foreign           # key -> (framework, value)
        self.given = given               # everything the config gave, in either spelling (earlier sources too)
        self.out: Dict[str, Any] = {}
        self.sources: Dict[str, str] = {}
        self.result = Translation({})

    def has(self, key: str) -> bool:
        return key in self.foreign

    def peek(self, key: str, default=None):
        return self.foreign[key][1] if key in self.foreign else default

    def pop(self, key: str, default=None):
        return self.foreign.pop(key)[1] if key in self.foreign else default

    def set(self, ours: str, value, source: str) -> None:
        if ours in self.out and self.out[ours] != value:
            self.result.errors.append(f"{source} sets {ours} to {value!r}, and {self.sources[ours]} to "
                                      f"{self.out[ours]!r}: give one")
            return
        self.out[ours], self.sources[ours] = value, source
        self.result.lines.append(f"{source} -> {ours} {_shown(value)}")

    def ignore(self, key: str, what: str) -> None:
        value = self.pop(key)
        self.result.ignored.append(f"{key} {_shown(value)}: {what}")

    def refuse(self, key: str, why: str) -> None:
        value = self.pop(key)
        self.result.errors.append(f"{key} {_shown(value)}: {why}")


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def _source(work: _Work, key: str) -> str:
    return f"{key} {_shown(work.peek(key))}"


# ------------------------------------------------------------------------------------------------ renames
# foreign key -> (our key, value conversion); a value passes through the key's own checks here

SWIFT_RENAMES: Dict[str, Tuple[str, Callable]] = {
    "model": ("actor_model_name_or_path", _same),
    "dataset": ("train_datasets", _paths),
    "num_generations": ("rollout_n", _same),
    "max_completion_length": ("max_dec_len", _same),
    "beta": ("kl_loss_coeff", _same),                 # TRL / ms-swift: the k3 estimator in the loss
    "epsilon": ("clip_range_ratio", _same),           # both sides unless epsilon_high
    "epsilon_high": ("clip_range_ratio_high", _same),
    "num_iterations": ("update_iters", _same),
    "dynamic_sample": ("dynamic_sampling", _same),
    "ref_model": ("reference_model_name_or_path", _same),
    "reward_model": ("reward_model_name_or_path", _same),
    "target_modules": ("lora_target_modules", _as_list),
    "async_generate": ("async_rollout", _same),
    "gradient_checkpointing": ("recompute", _same),
    "eval_strategy": ("evaluation_strategy", _same),
    "vllm_tensor_parallel_size": ("rollout_tensor_parallel_degree", _same),
    "sequence_parallel_size": ("context_parallel_degree", _same),   # Ulysses over the training passes
    "external_plugins": ("reward_plugins", _as_list),
}

VERL_RENAMES: Dict[str, Tuple[str, Callable]] = {
    "data.train_batch_size": ("global_batch_size", _same),
    "data.max_prompt_length": ("max_prompt_len", _same),
    "data.max_response_length": ("max_dec_len", _same),
    "data.prompt_key": ("prompt_key", _same),
    "data.shuffle": ("dataloader_shuffle", _same),
    "actor_rollout_ref.model.path": ("actor_model_name_or_path", _same),
    "actor_rollout_ref.model.lora_rank": ("lora_rank", _same),
    "actor_rollout_ref.model.lora_alpha": ("lora_alpha", _same),
    "actor_rollout_ref.model.target_modules": ("lora_target_modules", _as_list),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("recompute", _same),
    "actor_rollout_ref.model.use_remove_padding": ("use_remove_padding", _same),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("global_mini_batch_size", _same),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("per_device_train_batch_size", _same),
    "actor_rollout_ref.actor.ppo_epochs": ("update_iters", _same),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ("context_parallel_degree", _same),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": ("context_parallel_degree", _same),
    "critic.ulysses_sequence_parallel_size": ("context_parallel_degree", _same),
    "actor_rollout_ref.actor.clip_ratio": ("clip_range_ratio", _same),
    "actor_rollout_ref.actor.clip_ratio_low": ("clip_range_ratio_low", _same),
    "actor_rollout_ref.actor.clip_ratio_high": ("clip_range_ratio_high", _same),
    "actor_rollout_ref.actor.clip_ratio_c": ("clip_ratio_c", _same),
    "actor_rollout_ref.actor.entropy_coeff": ("entropy_coeff", _same),
    "actor_rollout_ref.actor.loss_agg_mode": ("loss_agg_mode", _same),
    "actor_rollout_ref.actor.grad_clip": ("max_grad_norm", _same),
    "actor_rollout_ref.actor.optim.lr": ("learning_rate", _same),
    "actor_rollout_ref.actor.optim.weight_decay": ("weight_decay", _same),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ("warmup_ratio", _same),
    "actor_rollout_ref.actor.optim.min_lr_ratio": ("min_lr_ratio", _same),
    "actor_rollout_ref.rollout.n": ("rollout_n", _same),
    "actor_rollout_ref.rollout.temperature": ("temperature", _same),
    "actor_rollout_ref.rollout.top_p": ("top_p", _same),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout_tensor_parallel_degree", _same),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("per_device_logprob_batch_size", _same),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("per_device_logprob_batch_size", _same),
    "algorithm.norm_adv_by_std_in_grpo": ("norm_adv_by_std", _same),
    "algorithm.kl_penalty": ("kl_penalty", _same),
    "algorithm.gamma": ("gamma", _same),
    "algorithm.lam": ("lam", _same),
    "algorithm.kl_ctrl.target_kl": ("kl_target", _same),
    "algorithm.kl_ctrl.horizon": ("kl_horizon", _same),
    "trainer.total_epochs": ("num_train_epochs", _same),
    "trainer.total_training_steps": ("max_steps", _same),
    "trainer.default_local_dir": ("output_dir", _same),
    "trainer.experiment_name": ("run_name", _same),
    "trainer.critic_warmup": ("critic_warmup_steps", _same),
    "critic.model.path": ("critic_model_name_or_path", _same),
    "critic.optim.lr": ("critic_learning_rate", _same),
    "critic.cliprange_value": ("clip_range_value", _same),
}

TRAIN_SH_RENAMES: Dict[str, Tuple[str, Callable]] = {
    "epochs": ("num_train_epochs", _same),
}

# verl's names of the KL estimators -> this suite's (docs/algorithms.md)
VERL_KL_TYPES = {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse", "low_var_kl": "low_var_kl",
                 "k3": "low_var_kl"}

# keys with no equivalent here: what happens to them (their value is not used)
NO_EQUIVALENT = {
    "vllm_gpu_memory_utilization": "vLLM's share of GPU memory: the rollout engine here sizes its KV cache itself; "
                                   "ignored",
    "vllm_max_model_len": "vLLM's context bound: the rollout engine here reads max_prompt_len + max_dec_len; ignored",
    "vllm_enable_prefix_caching": "the rollout engine here shares each prompt's KV cache among its samples "
                                  "always; ignored",
    "vllm_use_async_engine": "the rollout server here batches the requests waiting at each decode step; ignored",
    "vllm_enable_lora": "a LoRA run pushes its adapters to the rollout server, which folds them in; ignored",
    "vllm_max_lora_rank": "ignored (any rank folds in)",
    "sleep_level": "vLLM's sleep mode between rollouts; ignored",
    "offload_model": "moving the model off the GPU during the rollout; ignored",
    "offload_optimizer": "moving the optimizer off the GPU during the rollout; ignored",
    "move_model_batches": "vLLM's weight-loading batches; ignored (weights reach the rollout engine in memory)",
    "dataset_num_proc": "preprocessing processes; ignored (records are read once, in process)",
    "dataloader_num_workers": "data-loading workers; ignored (records are read once, in process)",
    "ddp_timeout": "ignored; collective_timeout bounds a collective here",
    "attn_impl": "ignored: the attention kernels are chosen per device here (use_custom_ops)",
    "logging_first_step": "ignored: step 1 is always logged, and metrics.jsonl has every step",
    "save_only_model": "ignored: checkpoints hold the optimizer state too, so that a resume is exact",
    "remove_unused_columns": "ignored: every field of a record reaches the rewards",
    "data.filter_overlong_prompts_workers": "ignored (records are read once, in process)",
    "data.return_raw_chat": "ignored: prompts are rendered once, by the rule of docs/formats.md",
    "actor_rollout_ref.rollout.name": "the inference engine (vllm / sglang): the suite's own engine generates; "
                                      "ignored",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "the inference engine's memory share; ignored",
    "actor_rollout_ref.rollout.enforce_eager": "ignored (no CUDA graphs here)",
    "actor_rollout_ref.rollout.free_cache_engine": "ignored: the KV cache is released after each rollout",
    "actor_rollout_ref.rollout.load_format": "ignored: weights reach the rollout engine in memory",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "ignored",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "ignored",
    "actor_rollout_ref.rollout.mode": "ignored: sync or async generation is async_rollout here",
    "actor_rollout_ref.actor.shuffle": "ignored: mini-batches follow the rollout's order",
    "actor_rollout_ref.actor.strategy": "FSDP or Megatron: the layouts here are the parallel degrees; ignored",
    "actor_rollout_ref.ref.strategy": "ignored (see actor_rollout_ref.actor.strategy)",
    "critic.strategy": "ignored (see actor_rollout_ref.actor.strategy)",
    "trainer.project_name": "ignored: run_name (trainer.experiment_name) names the run",
    "trainer.val_before_train": "evaluation at step 0 runs whenever do_eval is on; the value is ignored",
    "trainer.n_gpus_per_node": "processes come from the launcher here: paddle-rl train --nproc_per_node N; ignored",
    "trainer.nnodes": "nodes come from the launcher here (paddle.distributed.launch --nnodes); ignored",
    "trainer.device": "the device comes from the Paddle build and the launcher; ignored",
}

# boolean switches that do nothing when false and are refused when true (the feature does not exist here)
OFF_ONLY = {
    "actor_rollout_ref.actor.fsdp_config.param_offload": "parameter offload is not implemented",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "optimizer offload is not implemented",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "parameter offload is not implemented",
    "critic.model.fsdp_config.param_offload": "parameter offload is not implemented",
    "critic.model.fsdp_config.optimizer_offload": "optimizer offload is not implemented",
    "actor_rollout_ref.model.use_liger": "Liger kernels are not part of this suite",
    "use_liger_kernel": "Liger kernels are not part of this suite",
}

REFUSED = {
    "chord_sft_dataset": "CHORD (mixing SFT data into the RL loss) is not implemented; run paddle-rl sft first",
}


# ------------------------------------------------------------------------------------------------ joint rules

def _swift_rlhf_type(work: _Work) -> None:
    if not work.has("rlhf_type"):
        return
    kind = str(work.peek("rlhf_type")).lower()
    if kind in ("grpo", "ppo"):
        work.set("rl_algorithm", kind, _source(work, "rlhf_type"))
        work.pop("rlhf_type")
    else:
        work.refuse("rlhf_type", "this suite trains from rewards: grpo or ppo (preference methods such as dpo / "
                                 "kto are not here)")


def _swift_loss_type(work: _Work) -> None:
    """TRL's loss_type -> the aggregation (and for cispo / sapo the policy loss): grpo averages each sequence's tokens
    then the sequences, bnpo and dapo average every token of the batch, dr_grpo sums each sequence's tokens over
    max_completion_length."""
    if not work.has("loss_type"):
        return
    source = _source(work, "loss_type")
    kind = str(work.pop("loss_type")).lower()
    modes = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
             "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean", "sapo": "seq-mean-token-mean"}
    if kind not in modes:
        work.result.errors.append(f"{source}: one of {', '.join(modes)} here (real and fipo are not)")
        return
    work.set("loss_agg_mode", modes[kind], source)
    if kind in ("cispo", "sapo"):
        work.set("policy_loss", kind, source)
    if kind == "dr_grpo":   # TRL divides by max_completion_length (here loss_scale_factor; unset: the padded length)
        length = work.given.get("max_completion_length", work.given.get("max_dec_len", _default("max_dec_len")))
        work.set("loss_scale_factor", float(length), source)


def _swift_scale_rewards(work: _Work) -> None:
    if not work.has("scale_rewards"):
        return
    source = _source(work, "scale_rewards")
    value = work.pop("scale_rewards")
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        value = "group" if _true(value) else "none"
    work.set("scale_rewards", str(value).lower(), source)


def _swift_sequence_level(work: _Work) -> None:
    """importance_sampling_level: token (as here), sequence (GSPO: the policy loss gspo); top_entropy_quantile 1.0
    (every token, as here); truncation_strategy left (keep a prompt's end) or delete (drop the prompt)."""
    if work.has("importance_sampling_level"):
        level = str(work.peek("importance_sampling_level")).lower()
        if level == "token":
            work.ignore("importance_sampling_level", "token-level ratios, as here")
        elif level == "sequence":
            source = _source(work, "importance_sampling_level")
            work.pop("importance_sampling_level")
            work.set("policy_loss", "gspo", source)
        else:
            work.refuse("importance_sampling_level", "token or sequence (GSPO) here")
    if work.has("top_entropy_quantile"):
        if float(work.peek("top_entropy_quantile")) >= 1.0:
            work.ignore("top_entropy_quantile", "every token in the loss, as here")
        else:
            work.refuse("top_entropy_quantile", "a loss on the highest-entropy tokens only is not implemented")
    if work.has("truncation_strategy"):
        kind = str(work.peek("truncation_strategy")).lower()
        if kind in ("left", "delete"):
            source = _source(work, "truncation_strategy")
            work.pop("truncation_strategy")
            work.set("prompt_overflow", "truncate" if kind == "left" else "drop", source)
        else:
            work.refuse("truncation_strategy", "left (prompt_overflow truncate) or delete (drop) for GRPO")
    if work.has("vllm_data_parallel_size"):
        if int(work.peek("vllm_data_parallel_size")) == 1:
            work.ignore("vllm_data_parallel_size", "one engine, as here")
        else:
            work.refuse("vllm_data_parallel_size", "start one rollout server per replica and list them all in "
                                                   "rollout_server_urls")


def _swift_resample(work: _Work) -> None:
    """max_resample_times: the rounds after the first; max_gen_batches counts every round."""
    if work.has("max_resample_times"):
        source = _source(work, "max_resample_times")
        work.set("max_gen_batches", int(work.pop("max_resample_times")) + 1, source)


def _swift_dtype(work: _Work) -> None:
    if not work.has("torch_dtype"):
        return
    source = _source(work, "torch_dtype")
    dtype = str(work.peek("torch_dtype")).lower()
    if dtype in ("bfloat16", "bf16"):
        work.pop("torch_dtype")
        work.set("bf16", True, source)
    elif dtype in ("float16", "fp16", "half"):   # ms-swift trains float16 in mixed precision with loss scaling
        work.pop("torch_dtype")
        work.set("bf16", False, source)
        work.set("fp16", True, source)
    elif dtype in ("float32", "fp32", "auto"):
        work.pop("torch_dtype")
        work.set("bf16", False, source)
    else:
        work.refuse("torch_dtype", "bfloat16, float16 or float32")


def _swift_tuner(work: _Work) -> None:
    for key in ("tuner_type", "train_type"):
        if not work.has(key):
            continue
        kind = str(work.peek(key)).lower()
        if kind in ("lora", "full"):
            source = _source(work, key)
            work.pop(key)
            work.set("lora", kind == "lora", source)
        else:
            work.refuse(key, "lora or full (other tuners are not here)")


def _swift_deepspeed(work: _Work) -> None:
    if not work.has("deepspeed"):
        return
    source = _source(work, "deepspeed")
    stage = str(work.peek("deepspeed")).lower()
    if stage == "zero0":
        work.ignore("deepspeed", "no sharding, as without the key")
    elif stage in ("zero1", "zero2", "zero3"):
        work.pop("deepspeed")
        work.set("sharding", f"stage{stage[-1]}", source)
        work.set("sharding_parallel_degree", -1, source)
    else:
        work.refuse("deepspeed", "zero0, zero1, zero2 or zero3 (offload variants and DeepSpeed JSON files are not "
                                 "read here)")


def _swift_vllm(work: _Work) -> None:
    """use_vllm + vllm_mode: colocate generates in the trainer (the suite's own engine, inline); server generates on
    the servers at vllm_server_host:vllm_server_port (`paddle-rl rollout-server`)."""
    keys = ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_base_url")
    if not any(work.has(k) for k in keys):
        return
    source = " ".join(_source(work, k) for k in keys if work.has(k))
    use = _true(work.pop("use_vllm", False))
    mode = work.pop("vllm_mode", None)
    hosts = _as_list(work.pop("vllm_server_host", None))
    ports = _as_list(work.pop("vllm_server_port", 8000))
    urls = work.pop("vllm_server_base_url", None)
    if use and mode is None:
        work.result.errors.append(f"{source}: vllm_mode is required with use_vllm (colocate or server)")
        return
    mode = str(mode or "colocate").lower()
    if use and mode == "server" and urls:
        work.set("rollout_server_urls", [str(u).rstrip("/") for u in _as_list(urls)], source)
        return
    if use and mode == "server" and hosts == [None]:
        work.result.errors.append(f"{source}: server mode needs vllm_server_host (or vllm_server_base_url)")
        return
    if not use or mode == "colocate":
        work.result.ignored.append(f"{source}: generation runs inline, on the suite's own engine (as vLLM's "
                                   "colocate mode does in the trainer's processes)")
        return
    if mode != "server":
        work.result.errors.append(f"vllm_mode {mode}: colocate or server")
        return
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        work.result.errors.append(f"vllm_server_host / vllm_server_port: {len(hosts)} hosts and {len(ports)} ports")
        return
    work.set("rollout_server_urls", [f"http://{h}:{p}" for h, p in zip(hosts, ports)], source)


def _swift_datasets(work: _Work) -> None:
    if work.has("val_dataset"):
        source = _source(work, "val_dataset")
        work.set("eval_datasets", _paths(work.pop("val_dataset")), source)
        work.set("do_eval", True, source)


def _swift_system(work: _Work) -> None:
    """system: a system prompt, or a file holding one."""
    if not work.has("system"):
        return
    source = _source(work, "system")
    text = str(work.pop("system"))
    if text.endswith(".txt"):   # ms-swift: a .txt path is a file holding the system prompt
        if not os.path.isfile(text):
            work.result.errors.append(f"{source}: file not found")
            return
        with open(text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = text.replace("\\n", "\n")
    work.set("system_prompt", text, source)


SWIFT_MARKER = "rlhf_type"   # a command in ms-swift's spelling (swift rlhf --rlhf_type ...)

# The defaults of a framework whose spelling a config uses, where they differ from this suite's: applied to the
# keys the config leaves out (what a user of that framework expects), each named in the translation line as
# "ms-swift default -> key value". (our key, value, the keys that give it in either spelling)
SWIFT_DEFAULTS = (   # ms-swift's GRPO arguments (docs/source_en/Instruction/Command-line-parameters.md)
    ("lora", True, ("tuner_type", "train_type", "lora", "lora_rank")),
    ("lora_alpha", 32.0, ("lora_alpha",)),
    ("lora_dropout", 0.05, ("lora_dropout",)),
    ("kl_loss_coeff", 0.04, ("beta", "kl_loss_coeff")),
    ("temperature", 0.9, ("temperature",)),
    ("max_dec_len", 512, ("max_completion_length", "max_dec_len")),
    ("min_dec_len", 1, ("min_dec_len",)),
    ("num_train_epochs", 3.0, ("num_train_epochs",)),
    ("loss_agg_mode", "seq-mean-token-mean", ("loss_type", "loss_agg_mode")),   # loss_type grpo
    ("algorithm_preset", "trl", ("algorithm_preset",)),                          # std + 1e-4
    ("learning_rate", None, ("learning_rate",)),                                  # 1e-5; 1e-4 with LoRA
)
VERL_DEFAULTS = (    # verl's ppo_trainer.yaml
    ("temperature", 1.0, ("actor_rollout_ref.rollout.temperature", "temperature")),
    ("max_dec_len", 512, ("data.max_response_length", "max_dec_len")),
    ("min_dec_len", 1, ("min_dec_len",)),
    ("learning_rate", 1e-6, ("actor_rollout_ref.actor.optim.lr", "learning_rate")),
    ("algorithm_preset", "verl", ("algorithm_preset",)),
)


def _default(key: str):
    return RLConfig.__dataclass_fields__[key].default


def _swift_max_length(work: _Work, kept: Dict[str, Any]) -> None:
    """In an ms-swift command max_length bounds the prompt (ms-swift: "in GRPO max_length refers to
    max_prompt_length"); here max_length is the whole sequence's, so the value goes to max_prompt_len."""
    if "max_length" in kept:
        value = kept.pop("max_length")
        work.set("max_prompt_len", value, f"max_length {value} (ms-swift: the prompt's bound)")


def _framework_defaults(work: _Work, framework: str, table) -> None:
    """The framework's defaults for the keys a config in its spelling leaves out."""
    for key, value, keys in table:
        if not any(k in work.given for k in keys):
            if key == "learning_rate" and framework == SWIFT:
                value = 1e-4 if work.out.get("lora", work.given.get("lora")) else 1e-5   # ms-swift: 1e-4 with LoRA
            work.set(key, value, f"{framework} default")


def _swift_batches(work: _Work, given: Dict[str, Any], swift: bool) -> None:
    """TRL's batch arithmetic (one process here per rank): a generation holds per_device_train_batch_size x
    steps_per_generation x world completions (or generation_batch_size), an optimizer step per_device_train_batch_size
    x gradient_accumulation_steps x world; prompts are those over num_generations. This suite counts prompts:
    global_batch_size per generation, global_mini_batch_size per optimizer step."""
    keys = ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size")
    if not any(work.has(k) for k in keys) and not swift:
        return
    if "global_batch_size" in given and not any(work.has(k) for k in keys):
        return   # prompts per step given in this suite's terms
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")) or 1)
    micro = int(given.get("per_device_train_batch_size", 1 if swift else _default("per_device_train_batch_size")))
    n = int(given.get("rollout_n", _default("rollout_n")))
    source = " ".join(["ms-swift batch sizes:"] + [_source(work, k) for k in keys if work.has(k)]) + \
        f" (per_device_train_batch_size {micro}, {n} generations, {world} process{'es' if world > 1 else ''})"
    accumulation = int(work.pop("gradient_accumulation_steps", 1))
    steps = work.pop("steps_per_generation", None)
    generation = work.pop("generation_batch_size", None)
    per_step = micro * accumulation * world
    if generation is None:
        generation = micro * int(steps if steps is not None else accumulation) * world
    generation = int(generation)
    for what, count in (("an optimizer step", per_step), ("a generation", generation)):
        if count % n:
            work.result.errors.append(f"{source}: {what} holds {count} completions, not a multiple of "
                                      f"num_generations {n}")
            return
    if generation % per_step:
        work.result.errors.append(f"{source}: a generation of {generation} completions is not a whole number of "
                                  f"optimizer steps of {per_step}")
        return
    work.set("global_batch_size", generation // n, source)
    work.set("global_mini_batch_size", per_step // n, source)


def _verl_files(work: _Work) -> None:
    if work.has("data.train_files"):
        source = _source(work, "data.train_files")
        work.set("train_datasets", _paths(work.pop("data.train_files")), source)
    if work.has("data.val_files"):
        source = _source(work, "data.val_files")
        work.set("eval_datasets", _paths(work.pop("data.val_files")), source)
        work.set("do_eval", True, source)


def _verl_truncation(work: _Work) -> None:
    if work.has("data.filter_overlong_prompts"):
        source = _source(work, "data.filter_overlong_prompts")
        if _true(work.pop("data.filter_overlong_prompts")):
            work.set("prompt_overflow", "drop", source)
    if work.has("data.truncation"):
        kind = str(work.peek("data.truncation")).lower()
        if kind == "left":
            source = _source(work, "data.truncation")
            work.pop("data.truncation")
            work.set("prompt_overflow", "truncate", source)
        else:
            work.refuse("data.truncation", "left (keep a prompt's end: prompt_overflow truncate) is the cut here; "
                                           "or data.filter_overlong_prompts: true (prompt_overflow drop)")


def _verl_kl(work: _Work) -> None:
    """use_kl_loss + kl_loss_coef -> kl_loss_coeff; use_kl_in_reward + kl_ctrl.kl_coef (+ kl_ctrl.type) -> kl_coeff
    (and adaptive_kl); kl_loss_type in verl's names."""
    use, coef = "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef"
    if work.has(use) or work.has(coef):
        source = " ".join(_source(work, k) for k in (use, coef) if work.has(k))
        on = _true(work.pop(use, False))
        value = float(work.pop(coef, 0.001))      # verl's default coefficient
        work.set("kl_loss_coeff", value if on else 0.0, source)
    kind = "actor_rollout_ref.actor.kl_loss_type"
    if work.has(kind):
        name = str(work.peek(kind)).lower()
        if name in VERL_KL_TYPES:
            source = _source(work, kind)
            work.pop(kind)
            work.set("kl_loss_type", VERL_KL_TYPES[name], source)
        else:
            work.refuse(kind, f"one of {', '.join(VERL_KL_TYPES)} here")
    use, coef = "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef"
    if work.has(use) or work.has(coef):
        source = " ".join(_source(work, k) for k in (use, coef) if work.has(k))
        on = _true(work.pop(use, False))
        value = float(work.pop(coef, 0.001))
        work.set("kl_coeff", value if on else 0.0, source)
    if work.has("algorithm.kl_ctrl.type"):
        source = _source(work, "algorithm.kl_ctrl.type")
        work.set("adaptive_kl", str(work.pop("algorithm.kl_ctrl.type")).lower() == "adaptive", source)


def _verl_estimator(work: _Work) -> None:
    key = "algorithm.adv_estimator"
    if not work.has(key):
        return
    source = _source(work, key)
    name = str(work.pop(key)).lower()
    if name == "gae":
        work.set("rl_algorithm", "ppo", source)   # GAE with a critic: this suite's ppo preset
    else:
        work.set("advantage_estimator", name, source)


def _verl_policy_loss(work: _Work) -> None:
    key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    if work.has(key):
        source = _source(work, key)
        mode = str(work.pop(key)).lower()
        work.set("policy_loss", "ppo" if mode == "vanilla" else mode, source)


def _verl_schedule(work: _Work) -> None:
    for key in ("actor_rollout_ref.actor.optim.warmup_style", "actor_rollout_ref.actor.optim.lr_scheduler_type"):
        if work.has(key):
            source = _source(work, key)
            style = str(work.pop(key)).lower()
            # verl's constant schedule warms up first (lr_warmup_steps_ratio), then holds
            work.set("lr_scheduler_type", {"constant": "constant_with_warmup"}.get(style, style), source)
    key = "actor_rollout_ref.actor.optim.lr_warmup_steps"
    if work.has(key):
        source = _source(work, key)
        steps = int(work.pop(key))
        if steps >= 0:    # -1: the ratio decides
            work.set("warmup_steps", steps, source)


def _verl_top_k(work: _Work) -> None:
    key = "actor_rollout_ref.rollout.top_k"
    if work.has(key):
        source = _source(work, key)
        k = int(work.pop(key))
        work.set("top_k", max(k, 0), source)    # verl: -1 is off; here 0


def _verl_micro_tokens(work: _Work) -> None:
    use, tokens = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    if work.has(use) or work.has(tokens):
        source = " ".join(_source(work, k) for k in (use, tokens) if work.has(k))
        on = _true(work.pop(use, False))
        budget = int(work.pop(tokens, 16384))
        if on:
            work.set("max_tokens_per_micro_batch", budget, source)
        else:
            work.result.ignored.append(f"{source}: use_dynamic_bsz is false, so the token budget is not used")


def _verl_trainer(work: _Work) -> None:
    for key, ours, off in (("trainer.save_freq", "save_steps", ("save_strategy", "no")),
                           ("trainer.test_freq", "eval_steps", ("evaluation_strategy", "no"))):
        if work.has(key):
            source = _source(work, key)
            freq = int(work.pop(key))
            if freq > 0:
                work.set(ours, freq, source)
            else:
                work.set(off[0], off[1], source)
    if work.has("trainer.logger"):
        source = _source(work, "trainer.logger")
        loggers = [str(x).lower() for x in _as_list(work.pop("trainer.logger"))]
        chosen = [x for x in loggers if x in ("wandb", "tensorboard", "visualdl")]
        work.set("report_to", ",".join(chosen) or "none", source)
    if work.has("trainer.resume_mode"):
        source = _source(work, "trainer.resume_mode")
        mode = str(work.pop("trainer.resume_mode")).lower()
        if mode == "auto":
            work.set("resume_from_checkpoint", "auto", source)
        elif mode == "resume_path":
            path = work.pop("trainer.resume_from_path", None)
            if path:
                work.set("resume_from_checkpoint", str(path), source)
        elif mode != "disable":
            work.result.errors.append(f"{source}: auto, disable or resume_path")


def _custom_reward(work: _Work, path_key: str, name_key: Optional[str]) -> None:
    """A verl reward file (compute_score(data_source, solution_str, ground_truth, extra_info)): a reward plugin whose
    function is the reward."""
    if not work.has(path_key):
        return
    source = " ".join(_source(work, k) for k in (path_key, name_key) if k and work.has(k))
    path = str(work.pop(path_key))
    name = str(work.pop(name_key, None) or "compute_score") if name_key else "compute_score"
    work.set("reward_plugins", [path], source)
    work.set("reward_funcs", [name], source)
    work.set("reward_routes", {}, source)   # verl: the custom function scores every sample, whatever its source


def _verl_reward_model(work: _Work) -> None:
    enable, path = "reward_model.enable", "reward_model.model.path"
    if work.has(enable) or work.has(path):
        source = " ".join(_source(work, k) for k in (enable, path) if work.has(k))
        on = _true(work.pop(enable, bool(work.peek(path))))
        folder = work.pop(path, "")
        if on and folder:
            work.set("reward_model_name_or_path", str(folder), source)
        elif on:
            work.result.errors.append(f"{source}: reward_model.model.path is needed with reward_model.enable")


SWIFT_RULES = (_swift_rlhf_type, _swift_loss_type, _swift_scale_rewards, _swift_sequence_level, _swift_resample,
               _swift_dtype, _swift_tuner, _swift_deepspeed, _swift_vllm, _swift_datasets, _swift_system)
VERL_RULES = (_verl_files, _verl_truncation, _verl_kl, _verl_estimator, _verl_policy_loss, _verl_schedule,
              _verl_top_k, _verl_micro_tokens, _verl_trainer, _verl_reward_model)

JOINT_KEYS = {
    SWIFT: {"rlhf_type", "loss_type", "scale_rewards", "max_resample_times", "torch_dtype", "tuner_type", "train_type",
            "deepspeed", "use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_base_url",
            "val_dataset", "system", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
            "importance_sampling_level", "top_entropy_quantile", "truncation_strategy", "vllm_data_parallel_size"},
    TRAIN_SH: {"reward_func"},
}
FOREIGN_NAMES = set(SWIFT_RENAMES) | set(TRAIN_SH_RENAMES) | set(NO_EQUIVALENT) | set(OFF_ONLY) | set(REFUSED) | \
    JOINT_KEYS[SWIFT] | JOINT_KEYS[TRAIN_SH]


def flatten_verl(raw: dict) -> dict:
    """A config whose verl roots hold nested mappings (verl's YAML) as dotted keys, other keys as they are."""
    out = {}
    for key, value in raw.items():
        if key in VERL_ROOTS and isinstance(value, dict):
            stack = [(key, value)]
            while stack:
                prefix, node = stack.pop()
                for k, v in node.items():
                    if isinstance(v, dict):
                        stack.append((f"{prefix}.{k}", v))
                    else:
                        out[f"{prefix}.{k}"] = v
        else:
            out[key] = value
    return out


def _framework(key: str) -> str:
    if "." in key:
        return VERL
    if key in TRAIN_SH_RENAMES or key in JOINT_KEYS[TRAIN_SH]:
        return TRAIN_SH
    return SWIFT


def is_foreign(key: str, ours) -> bool:
    return key not in ours and (key in FOREIGN_NAMES or ("." in key and key.split(".", 1)[0] in VERL_ROOTS))


def translate(raw: dict, ours, base: Optional[dict] = None) -> Translation:
    """`raw` (one source's keys in any spelling: a config file, or the command line's overrides and flags) as this
    suite's keys. `ours`: every key name (and alias) here; a key of ours is never translated. `base`: what the
    sources read before this one gave (this suite's keys), which rules that combine keys read as well. Foreign
    keys that nobody knows stay for the loader to name as unknown."""
    raw = flatten_verl(raw)
    foreign = {k: (_framework(k), v) for k, v in raw.items() if is_foreign(k, ours)}
    kept = {k: v for k, v in raw.items() if k not in foreign}
    if not foreign:
        return Translation(kept)
    swift = str(foreign.get(SWIFT_MARKER, (None, ""))[1]).lower() in ("grpo", "ppo")
    verl = any(framework == VERL for framework, _ in foreign.values())
    work = _Work(dict(foreign), {**(base or {}), **kept, **{k: v for k, (_, v) in foreign.items()}})
    if swift:
        _swift_max_length(work, kept)
    for rule in SWIFT_RULES + VERL_RULES:
        rule(work)
    _custom_reward(work, "reward_func", None)
    _custom_reward(work, "custom_reward_function.path", "custom_reward_function.name")
    for key in list(work.foreign):
        framework = work.foreign[key][0]
        table = {SWIFT: SWIFT_RENAMES, VERL: VERL_RENAMES, TRAIN_SH: TRAIN_SH_RENAMES}[framework]
        if key in table:
            target, convert = table[key]
            source = _source(work, key)
            work.set(target, convert(work.pop(key)), source)
        elif key in NO_EQUIVALENT:
            work.ignore(key, NO_EQUIVALENT[key])
        elif key in OFF_ONLY:
            if _true(work.peek(key)):
                work.refuse(key, OFF_ONLY[key])
            else:
                work.ignore(key, "off, as here")
        elif key in REFUSED:
            work.refuse(key, REFUSED[key])
    if swift:
        _framework_defaults(work, SWIFT, SWIFT_DEFAULTS)
    elif verl:
        _framework_defaults(work, VERL, VERL_DEFAULTS)
    _swift_batches(work, {**(base or {}), **kept, **work.out}, swift)
    for key, (framework, _) in work.foreign.items():   # what no rule took: a dotted key verl may know, named
        work.result.errors.append(f"{key}: a {framework} key with no translation here (docs/formats.md lists "
                                  f"those that have one)")
    values = dict(kept)
    for key, value in work.out.items():
        if key in kept and kept[key] != value:
            work.result.errors.append(f"{work.sources[key]} sets {key} to {value!r}, and {key} is {kept[key]!r}: "
                                      f"give one")
        else:
            values[key] = value
    work.result.values = values
    return work.result

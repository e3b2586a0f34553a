from dataclasses import dataclass
from typing import Optional

from .fields import arg

LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "warmup_stable_decay")


@dataclass
class TrainingArgs:
    output_dir: str = arg("output", "Checkpoints and metrics.jsonl go here.")
    seed: int = arg(42, "Seeds sampling, shuffling and initialization.")
    global_batch_size: int = arg(8, "Prompts per RL step.")
    global_gen_batch_size: int = arg(-1, "PaddleNLP's prompts per generation round of dynamic sampling: -1 or "
                                         "global_batch_size (each round here generates global_batch_size "
                                         "prompts, up to max_gen_batches rounds); another value is refused.")
    global_mini_batch_size: int = arg(-1, "Prompts per optimizer step (-1: global_batch_size).", aliases=("mini_batch_size",))
    update_iters: int = arg(1, "Passes over each rollout batch.")
    per_device_train_batch_size: int = arg(8, "Sequences per micro-batch in the update (gradient accumulation fills the mini-batch).")
    per_device_logprob_batch_size: int = arg(8, "Sequences per forward pass for reference / old log-probs.")
    max_tokens_per_micro_batch: int = arg(0, "Form the micro-batches of the update and of the reference / old "
                                             "log-prob passes by a token budget instead of a row count (verl's "
                                             "ppo_max_token_len_per_gpu): rows sorted by length, each micro-batch "
                                             "padded to its own longest prompt and response and holding at most this "
                                             "many tokens (rows x (longest prompt + longest response); with "
                                             "use_remove_padding the packed tokens, each shared prompt once). A "
                                             "sequence longer than the budget runs alone (logged once). The "
                                             "per_device_*_batch_size row counts are then not used. Same loss and "
                                             "gradients as the row split. 0: off.")
    per_device_reward_batch_size: int = arg(8, "Responses per reward call.")
    per_device_value_batch_size: int = arg(8, "Sequences per forward pass of the critic's rollout values "
                                              "(rl_algorithm ppo; with one update pass per step the critic "
                                              "update's forward gives them and this key is not used).")
    num_train_epochs: float = arg(1.0, "Epochs over the training prompts (max_steps wins when > 0).")
    max_steps: int = arg(-1, "RL steps to run (-1: from num_train_epochs).")
    max_length: int = arg(-1, "Longest training sequence, prompt + response, in tokens (PaddleNLP): checked to be "
                              ">= max_prompt_len + max_dec_len, the longest sequence a step builds; -1: "
                              "max_prompt_len + max_dec_len.")
    learning_rate: float = arg(5e-7, "Peak learning rate.")
    lr_scheduler_type: str = arg("constant", "constant | constant_with_warmup | linear | cosine | "
                                             "warmup_stable_decay (the peak after the warm-up, then a cosine decay "
                                             "over the last lr_decay_steps steps).")
    warmup_steps: int = arg(0, "Linear warm-up steps (optimizer steps).")
    warmup_ratio: float = arg(0.0, "Warm-up as a share of all optimizer steps (used when warmup_steps is 0).")
    lr_decay_steps: int = arg(0, "warmup_stable_decay: the optimizer steps at the end that decay to min_lr_ratio "
                                 "(required, > 0, with that schedule).")
    min_lr_ratio: float = arg(0.0, "Final learning rate of linear / cosine decay, as a share of the peak.")
    weight_decay: float = arg(0.0, "AdamW decoupled weight decay (not applied to norms and biases).")
    adam_beta1: float = arg(0.9)
    adam_beta2: float = arg(0.999)
    adam_epsilon: float = arg(1e-8)
    max_grad_norm: float = arg(1.0, "Clip the global gradient norm (0: off).")
    max_nonfinite_skips: int = arg(3, "An optimizer update whose loss or gradient norm is NaN or inf (on any rank) is "
                                      "skipped: no optimizer or lr-schedule step, gradients dropped, counted as "
                                      "actor/nonfinite_skipped. This many skipped updates in a row are tolerated; the "
                                      "next one stops the run, naming the step and the first non-finite tensor (0: "
                                      "the first non-finite update stops it; -1: never stop).")
    save_steps: int = arg(500, "Save a checkpoint every this many steps.")
    save_strategy: str = arg("steps", "steps (every save_steps and at the end) | epoch (at the end of every pass "
                             "over train_datasets, and at the end) | no.")
    save_total_limit: int = arg(-1, "Keep at most this many checkpoints (-1: all).")
    save_error: str = arg("stop", "A checkpoint that cannot be written (full disk, I/O error; its partial folder is "
                                  "removed, earlier checkpoints are untouched): stop (the run ends with the error) | "
                                  "continue (logged as an error; training goes on and saves again when due).")
    save_dtype: str = arg("auto", "The dtype of a checkpoint's Hugging Face weights (model.safetensors; config.json's "
                                  "torch_dtype says it): auto (bfloat16 with bf16: true, else float32) | float32 | "
                                  "bfloat16. A bfloat16 checkpoint of a run also holds the float32 master weights "
                                  "(master_weights.safetensors), so resuming from it is exact.",
                          choices=("auto", "float32", "bfloat16"), spellings={"fp32": "float32", "bf16": "bfloat16"})
    ignore_save_lr_and_optim: bool = arg(False, "Save only model weights (such a checkpoint cannot resume exactly).")
    resume_from_checkpoint: Optional[str] = arg(None, "auto (latest in output_dir) | PATH.")
    do_train: bool = arg(True, "false: no update; the run evaluates the starting model once (step 0, as with "
                                     "do_eval) and ends, as PaddleNLP's run without do_train.")
    do_eval: bool = arg(False, "Evaluate on eval_datasets at step 0 and every eval_steps.")
    evaluation_strategy: str = arg("steps", "steps (at step 0, every eval_steps and at the end) | epoch (at step 0, "
                                            "at the end of every pass over train_datasets, and at the end) | no.",
                                   choices=("steps", "epoch", "no"))
    eval_steps: int = arg(20, "Evaluate every this many steps.")
    per_device_eval_batch_size: int = arg(32, "Prompts decoded at once in evaluation.")
    balance_batch: bool = arg(False, "Under data / sharding parallelism, assign each mini-batch's prompt groups to "
                                      "the ranks by their tokens (largest first onto the least loaded rank) instead "
                                      "of the same contiguous share; rows move after the rollout, the update equals "
                                      "the unbalanced one (metric perf/token_imbalance). Does nothing with one "
                                      "process or one batch rank.")
    use_remove_padding: bool = arg(False, "Pack each micro-batch of the update and log-prob passes into one row of "
                                          "real tokens (each shared prompt once, then its responses) with "
                                          "per-sequence positions and attention per block of similar-length "
                                          "segments: no padding in projections, MLP, norms or the LM head. Same "
                                          "log-probs and gradients as the padded layout. Not with "
                                          "pipeline_parallel_degree > 1.")

    def _validate_training(self, errors):
        if self.global_gen_batch_size not in (-1, self.global_batch_size):
            errors.append(f"global_gen_batch_size: {self.global_gen_batch_size}: each generation round here "
                          f"generates global_batch_size ({self.global_batch_size}) prompts (dynamic_sampling adds "
                          "rounds up to max_gen_batches); a round of another size is not implemented; set it to -1")
        positive = ("global_batch_size", "update_iters", "per_device_train_batch_size",
                    "per_device_logprob_batch_size", "per_device_reward_batch_size", "per_device_eval_batch_size")
        for key in positive:
            if getattr(self, key) < 1:
                errors.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.lr_scheduler_type not in LR_SCHEDULES:
            errors.append(f"lr_scheduler_type: {self.lr_scheduler_type!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.lr_scheduler_type == "warmup_stable_decay" and self.lr_decay_steps <= 0:
            errors.append(f"lr_decay_steps: warmup_stable_decay needs lr_decay_steps > 0, got {self.lr_decay_steps}")
        elif self.lr_decay_steps and self.lr_scheduler_type != "warmup_stable_decay":
            errors.append(f"lr_decay_steps: read by lr_scheduler_type warmup_stable_decay only, not by "
                          f"{self.lr_scheduler_type!r}")
        if self.learning_rate < 0:
            errors.append(f"learning_rate: must be >= 0, got {self.learning_rate}")
        if self.save_strategy not in ("steps", "no", "epoch"):
            errors.append(f"save_strategy: must be steps, epoch or no, got {self.save_strategy!r}")
        if self.save_error not in ("stop", "continue"):
            errors.append(f"save_error: must be stop or continue, got {self.save_error!r}")
        if self.max_nonfinite_skips < -1:
            errors.append(f"max_nonfinite_skips: must be >= 0 or -1, got {self.max_nonfinite_skips}")
        if self.save_steps < 1:
            errors.append(f"save_steps: must be >= 1, got {self.save_steps}")
        if self.eval_steps < 1:
            errors.append(f"eval_steps: must be >= 1, got {self.eval_steps}")
        if self.max_steps == 0 or self.max_steps < -1:
            errors.append(f"max_steps: must be > 0 or -1, got {self.max_steps}")
        if self.max_length == 0 or self.max_length < -1:
            errors.append(f"max_length: must be > 0 or -1, got {self.max_length}")
        if self.max_tokens_per_micro_batch < 0:
            errors.append(f"max_tokens_per_micro_batch: must be >= 0 (0: off), got {self.max_tokens_per_micro_batch}")
        mini = self.mini_batch_prompts
        if self.global_batch_size >= 1 and mini >= 1 and self.global_batch_size % mini:
            errors.append(f"global_mini_batch_size: {mini} does not divide global_batch_size {self.global_batch_size}")
        if mini < 1:
            errors.append(f"global_mini_batch_size: must be >= 1 or -1, got {mini}")

    @property
    def mini_batch_prompts(self) -> int:
        return self.global_batch_size if self.global_mini_batch_size == -1 else self.global_mini_batch_size

"""Supervised fine-tuning (`paddle-rl sft`): the RL trainer's loop, layouts, checkpoints, metrics and eval, with a
step that reads prompt / response records instead of generating, and a loss that is the cross-entropy of the
response tokens (the prompt's tokens carry no loss).

A step takes `global_batch_size` records from the sampler, one row each ([prompt | response], the layout every
log-prob pass uses), split into mini-batches of `global_mini_batch_size` records, one optimizer step each, run in
micro-batches of `per_device_train_batch_size` rows (or `max_tokens_per_micro_batch` tokens); the loss of a
mini-batch is the mean negative log-likelihood over its response tokens on every rank together. The response of a
record: its trailing assistant turn (ms-swift `messages`), else its `response_key` (PaddleNLP `tgt`) or
`response` string, with a stop token appended (data/loader.py `load_sft_dataset`), at most `max_dec_len` tokens.
"""
import time
from typing import Optional

import numpy as np

from ..algorithms.aggregation import loss_normalizers
from ..algorithms.objective import LossOutput
from ..batch import StepBatch, object_column
from ..config import ConfigError
from ..data.loader import load_sft_dataset
from ..monitor import StageTimer
from ..parallel import watchdog
from .checkpoint import resolve_resume
from .loop import StepLoop
from .preflight import preflight


class SFTTrainer:
    """A supervised run: a StepLoop (trainer/loop.py) whose step reads prompt / response records. It builds a
    rollout engine and the reward only for held-out evaluation (eval_datasets with do_eval), and nothing of RL."""

    def __init__(self, config, topology=None):
        ignored = [k for k, v in (("update_iters", config.update_iters != 1), ("kl_coeff", config.kl_coeff > 0),
                                  ("kl_loss_coeff", config.kl_loss_coeff > 0), ("entropy_coeff", config.entropy_coeff),
                                  ("async_rollout", config.async_rollout), ("env_plugin", config.env_plugin))
                   if v]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)}: not used by supervised fine-tuning (one pass over each batch, "
                              "cross-entropy of the responses only, no rollout); remove them or set them to their "
                              "defaults")
        evaluates = bool(config.do_eval and config.eval_datasets)
        # every missing prerequisite at once, before any model loads (the reward: the held-out accuracy's rule)
        preflight(config, rewards=evaluates, sft=True)
        self.loop = loop = StepLoop(config, topology)
        self.config, self.layout, self.tokenizer = config, loop.layout, loop.tokenizer
        loop.load_data(load_sft_dataset(config.train_datasets, self.tokenizer, config.prompt_key,
                                        config.response_key, config.max_prompt_len, config.prompt_overflow,
                                        config.max_dec_len, self._stop_ids(), config.apply_chat_template,
                                        config.system_prompt))
        loop.load_actor()
        self.train_data, self.eval_data, self.sampler = loop.train_data, loop.eval_data, loop.sampler
        self.total_steps, self.pad_id = loop.total_steps, loop.pad_id
        self.engine = self.reward_fn = self.make_episodes = None
        if loop.eval_data is not None:
            self.make_episodes, self.engine, self.reward_fn = loop.generation_parts()
        loop.build_optimizer()
        self.actor, self.optimizer, self.scheduler, self.log = loop.actor, loop.optimizer, loop.scheduler, loop.log
        loop.resume(resolve_resume(config.resume_from_checkpoint, config.output_dir))

    @property
    def step(self) -> int:
        return self.loop.step

    @step.setter
    def step(self, value: int) -> None:
        self.loop.step = value

    def _stop_ids(self):
        ids = list(self.tokenizer.eos_token_ids)
        if not ids:
            raise ValueError(f"{self.loop.tokenizer_dir}: no EOS token (tokenizer_config.json eos_token): a "
                             "supervised response needs one to end")
        return ids

    # ---------------------------------------------------------------- one step
    def train_step(self) -> dict:
        cfg = self.config
        step = self.step + 1
        timer = StageTimer(on_stage=lambda name: watchdog.note(f"step {step}, {name}"))
        start = time.perf_counter()
        indices = self.layout.batch.local_prompt_indices(self.sampler.next_batch(), cfg.mini_batch_prompts)
        batch = sft_batch([self.train_data[i] for i in indices], self.pad_id)
        # every row its own prompt (no shared prefix to reuse), one sample of it
        batch["group"] = self.layout.batch.global_groups(np.arange(batch.size), cfg.mini_batch_prompts)
        batch["sample"] = np.zeros(batch.size, dtype=np.int64)
        batch, metrics = self.layout.batch.place(batch, cfg.mini_batch_prompts, cfg.balance_batch)
        batch.with_prompt_layout(self.pad_id)
        # the model's own distribution (temperature 1): `temperature` is the eval's sampling setting only
        metrics.update(self.loop.update(batch, timer, [], self._micro_loss, 1.0, loss_normalizers))
        elapsed = time.perf_counter() - start
        trained, prompt_tokens = (float(v) for v in self.layout.batch.sum(
            [float(batch["response_mask"].sum()), float(batch["prompt_mask"].sum())]))
        metrics.update(timer.metrics())
        metrics["time/step"] = elapsed
        metrics["perf/trained_tokens"] = trained
        metrics["perf/trained_tokens_per_s"] = trained / max(timer.seconds.get("update", 0.0), 1e-9)
        metrics["perf/tokens_per_s"] = (trained + prompt_tokens) / elapsed
        metrics["training/epoch"] = float(self.sampler.epoch)
        self.step = step
        return metrics

    @staticmethod
    def _micro_loss(part, logp, entropy, num_tokens: float, num_seqs: float):
        """The micro-batch's share of the mini-batch's mean response-token NLL (shares sum to the mean over every
        micro-batch and rank); metrics: its own token mean (`sft_loss`) and entropy."""
        mask = part["response_mask"]
        nll = -(logp * mask).sum()
        tokens = float(mask.sum())
        metrics = {"sft_loss": float(nll) / max(tokens, 1.0)}
        if entropy is not None:
            metrics["entropy"] = float((entropy * mask).sum()) / max(tokens, 1.0)
        return LossOutput(nll / max(num_tokens, 1.0), metrics, tokens)

    # ---------------------------------------------------------------- the loop's verbs
    def evaluate(self) -> dict:
        return self.loop.evaluate(self.engine, self.reward_fn, self.make_episodes)

    def save(self) -> Optional[str]:
        return self.loop.save({})

    def epoch_done(self) -> bool:
        return self.sampler.epoch_done

    def stepped(self) -> None:
        """Nothing runs between steps."""

    def close(self) -> None:
        """Nothing to stop."""

    def train(self) -> dict:
        """Run to the end (StepLoop.run); returns the last step's metrics."""
        return self.loop.run(self)


def sft_batch(items, pad_id: int) -> StepBatch:
    """Records with `prompt_ids` and `response_ids` as a StepBatch (one row each; responses right-padded). The loss
    mask is the record's `loss_mask` where it has one (the assistant turns of a conversation), else its response;
    attention covers the whole response either way (`StepBatch.token_mask`)."""
    lengths = np.array([len(it["response_ids"]) for it in items], dtype=np.int64)
    width = max(int(lengths.max()) if len(items) else 1, 1)
    ids = np.full((len(items), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(items), width), dtype=np.float32)
    for i, it in enumerate(items):
        ids[i, :lengths[i]] = it["response_ids"]
        mask[i, :lengths[i]] = it.get("loss_mask", 1.0)  # a multi-turn record learns its assistant turns only
    return StepBatch({"prompt_ids": object_column(list(it["prompt_ids"]) for it in items), "response_ids": ids,
                      "response_mask": mask, "lengths": lengths, "truncated": np.zeros(len(items), dtype=bool),
                      "item": object_column(items)}, pads={"response_ids": pad_id})

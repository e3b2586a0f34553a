"""The RL step loop: rollout -> rewards -> reference / old log-probs -> advantages -> update.

Each stage is a call into its own module; this file only orders them and collects metrics.
"""
import logging
import math
import os
import time
from typing import Optional

import numpy as np
import paddle
from paddle.utils import unique_name

from ..algorithms import Objective
from ..config import check_paths
from ..data.loader import PromptSampler, load_prompt_dataset
from ..models import Tokenizer, load_model
from ..models.pretrained import load_local_state
from ..monitor import MetricsLog, StageTimer
from ..rewards import RewardSample, build_reward, concat_results
from ..rollout import RolloutEngine, SamplingParams, sample_key
from .batch import RolloutBatch
from .checkpoint import (load_optimizer, load_trainer_state, resolve_resume, save_checkpoint, set_rng_state)
from .evaluate import _reward_record, evaluate
from .logprobs import batched_logprobs, token_logprobs
from .optim import build_optimizer, clip_grad_norm_

logger = logging.getLogger("paddle_rl")


def _mean_of(values, weights):
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else 0.0


class RLTrainer:
    def __init__(self, config):
        check_paths(config)
        self.config = config
        paddle.seed(config.seed)
        np.random.seed(config.seed)
        model_dir = config.actor_model_name_or_path
        self.tokenizer_dir = config.tokenizer_name_or_path or model_dir
        self.tokenizer = Tokenizer.from_pretrained(self.tokenizer_dir)
        self.objective = Objective(config)
        self.train_data = load_prompt_dataset(config.train_datasets, self.tokenizer, config.prompt_key,
                                              config.response_key, config.max_prompt_len, config.prompt_overflow)
        self.eval_data = None
        if config.do_eval and config.eval_datasets:
            self.eval_data = load_prompt_dataset(config.eval_datasets, self.tokenizer, config.prompt_key,
                                                 config.response_key, config.max_prompt_len, config.prompt_overflow,
                                                 limit=config.max_eval_samples)
        self.sampler = PromptSampler(len(self.train_data), config.global_batch_size, config.seed,
                                     config.dataloader_shuffle, config.dataloader_drop_last)
        self.total_steps = config.max_steps if config.max_steps > 0 else max(
            1, math.ceil(config.num_train_epochs * self.sampler.batches_per_epoch))
        with unique_name.guard("actor_"):
            self.actor = load_model(model_dir)
        self.actor.recompute = config.recompute
        self.reference = None
        if self.objective.needs_reference:
            with unique_name.guard("reference_"):
                self.reference = load_model(config.reference_model_name_or_path or model_dir)
            self.reference.eval()
            for p in self.reference.parameters():
                p.stop_gradient = True
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.actor.config.eos_token_ids))
        if not self.stop_ids:
            raise ValueError(f"{self.tokenizer_dir}: no EOS token (tokenizer_config.json eos_token or "
                             "generation_config.json eos_token_id)")
        self.engine = RolloutEngine(self.actor, self.pad_id, self.stop_ids, config.rollout_max_num_seqs)
        self.reward_fn = build_reward(config)
        self.mini_batches_per_step = config.global_batch_size // config.mini_batch_prompts
        self.optimizer, self.scheduler = build_optimizer(
            self.actor, config, self.total_steps * self.mini_batches_per_step * config.update_iters)
        self.step = 0
        self.log = MetricsLog(config.output_dir, config.logging_dir or os.path.join(config.output_dir, "logs"),
                              config.report_to, config.logging_steps, config.run_name)
        self._resume(resolve_resume(config.resume_from_checkpoint, config.output_dir))

    # ---------------------------------------------------------------- resume / save
    def _resume(self, path: Optional[str]) -> None:
        if path is None:
            return
        state = load_trainer_state(path)
        with unique_name.guard("resume_"):
            resumed = load_model(path)
        load_local_state(self.actor, {n: p.numpy() for n, p in resumed.named_parameters()}, source=path)
        load_optimizer(path, self.optimizer, self.scheduler, state)
        self.sampler.set_state_dict(state["sampler"])
        self.objective.set_state_dict(state.get("objective", {}))
        set_rng_state(state["rng"], path)
        self.step = int(state["step"])
        self.log.truncate_after(self.step)
        logger.info("resumed from %s at step %d", path, self.step)

    def save(self) -> str:
        state = {"sampler": self.sampler.state_dict(), "objective": self.objective.state_dict(),
                 "total_steps": self.total_steps}
        return save_checkpoint(self.config.output_dir, self.step, self.actor, self.tokenizer_dir, self.optimizer,
                               self.scheduler, state, save_optimizer=not self.config.ignore_save_lr_and_optim,
                               total_limit=self.config.save_total_limit)

    # ---------------------------------------------------------------- stages
    def _rollout(self, items, step: int, timer: StageTimer):
        cfg = self.config
        n = cfg.rollout_n
        keys = [sample_key(cfg.seed, step, it["uid"], j) for it in items for j in range(n)]
        params = SamplingParams.from_config(cfg, self.stop_ids)
        with timer.stage("rollout"):
            out = self.engine.generate([it["prompt_ids"] for it in items], n, params, keys)
        return out

    def _score(self, items, out, timer: StageTimer):
        n = self.config.rollout_n
        with timer.stage("reward"):
            texts = self.tokenizer.decode_batch(out.responses())
            samples = [RewardSample(items[i // n]["prompt"], text, _reward_record(items[i // n]),
                                    int(out.lengths[i]), bool(out.truncated[i])) for i, text in enumerate(texts)]
            size = self.config.per_device_reward_batch_size
            result = concat_results([self.reward_fn(samples[s:s + size]) for s in range(0, len(samples), size)])
        return result

    def _update(self, batch: RolloutBatch, timer: StageTimer) -> dict:
        cfg = self.config
        n = cfg.rollout_n
        mini_size = cfg.mini_batch_prompts * n
        micro = cfg.per_device_train_batch_size
        keys = ["old_logp", "advantages"] + (["ref_logp"] if self.reference is not None else [])
        collected, weights, grad_norms, lrs = {}, [], [], []
        self.actor.train()
        with timer.stage("update"):
            for _ in range(cfg.update_iters):
                for start in range(0, batch.size, mini_size):
                    mini = batch.select(np.arange(start, min(start + mini_size, batch.size)))
                    num_tokens = float(mini.response_mask.sum())
                    num_seqs = float(mini.size)
                    for m_start in range(0, mini.size, micro):
                        part = mini.tensors(slice(m_start, m_start + micro), keys)
                        logp, entropy = token_logprobs(self.actor, part["input_ids"], part["attention_mask"],
                                                       mini.prompt_width, part["response_ids"], cfg.temperature,
                                                       with_entropy=True)
                        out = self.objective.loss(logp, part["old_logp"], part.get("ref_logp"), part["advantages"],
                                                  part["response_mask"], entropy, num_tokens, num_seqs)
                        out.loss.backward()
                        for k, v in out.metrics.items():
                            collected.setdefault(k, []).append(v)
                        weights.append(out.num_tokens)
                    grad_norms.append(clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm))
                    lrs.append(self.optimizer.get_lr())
                    self.optimizer.step()
                    self.optimizer.clear_grad(set_to_zero=False)
                    self.scheduler.step()
        metrics = {f"actor/{k}": _mean_of(v, weights) for k, v in collected.items()}
        metrics["actor/grad_norm"] = float(np.mean(grad_norms))
        metrics["actor/lr"] = float(lrs[-1])
        return metrics

    # ---------------------------------------------------------------- one step
    def train_step(self) -> dict:
        cfg = self.config
        step = self.step + 1
        timer = StageTimer()
        start = time.perf_counter()
        indices = self.sampler.next_batch()
        items = [self.train_data[i] for i in indices]
        out = self._rollout(items, step, timer)
        result = self._score(items, out, timer)
        scores, shape_metrics = self.objective.shape_scores(result.scores, out.lengths, out.truncated)
        group_ids = np.repeat(np.arange(len(items)), cfg.rollout_n)
        batch = RolloutBatch.from_rollout(out, group_ids, self.pad_id)
        mask = batch.response_mask
        metrics = {}
        if self.reference is not None:
            with timer.stage("ref_logprob"):
                batch.arrays["ref_logp"] = batched_logprobs(self.reference, batch, cfg.temperature,
                                                            cfg.per_device_logprob_batch_size)
        with timer.stage("old_logprob"):
            batch.arrays["old_logp"] = batched_logprobs(self.actor, batch, cfg.temperature,
                                                        cfg.per_device_logprob_batch_size)
        with timer.stage("advantage"):
            adv = self.objective.advantages(scores, mask, group_ids, batch.arrays["old_logp"],
                                            batch.arrays.get("ref_logp"))
            batch.arrays["advantages"] = adv.numpy().astype(np.float32) if isinstance(adv, paddle.Tensor) else adv
        if self.reference is not None:
            diff = (batch.arrays["old_logp"] - batch.arrays["ref_logp"]) * mask
            metrics["kl"] = float(diff.sum() / max(mask.sum(), 1.0))
        metrics.update(self._update(batch, timer))
        metrics.update(self._rollout_metrics(result, scores, out, group_ids, batch.arrays["advantages"], mask))
        metrics.update(shape_metrics)
        elapsed = time.perf_counter() - start
        metrics.update(timer.metrics())
        metrics["time/step"] = elapsed
        generated = float(out.lengths.sum())
        trained = float(mask.sum()) * cfg.update_iters
        metrics["perf/generated_tokens_per_s"] = generated / max(timer.seconds["rollout"], 1e-9)
        metrics["perf/tokens_per_s"] = (generated + float(batch.prompt_mask.sum())) / elapsed
        metrics["perf/trained_tokens_per_s"] = trained / max(timer.seconds["update"], 1e-9)
        metrics["epoch"] = float(self.sampler.epoch)
        self.step = step
        return metrics

    def _rollout_metrics(self, result, scores, out, group_ids, advantages, mask) -> dict:
        metrics = result.metrics("reward")
        metrics["reward/shaped_mean"] = float(scores.mean())
        lengths = out.lengths.astype(np.float64)
        metrics["response_length/mean"] = float(lengths.mean())
        metrics["response_length/max"] = float(lengths.max())
        metrics["response_length/min"] = float(lengths.min())
        metrics["response_length/clipped_share"] = float(out.truncated.mean())
        spread = [np.ptp(result.scores[group_ids == g]) for g in np.unique(group_ids)]
        metrics["zero_variance_group_share"] = float(np.mean([s <= 1e-6 for s in spread]))
        valid = advantages[mask > 0]
        metrics["advantage/mean"] = float(valid.mean()) if valid.size else 0.0
        metrics["advantage/std"] = float(valid.std()) if valid.size else 0.0
        return metrics

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict:
        if self.eval_data is None:
            return {}
        timer = StageTimer()
        with timer.stage("eval"):
            metrics = evaluate(self.engine, self.tokenizer, self.eval_data, self.reward_fn, self.config, self.stop_ids)
        metrics.update(timer.metrics())
        return metrics

    def _should_eval(self, step: int) -> bool:
        cfg = self.config
        return self.eval_data is not None and cfg.evaluation_strategy != "no" and (
            step % cfg.eval_steps == 0 or step == self.total_steps)

    def train(self) -> dict:
        cfg = self.config
        if self.step == 0 and self.eval_data is not None and cfg.evaluation_strategy != "no":
            initial = self.evaluate()
            self.log.log(0, initial)
            logger.info("step 0 eval: %s", _summary(initial))
        progress = _progress(self.total_steps, self.step, cfg.disable_tqdm)
        last = {}
        while self.step < self.total_steps:
            metrics = self.train_step()
            if self._should_eval(self.step):
                metrics.update(self.evaluate())
            self.log.log(self.step, metrics)
            last = metrics
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(_summary(metrics, short=True))
            if self.step % cfg.logging_steps == 0:
                logger.info("step %d/%d %s", self.step, self.total_steps, _summary(metrics))
            if cfg.save_strategy == "steps" and (self.step % cfg.save_steps == 0 or self.step == self.total_steps):
                self.save()
        if progress is not None:
            progress.close()
        self.log.close()
        return last


SUMMARY_KEYS = ("reward/mean", "accuracy", "eval/accuracy", "eval/reward_mean", "kl", "actor/pg_loss",
                "response_length/mean", "time/step")


def _summary(metrics: dict, short: bool = False) -> str:
    keys = SUMMARY_KEYS[:3] if short else SUMMARY_KEYS
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def _progress(total: int, done: int, disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, desc="rl", unit="step", disable=None, dynamic_ncols=True)

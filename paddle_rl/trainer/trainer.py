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

from .. import ops
from ..algorithms import Objective
from ..config import check_paths
from ..data.loader import PromptSampler, load_prompt_dataset
from ..models import Tokenizer
from ..monitor import MetricsLog, StageTimer
from ..parallel.runtime import ParallelRuntime
from ..rewards import RewardSample, build_reward, concat_results
from ..rollout import RolloutEngine, SamplingParams, sample_key
from .batch import RolloutBatch, merge_rollouts, select_result, select_rollout
from .checkpoint import (load_optimizer, load_trainer_state, resolve_resume, save_checkpoint, set_rng_state)
from .evaluate import _reward_record, evaluate
from .logprobs import reuses_rollout_logprobs

logger = logging.getLogger("paddle_rl")


class RLTrainer:
    def __init__(self, config, topology=None):
        """`topology`: the process grid (parallel/topology.py); default: from the config's degrees when launched on
        several processes, else a single process."""
        check_paths(config)
        self.config = config
        ops.configure(config.use_custom_ops)
        self.parallel = ParallelRuntime(topology if topology is not None else _topology(config),
                                        share_prompts=config.share_prompt_prefix)
        self.parallel.check_config(config)
        paddle.seed(config.seed)
        np.random.seed(config.seed)
        model_dir = config.actor_model_name_or_path
        self.tokenizer_dir = config.tokenizer_name_or_path or model_dir
        self.tokenizer = Tokenizer.from_pretrained(self.tokenizer_dir)
        self.objective = Objective(config, reduce=self.parallel.stats_reduce)
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
            self.actor = self.parallel.load_model(model_dir)
        self.actor.recompute = config.recompute
        self.reference = None
        if self.objective.needs_reference:
            with unique_name.guard("reference_"):
                self.reference = self.parallel.load_model(config.reference_model_name_or_path or model_dir)
            self.reference.eval()
            for p in self.reference.parameters():
                p.stop_gradient = True
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.actor.config.eos_token_ids))
        if not self.stop_ids:
            raise ValueError(f"{self.tokenizer_dir}: no EOS token (tokenizer_config.json eos_token or "
                             "generation_config.json eos_token_id)")
        self.engine = RolloutEngine(self.actor, self.pad_id, self.stop_ids, config.rollout_max_num_seqs)
        self.reward_fn = build_reward(config, broadcast_group=self.parallel.topo.group("model"))
        self.mini_batches_per_step = config.global_batch_size // config.mini_batch_prompts
        self.optimizer, self.scheduler = self.parallel.build_optimizer(
            self.actor, config, self.total_steps * self.mini_batches_per_step * config.update_iters)
        self.step = 0
        self.log = MetricsLog(config.output_dir, config.logging_dir or os.path.join(config.output_dir, "logs"),
                              config.report_to, config.logging_steps, config.run_name,
                              enabled=self.parallel.is_logging_rank)
        self._resume(resolve_resume(config.resume_from_checkpoint, config.output_dir))

    # ---------------------------------------------------------------- resume / save
    def _resume(self, path: Optional[str]) -> None:
        if path is None:
            return
        state = load_trainer_state(path)
        self.parallel.load_weights(self.actor, path)
        load_optimizer(path, self.optimizer, self.scheduler, state, **self.parallel.resume_args())
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
                               total_limit=self.config.save_total_limit, **self.parallel.checkpoint_args(self.actor))

    # ---------------------------------------------------------------- stages
    def _rollout(self, items, step: int, timer: StageTimer, gen_round: int = 0):
        cfg = self.config
        n = cfg.rollout_n
        keys = [sample_key(cfg.seed, step, it["uid"], j, gen_round) for it in items for j in range(n)]
        params = SamplingParams.from_config(cfg, self.stop_ids)
        with timer.stage("rollout"):
            out = self.parallel.generate(self.engine, self.actor, [it["prompt_ids"] for it in items], n, params, keys)
        return out

    def _score(self, items, out, timer: StageTimer):
        n = self.config.rollout_n
        with timer.stage("reward"):
            texts = self.tokenizer.decode_batch(out.responses())
            samples = [RewardSample(items[i // n]["prompt"], text, _reward_record(items[i // n]),
                                    int(out.lengths[i]), bool(out.truncated[i])) for i, text in enumerate(texts)]
            result = self.reward_fn(samples)
        return result

    def _update(self, batch: RolloutBatch, timer: StageTimer) -> dict:
        cfg = self.config
        n = cfg.rollout_n
        mini_size = self.parallel.local_mini_prompts(cfg.mini_batch_prompts) * n
        micro = cfg.per_device_train_batch_size
        keys = ["old_logp", "advantages"] + (["ref_logp"] if self.reference is not None else [])
        collected, weights, grad_norms, lrs = {}, [], [], []
        self.actor.train()
        with timer.stage("update"):
            for _ in range(cfg.update_iters):
                for start in range(0, batch.size, mini_size):
                    mini = batch.select(np.arange(start, min(start + mini_size, batch.size)))
                    # global token / sequence counts (summed over data-parallel ranks)
                    num_tokens, num_seqs = (float(v) for v in self.parallel.sum(
                        self.objective.loss_normalizers(mini.response_mask)))

                    def loss_fn(part, logp, entropy):
                        return self.objective.loss(logp, part["old_logp"], part.get("ref_logp"), part["advantages"],
                                                   part["response_mask"], entropy, num_tokens, num_seqs)

                    for out in self.parallel.forward_backward(self.actor, mini, keys, micro, cfg.temperature, loss_fn):
                        for k, v in out.metrics.items():
                            collected.setdefault(k, []).append(v)
                        weights.append(out.num_tokens)
                    grad_norms.append(self.parallel.clip_grad_norm_(self.actor, cfg.max_grad_norm))
                    lrs.append(self.optimizer.get_lr())
                    self.optimizer.step()
                    self.optimizer.clear_grad(set_to_zero=False)
                    self.scheduler.step()
        metrics = {f"actor/{k}": v for k, v in self.parallel.weighted_means(collected, weights).items()}
        metrics["actor/grad_norm"] = float(np.mean(grad_norms))
        metrics["actor/lr"] = float(lrs[-1])
        return metrics

    # ---------------------------------------------------------------- one step
    def _generate_batch(self, step: int, timer: StageTimer):
        """Rollout + reward rounds until the batch is complete (one round unless DAPO dynamic sampling drops
        zero-variance groups or the reward server skipped samples). Returns the selected pool."""
        cfg = self.config
        n = cfg.rollout_n
        pool = {"items": [], "outs": [], "results": [], "scores": [], "shape_metrics": []}
        for gen_round in range(1, max(1, cfg.max_gen_batches if cfg.dynamic_sampling else 1) + 1):
            indices = self.parallel.local_prompt_indices(self.sampler.next_batch(), cfg.mini_batch_prompts)
            items = [self.train_data[i] for i in indices]
            out = self._rollout(items, step, timer, gen_round - 1)
            result = self._score(items, out, timer)
            scores, shape_metrics = self._shape_scores(result, out)
            for key, value in zip(("items", "outs", "results", "scores", "shape_metrics"),
                                  (items, out, result, scores, shape_metrics)):
                pool[key].append(value)
            all_scores = np.concatenate(pool["scores"])
            group_ids = np.repeat(np.arange(len(all_scores) // n), n)
            keep, filter_metrics = self.objective.filter_groups(all_scores, group_ids)
            skipped = concat_results(pool["results"]).skipped
            if skipped is not None:
                keep = keep & ~np.isin(group_ids, group_ids[skipped])
            if not cfg.dynamic_sampling and skipped is None:
                index = np.arange(len(all_scores))
            else:
                # without dynamic sampling only skipped groups leave, in the first and only round
                # under data parallelism each rank fills its own share of the batch
                share = cfg.global_batch_size // self.parallel.topo.batch_degree
                target = share if cfg.dynamic_sampling else int(keep.reshape(-1, n).all(1).sum())
                index = self.objective.select_groups(
                    keep, group_ids, target, gen_round if cfg.dynamic_sampling else max(gen_round, cfg.max_gen_batches))
            if index is not None:
                break
        items = [it for chunk in pool["items"] for it in chunk]
        out = merge_rollouts(pool["outs"], self.pad_id)
        result = concat_results(pool["results"])
        metrics = dict(pool["shape_metrics"][-1])
        metrics.update(filter_metrics)
        metrics["gen_rounds"] = float(gen_round)
        return items, out, result, np.concatenate(pool["scores"]), np.asarray(index, dtype=np.int64), metrics

    def _shape_scores(self, result, out):
        """Objective's score shaping on the scored samples; samples the reward server skipped stay NaN."""
        skipped = getattr(result, "skipped", None)
        if skipped is None or not skipped.any():
            return self.objective.shape_scores(result.scores, out.lengths, out.truncated)
        valid = ~skipped
        scores = np.full(len(result.scores), np.nan, dtype=np.float32)
        if valid.any():
            scores[valid], metrics = self.objective.shape_scores(result.scores[valid], out.lengths[valid],
                                                                 out.truncated[valid])
            return scores, metrics
        return scores, {}

    def train_step(self) -> dict:
        cfg = self.config
        n = cfg.rollout_n
        step = self.step + 1
        timer = StageTimer()
        start = time.perf_counter()
        items, out, result, scores, index, metrics = self._generate_batch(step, timer)
        metrics = self.parallel.reduce_metrics(metrics)
        batch_result, batch_out = self.parallel.batch_view(result, out)
        metrics.update(batch_result.metrics("reward"))
        metrics.update(self._length_metrics(batch_out))
        generated = float(out.lengths.sum())
        if len(index) < len(scores):
            items = [items[g] for g in sorted(set((index // n).tolist()))]
            out, scores = select_rollout(out, index), scores[index]
            result = select_result(result, index)
        group_ids = np.repeat(np.arange(len(items)), n)
        batch = RolloutBatch.from_rollout(out, group_ids, self.pad_id)
        if reuses_rollout_logprobs(cfg, self.mini_batches_per_step):
            batch.arrays["rollout_logp"] = out.logprobs
        batch.response_mask = np.asarray(self.objective.response_mask_for_update(batch.response_mask, out.truncated),
                                         dtype=np.float32)
        mask = batch.response_mask
        if self.parallel.sum([mask.sum()])[0] > 0:  # every rank takes the same branch
            metrics.update(self._prepare_and_update(batch, scores, result, timer))
        else:
            metrics["actor/skipped_update"] = 1.0
        elapsed = time.perf_counter() - start
        metrics.update(timer.metrics())
        metrics["time/step"] = elapsed
        generated, prompt_tokens, trained = (float(v) for v in self.parallel.sum(
            [generated, float(batch.prompt_mask.sum()), float(mask.sum()) * cfg.update_iters]))
        metrics["perf/generated_tokens_per_s"] = generated / max(timer.seconds["rollout"], 1e-9)
        metrics["perf/tokens_per_s"] = (generated + prompt_tokens) / elapsed
        metrics["perf/trained_tokens_per_s"] = trained / max(timer.seconds.get("update", 0.0), 1e-9)
        metrics["epoch"] = float(self.sampler.epoch)
        self.step = step
        return metrics

    def _prepare_and_update(self, batch: RolloutBatch, scores, result, timer: StageTimer) -> dict:
        cfg = self.config
        mask = batch.response_mask
        metrics = {}
        if self.reference is not None:
            with timer.stage("ref_logprob"):
                batch.arrays["ref_logp"] = self.parallel.batched_logprobs(self.reference, batch, cfg.temperature,
                                                                          cfg.per_device_logprob_batch_size)
        with timer.stage("old_logprob"):
            if "rollout_logp" in batch.arrays:
                batch.arrays["old_logp"] = batch.arrays.pop("rollout_logp") * mask
            else:
                batch.arrays["old_logp"] = self.parallel.batched_logprobs(self.actor, batch, cfg.temperature,
                                                                          cfg.per_device_logprob_batch_size)
        with timer.stage("advantage"):
            per_function = {k: np.nan_to_num(v) for k, v in result.per_function.items()}
            adv, adv_metrics = self.objective.advantages_and_metrics(
                scores, mask, batch.group_ids, batch.arrays["old_logp"], batch.arrays.get("ref_logp"),
                per_function_scores=per_function)
            batch.arrays["advantages"] = adv.numpy().astype(np.float32) if isinstance(adv, paddle.Tensor) else adv
        metrics.update(self.parallel.reduce_value_metrics(adv_metrics, "advantage",
                                                          batch.arrays["advantages"][mask > 0]))
        if self.reference is not None:
            diff = (batch.arrays["old_logp"] - batch.arrays["ref_logp"]) * mask
            total, count = self.parallel.sum([diff.sum(), mask.sum()])
            metrics["kl"] = float(total / max(count, 1.0))
        if "reward_kl" in adv_metrics:
            metrics["kl_coeff"] = self.objective.update_kl_controller(adv_metrics["reward_kl"], batch.size)
        metrics.update(self._update(batch, timer))
        return metrics

    @staticmethod
    def _length_metrics(out) -> dict:
        lengths = out.lengths.astype(np.float64)
        return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
                "response_length/min": float(lengths.min()),
                "response_length/clipped_share": float(out.truncated.mean())}

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict:
        if self.eval_data is None:
            return {}
        timer = StageTimer()
        with timer.stage("eval"):
            with self.parallel.rollout_model(self.engine, self.actor):
                metrics = evaluate(self.engine, self.tokenizer, self.eval_data, self.reward_fn, self.config,
                                   self.stop_ids)
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
        progress = _progress(self.total_steps, self.step, cfg.disable_tqdm or not self.parallel.is_logging_rank)
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
        # ranks leave together: one that exits while another is still working can take the rendezvous down
        # under it
        self.parallel.barrier()
        return last


def _topology(config):
    from ..parallel.topology import topology_from_config, world_size_from_env
    degrees = (config.tensor_parallel_degree, config.pipeline_parallel_degree, config.sharding_parallel_degree,
               max(config.data_parallel_degree, 1))
    if world_size_from_env() == 1 and all(d == 1 for d in degrees):
        return None
    return topology_from_config(config)


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

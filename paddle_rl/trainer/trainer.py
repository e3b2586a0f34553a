"""The RL step loop: rollout -> rewards -> reference / old log-probs -> advantages -> update.

Each stage is a call into its own module and reads / extends one StepBatch (paddle_rl/batch.py); the
parallel layout (paddle_rl/layouts) runs the model parts. This file orders the stages and collects metrics.
"""
import contextlib
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
from ..batch import StepBatch, object_column
from ..data.loader import PromptSampler, load_prompt_dataset
from ..layouts import build_layout
from ..models import Tokenizer, adapters_off
from ..models.lora import lora_settings
from ..models.moe import SparseMoE
from ..monitor import MetricsLog, StageTimer, run_summary
from ..monitor.progress import progress_bar
from ..parallel import watchdog
from ..parallel.device import select_device
from ..parallel.topology import topology_from_config, world_size_from_env
from ..rewards import build_reward, check_reward_config
from ..rollout import EngineSettings, RolloutEngine, SamplingParams, sample_key
from . import faults
from .checkpoint import (CheckpointError, check_shared_folder, checkpoint_dirs, load_optimizer, load_trainer_state,
                         master_state, resolve_resume, save_checkpoint, seed_rngs, set_rng_state, warn_pickled)
from .critic import build_critic, check_critic_config
from .evaluate import episode_maker, evaluate
from .logprobs import reuses_rollout_logprobs
from .nonfinite import NonFiniteGuard, first_nonfinite_grad
from .precision import precision_for
from .preflight import check_paths
from .rollouts import build_rollout
from .scoring import metric_columns, per_function_scores, reward_result, score

logger = logging.getLogger("paddle_rl")


class RLTrainer:
    uses_reference = True  # loads the reference model when the KL settings need one

    def __init__(self, config, topology=None):
        """`topology`: the process grid (parallel/topology.py); default: from the config's degrees when launched on
        several processes, else a single process."""
        self.started = time.time()  # the run's wall time counts its setup (models, data) too
        check_paths(config)
        check_reward_config(config)  # reward names against the registry, before any model loads
        self.config = config
        self.device = select_device()  # the launcher's GPU for this rank (or the CPU), before any tensor exists
        ops.configure(config.use_custom_ops)
        self.layout = build_layout(topology if topology is not None else _topology(config),
                                   share_prompts=config.share_prompt_prefix,
                                   max_tokens=config.max_tokens_per_micro_batch,
                                   remove_padding=config.use_remove_padding)
        self.layout.check_config(config)
        check_shared_folder(config.output_dir, self.layout.first_of_ranks, **self.layout.resume_args())
        seed_rngs(config.seed)
        model_dir = config.actor_model_name_or_path
        self.tokenizer_dir = config.tokenizer_name_or_path or model_dir
        self.tokenizer = Tokenizer.from_pretrained(self.tokenizer_dir)
        self.objective = Objective(config, reduce=self.layout.stats_reduce)
        check_critic_config(config, self.objective.uses_critic)  # the layouts a critic runs on, before models load
        self.train_data = self._load_train_data()
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
            self.actor = self.layout.load_model(model_dir, lora=lora_settings(config), adapter=config.lora_path or None)
        self.actor.recompute = config.recompute_what
        if config.recompute_what == "core_attn_mlp" and any(isinstance(m, SparseMoE) for m in self.actor.sublayers()):
            logger.warning("recompute_granularity core_attn_mlp: the sparse MoE blocks keep their activations (the "
                           "dense MLP blocks and the attention cores are recomputed)")
        self.precision = precision_for(config)  # bf16 / use_fp32_compute (trainer/precision.py)
        self.precision.prepare_model(self.actor)
        if self.actor.router_aux_loss_coef and config.pipeline_parallel_degree > 1:
            raise ValueError("the MoE load-balancing loss (config.json output_router_logits: true, "
                             f"router_aux_loss_coef {self.actor.router_aux_loss_coef}) needs the routers of every "
                             "layer in one forward: not supported with pipeline_parallel_degree > 1")
        self.reference = None
        self._reference_view = contextlib.nullcontext
        reference_dir = config.reference_model_name_or_path or model_dir
        if self.uses_reference and self.objective.needs_reference:
            if self.actor.lora is not None and reference_dir == model_dir:
                # LoRA: the reference is the frozen base itself, the actor with its adapters off (no second copy)
                self.reference, self._reference_view = self.actor, adapters_off
            else:
                with unique_name.guard("reference_"):
                    self.reference = self.layout.load_model(reference_dir)
                self.reference.eval()
                for p in self.reference.parameters():
                    p.stop_gradient = True
                self.precision.prepare_model(self.reference)
        self.pad_id = self.tokenizer.pad_token_id
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.actor.config.eos_token_ids))
        self.make_episodes = episode_maker(config, self.tokenizer, self.stop_ids)
        if not self.stop_ids:
            raise ValueError(f"{self.tokenizer_dir}: no EOS token (tokenizer_config.json eos_token or "
                             "generation_config.json eos_token_id)")
        self.engine = RolloutEngine(self.actor, settings=EngineSettings.from_config(config, self.pad_id, self.stop_ids))
        self.reward_fn = build_reward(config, broadcast_group=self.layout.reward_group)
        self.mini_batches_per_step = config.global_batch_size // config.mini_batch_prompts
        self.optimizer, self.scheduler = self.layout.build_optimizer(
            self.actor, config, self.total_steps * self.mini_batches_per_step * config.update_iters)
        self.critic = build_critic(config, self.layout, self.objective.uses_critic,
                                   self.total_steps * self.mini_batches_per_step * config.update_iters)
        self.actor, self.optimizer = self.precision.prepare_training(self.actor, self.optimizer)
        if self.critic is not None:
            self.precision.prepare_model(self.critic.model)
            self.critic.model, self.critic.optimizer = self.precision.prepare_training(self.critic.model,
                                                                                       self.critic.optimizer)
        self.step = 0
        self.nonfinite = NonFiniteGuard(config.max_nonfinite_skips)
        self.log = MetricsLog(config.output_dir, config.logging_dir or os.path.join(config.output_dir, "logs"),
                              config.report_to, config.logging_steps, config.run_name,
                              enabled=self.layout.is_logging_rank)
        self.rollout = build_rollout(self)
        self._resume(resolve_resume(config.resume_from_checkpoint, config.output_dir))

    def _load_train_data(self):
        cfg = self.config
        return load_prompt_dataset(cfg.train_datasets, self.tokenizer, cfg.prompt_key, cfg.response_key,
                                   cfg.max_prompt_len, cfg.prompt_overflow)

    # ---------------------------------------------------------------- resume / save
    def _resume(self, path: Optional[str]) -> None:
        if path is None:
            return
        state = load_trainer_state(path)
        warn_pickled(path, **self.layout.resume_args())
        self.layout.load_weights(self.actor, master_state(path))
        load_optimizer(path, self.optimizer, self.scheduler, state, **self.layout.resume_args())
        self.sampler.set_state_dict(state["sampler"])
        self.objective.set_state_dict(state.get("objective", {}))
        self.rollout.set_state_dict(state.get("rollout", {}), path)
        self.nonfinite.set_state_dict(state.get("nonfinite", {}))
        if self.critic is not None:
            self.critic.resume(path, state, **self.layout.resume_args())
        set_rng_state(state["rng"], path, **self.layout.resume_args())
        self.step = int(state["step"])
        self.log.truncate_after(self.step)
        logger.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Optional[str]:
        """checkpoint-<step>; None when it could not be written and save_error is continue."""
        watchdog.note(f"step {self.step}, checkpoint save")
        state = {"sampler": self.sampler.state_dict(), "objective": self.objective.state_dict(),
                 "total_steps": self.total_steps, "nonfinite": self.nonfinite.state_dict(),
                 "rollout": self.rollout.state_dict()}
        extra_parts = None
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            extra_parts = self.critic.checkpoint_writer(save_optimizer=not self.config.ignore_save_lr_and_optim,
                                                        **self.layout.resume_args())
        try:
            return save_checkpoint(self.config.output_dir, self.step, self.actor, self.tokenizer_dir, self.optimizer,
                                   self.scheduler, state, save_optimizer=not self.config.ignore_save_lr_and_optim,
                                   total_limit=self.config.save_total_limit,
                                   extra_files=self.rollout.extra_files(), extra_parts=extra_parts,
                                   save_dtype=self.config.save_dtype,
                                   **self.layout.checkpoint_args(self.actor))
        except CheckpointError as e:
            if self.config.save_error != "continue":
                raise
            logger.error("%s; training goes on (save_error: continue)", e)
            return None

    # ---------------------------------------------------------------- stages
    def _draw(self, step: int, gen_round: int = 0):
        """The next sampler batch's prompts for `step` (this rank's share): (records, prompt ids, keys, params)."""
        cfg = self.config
        indices = self.layout.batch.local_prompt_indices(self.sampler.next_batch(), cfg.mini_batch_prompts)
        items = [self.train_data[i] for i in indices]
        keys = [sample_key(cfg.seed, step, it["uid"], j, gen_round) for it in items for j in range(cfg.rollout_n)]
        return items, [it["prompt_ids"] for it in items], keys, SamplingParams.from_config(cfg, self.stop_ids)

    def _generate_round(self, step: int, timer: StageTimer, gen_round: int) -> StepBatch:
        """One generation round of this rank's share of a sampler batch: rollout (here, or taken from the
        asynchronous worker), rewards, shaped scores."""
        with timer.stage("rollout"):
            faults.die("rollout", step, self.layout.rank)
            items, batch = self.rollout.take(step, lambda s: self._draw(s, gen_round))
        local = batch["group"]   # the engine's: each row's prompt, by its index in this draw
        batch["item"] = object_column(items[g] for g in local)
        batch["group"] = self.layout.batch.global_groups(local, self.config.mini_batch_prompts, gen_round)
        with timer.stage("reward"):
            score(batch, self.tokenizer, self.reward_fn)
        batch.meta["shape_metrics"] = self._shape_scores(batch)
        return batch

    def _shape_scores(self, batch: StepBatch) -> dict:
        """Objective's score shaping on the scored samples (column `scores`); samples the reward server skipped
        stay NaN."""
        skipped = batch.get("skipped")
        valid = np.ones(batch.size, dtype=bool) if skipped is None else ~skipped
        scores = np.full(batch.size, np.nan, dtype=np.float32)
        metrics = {}
        if valid.any():
            scores[valid], metrics = self.objective.shape_scores(batch["reward"][valid], batch["lengths"][valid],
                                                                 batch["truncated"][valid])
        batch["scores"] = scores
        return metrics

    def _generate_batch(self, step: int, timer: StageTimer):
        """Generation rounds until the step's batch is complete (one round unless DAPO dynamic sampling drops
        zero-variance groups or the reward server skipped samples). Returns (every generated sample, the
        training batch selected from them, metrics).

        Under dynamic sampling every rank sees every rank's samples in the single-process order, so the
        ranks agree on the rounds and select the same groups as one process; each then trains on its share."""
        cfg = self.config
        group_view = self.layout.batch
        local_rounds, rounds = [], []
        for gen_round in range(1, max(1, cfg.max_gen_batches if cfg.dynamic_sampling else 1) + 1):
            local = self._generate_round(step, timer, gen_round - 1)
            local_rounds.append(local)
            rounds.append(group_view.to_global(local) if cfg.dynamic_sampling else local)
            pool = StepBatch.concat(rounds)
            group_ids = pool["group"]
            keep, filter_metrics = self.objective.filter_groups(pool["scores"], group_ids)
            skipped = pool.get("skipped")
            if skipped is not None:
                keep = keep & ~np.isin(group_ids, group_ids[skipped])
            if cfg.dynamic_sampling:
                index = self.objective.select_groups(keep, group_ids, cfg.global_batch_size, gen_round)
            elif skipped is not None:
                # without dynamic sampling only this rank's skipped groups leave, in the first and only round
                whole_groups = len(np.unique(group_ids)) - len(np.unique(group_ids[~keep]))
                index = self.objective.select_groups(keep, group_ids, whole_groups, max(gen_round, cfg.max_gen_batches))
            else:
                index = np.arange(pool.size)
            if index is not None:
                break
        train = pool.select(index)
        if cfg.dynamic_sampling:
            train = group_view.local_share(train, cfg.mini_batch_prompts)
        metrics = dict(local_rounds[-1].meta["shape_metrics"])
        metrics.update(filter_metrics)
        metrics["gen_rounds"] = float(gen_round)
        return StepBatch.concat(local_rounds), train, metrics

    def _update(self, batch: StepBatch, timer: StageTimer) -> dict:
        cfg = self.config
        minis = [np.flatnonzero(batch["mini_batch"] == m) for m in np.unique(batch["mini_batch"])]
        micro = cfg.per_device_train_batch_size
        keys = self._loss_keys(batch)
        collected, weights, grad_norms, lrs = {}, [], [], []
        step, rank = self.step + 1, self.layout.rank
        updates, skipped = cfg.update_iters * len(minis), 0
        self.actor.train()
        with timer.stage("update"):
            for _ in range(cfg.update_iters):
                for rows in minis:
                    mini = batch.select(rows)
                    # global token / sequence counts (summed over data-parallel ranks)
                    num_tokens, num_seqs = (float(v) for v in self.layout.batch.sum(
                        self.objective.loss_normalizers(mini["response_mask"])))

                    def loss_fn(part, logp, entropy):
                        out = self._micro_loss(part, logp, entropy, num_tokens, num_seqs)
                        out = self._with_router_aux_loss(out, part, num_seqs)
                        out.loss = faults.poison_loss(step, rank, out.loss)
                        return out

                    finite_loss = True
                    with self.precision.autocast():
                        outs = self.layout.forward_backward(self.actor, mini, keys, micro, self.loss_temperature,
                                                            loss_fn)
                    for out in outs:
                        for k, v in out.metrics.items():
                            collected.setdefault(k, []).append(v)
                        weights.append(out.num_tokens)
                        finite_loss = finite_loss and math.isfinite(float(out.loss))
                    faults.poison_grads(step, rank, self.actor)
                    faults.die("update", step, rank)
                    norm = self.layout.clip_grad_norm_(self.actor, cfg.max_grad_norm)
                    lrs.append(self.optimizer.get_lr())
                    if self.layout.any_rank(not (finite_loss and math.isfinite(norm))):
                        self._skip_update(step, len(lrs), updates, finite_loss)
                        skipped += 1
                        continue
                    self.nonfinite.applied()
                    grad_norms.append(norm)
                    self.optimizer.step()
                    self.optimizer.clear_grad(set_to_zero=False)
                    self.scheduler.step()
        metrics = {f"actor/{k}": v for k, v in self.layout.weighted_means(collected, weights).items()}
        # the norms of the applied updates (NaN when every update of the step was skipped)
        metrics["actor/grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        metrics["actor/lr"] = float(lrs[-1])
        metrics["actor/nonfinite_skipped"] = float(skipped)
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite.total)
        return metrics

    @property
    def loss_temperature(self) -> float:
        """The update's log-probs are of logits / this: the sampling temperature, as the rollout's and the old
        policy's log-probs are."""
        return self.config.temperature

    @staticmethod
    def _loss_keys(batch: StepBatch) -> list:
        """The per-token columns `_micro_loss` reads besides the response mask."""
        return ["old_logp", "advantages"] + [k for k in ("ref_logp", "is_weight") if k in batch]

    def _micro_loss(self, part, logp, entropy, num_tokens: float, num_seqs: float):
        """One micro-batch's share of the mini-batch loss (a LossOutput): the Objective's."""
        return self.objective.loss(logp, part["old_logp"], part.get("ref_logp"), part["advantages"],
                                   part["response_mask"], entropy, num_tokens, num_seqs, part.get("is_weight"))

    def _skip_update(self, step: int, update: int, updates: int, finite_loss: bool) -> None:
        """An update with a non-finite loss or gradient norm on some rank (every rank comes here together): no
        optimizer or schedule step, gradients dropped; NonFiniteGuard stops the run after max_nonfinite_skips in a
        row, naming the first non-finite tensor over the ranks."""
        mine = "loss" if not finite_loss else first_nonfinite_grad(self.actor.parameters())
        if mine is not None and mine != "loss":
            mine = f"gradient of {mine}"
        if mine is not None and self.layout.is_parallel:
            mine += f" (rank {self.layout.rank})"
        culprit = self.layout.first_of_ranks(mine) or "gradient norm (every gradient is finite; their squares overflow)"
        self.optimizer.clear_grad(set_to_zero=False)
        self.nonfinite.skip(step, update, updates, culprit)

    def _with_router_aux_loss(self, out, part, num_seqs: float):
        """The micro-batch's loss plus the MoE load-balancing loss of its forward (`CausalLM.aux_loss`) times
        router_aux_loss_coef (non-zero when config.json's output_router_logits is true, as transformers adds it) and
        the micro-batch's share of the mini-batch's sequences, so micro-batches and ranks sum to coef x their mean."""
        coef = self.actor.router_aux_loss_coef
        if not coef:
            return out
        aux = self.actor.aux_loss()
        live = float((part["response_mask"].numpy().sum(-1) > 0).sum())
        out.loss = out.loss + (coef * live / max(num_seqs, 1.0)) * aux
        out.metrics["router_aux_loss"] = float(aux)
        return out

    # ---------------------------------------------------------------- one step
    def train_step(self) -> dict:
        cfg = self.config
        step = self.step + 1
        timer = StageTimer(on_stage=lambda name: watchdog.note(f"step {step}, {name}"))
        start = time.perf_counter()
        pool, batch, metrics = self._generate_batch(step, timer)
        metrics = self.layout.batch.reduce_metrics(metrics)
        everything = self.layout.batch.gather(pool, metric_columns(pool))
        metrics.update(reward_result(everything).metrics("reward"))
        metrics.update(self._length_metrics(everything))
        generated = float(pool["lengths"].sum())
        batch, placement = self.layout.batch.place(batch, cfg.mini_batch_prompts, cfg.balance_batch)
        metrics.update(placement)
        batch.with_prompt_layout(self.pad_id)
        batch["response_mask"] = np.asarray(
            self.objective.response_mask_for_update(batch["response_mask"], batch["truncated"]), dtype=np.float32)
        mask = batch["response_mask"]
        if self.layout.batch.sum([mask.sum()])[0] > 0:  # every rank takes the same branch
            metrics.update(self._prepare_and_update(batch, timer))
        else:
            metrics["actor/skipped_update"] = 1.0
        elapsed = time.perf_counter() - start
        metrics.update(timer.metrics())
        metrics.update(self.rollout.metrics)
        metrics["time/step"] = elapsed
        generated, prompt_tokens, trained, decode_rows, rows = (float(v) for v in self.layout.batch.sum(
            [generated, float(batch["prompt_mask"].sum()), float(mask.sum()) * cfg.update_iters,
             float(pool["decode_steps"].sum()), float(batch.size)]))
        metrics["perf/generated_tokens"] = generated
        metrics["perf/trained_tokens"] = trained
        metrics["perf/decode_row_steps"] = decode_rows
        metrics["prompt_length/mean"] = prompt_tokens / max(rows, 1.0)
        # the generation's own seconds: the worker's when it runs ahead (the trainer's wait is time/rollout)
        generating = metrics.get("async/worker_generate_s", timer.seconds["rollout"])
        metrics["perf/generated_tokens_per_s"] = generated / max(generating, 1e-9)
        metrics["perf/tokens_per_s"] = (generated + prompt_tokens) / elapsed
        metrics["perf/trained_tokens_per_s"] = trained / max(timer.seconds.get("update", 0.0), 1e-9)
        metrics["epoch"] = float(self.rollout.sampler_point[0])
        self.step = step
        return metrics

    def _prepare_and_update(self, batch: StepBatch, timer: StageTimer) -> dict:
        cfg = self.config
        mask = batch["response_mask"]
        metrics = {}
        if self.reference is not None:
            with timer.stage("ref_logprob"), self._reference_view(self.reference) as reference, \
                    self.precision.autocast():
                batch["ref_logp"] = self.layout.logprobs(reference, batch, cfg.temperature,
                                                         cfg.per_device_logprob_batch_size)
        rollout_greedy, greedy = batch.pop("rollout_greedy", None), None
        with timer.stage("old_logprob"):
            if "rollout_logp" in batch and reuses_rollout_logprobs(cfg, self.mini_batches_per_step):
                batch["old_logp"] = batch.pop("rollout_logp") * mask
            else:
                # with the rollout's greedy choices, the pass gives the trainer's (argmax of the same logits)
                with_greedy = rollout_greedy is not None and "rollout_logp" in batch
                with self.precision.autocast():
                    out = self.layout.logprobs(self.actor, batch, cfg.temperature, cfg.per_device_logprob_batch_size,
                                               with_greedy=with_greedy)
                batch["old_logp"], greedy = out if with_greedy else (out, None)
        if "rollout_logp" in batch:  # the gap between the rollout's log-probs and the trainer's, every step
            is_weight, keep, corr_metrics = self.objective.rollout_correction(
                batch["old_logp"], batch.pop("rollout_logp"), mask,
                greedy=None if greedy is None else (rollout_greedy, greedy))
            metrics.update(self.layout.batch.reduce_metrics(corr_metrics))
        if cfg.rollout_correction:  # rejected tokens leave the mask of everything below
            batch["is_weight"], batch["response_mask"] = is_weight, keep
            mask = batch["response_mask"]
            if self.layout.batch.sum([mask.sum()])[0] == 0:  # every token rejected on every rank: no update
                metrics["actor/skipped_update"] = 1.0
                return metrics
        critic_metrics = None
        if self.critic is not None:
            if self.critic.fuses_value_pass:  # one update pass: its forward gives the values (no value pass)
                with timer.stage("critic_update"):
                    batch["values"], critic_metrics = self.critic.update_from_rollout(batch, self.objective)
            else:
                with timer.stage("values"):
                    batch["values"] = self.critic.values(batch)
        with timer.stage("advantage"):
            adv, returns, adv_metrics = self.objective.step_advantages_and_returns(
                batch["scores"], mask, batch["group"], batch["old_logp"], batch.get("ref_logp"),
                per_function_scores=per_function_scores(batch), values=batch.get("values"))
            batch["advantages"] = adv.numpy().astype(np.float32) if isinstance(adv, paddle.Tensor) else adv
        metrics.update(self.layout.batch.reduce_metrics(adv_metrics))
        metrics.update(self.layout.batch.value_stats("advantage", batch["advantages"][mask > 0]))
        if self.critic is not None:
            batch["returns"] = returns
            if critic_metrics is None:
                with timer.stage("critic_update"):
                    critic_metrics = self.critic.update(batch, self.objective)
            metrics.update(critic_metrics)
            if self.step < self.config.critic_warmup_steps:  # the critic's warm-up: no actor update yet
                metrics["actor/critic_warmup"] = 1.0
                return metrics
        metrics.update(self._update(batch, timer))
        return metrics

    @staticmethod
    def _length_metrics(batch: StepBatch) -> dict:
        lengths = batch["lengths"].astype(np.float64)
        out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
               "response_length/min": float(lengths.min()),
               "response_length/clipped_share": float(batch["truncated"].mean())}
        if "turns" in batch:  # multi-turn episodes
            calls = float(batch["tool_calls"].sum())
            out.update({"episode/turns/mean": float(batch["turns"].mean()), "episode/turns/max":
                        float(batch["turns"].max()), "episode/tool_calls/mean": float(batch["tool_calls"].mean()),
                        "episode/tool_error_share": float(batch["tool_errors"].sum()) / calls if calls else 0.0,
                        "episode/policy_token_share": float(batch["policy_tokens"].sum() / max(lengths.sum(), 1.0))})
        return out

    def episodes_for(self, items, n: Optional[int] = None):
        """The multi-turn episodes of a rollout of `items`, `n` samples each (None without env_plugin)."""
        return None if self.make_episodes is None else self.make_episodes(items, n or self.config.rollout_n)

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict:
        if self.eval_data is None:
            return {}
        timer = StageTimer(on_stage=lambda name: watchdog.note(f"after step {self.step}, {name}"))
        with timer.stage("eval"):
            with self.layout.rollout_engine(self.engine) as engine:
                metrics = evaluate(engine, self.tokenizer, self.eval_data, self.reward_fn, self.config,
                                   self.stop_ids, self.make_episodes)
        metrics.update(timer.metrics())
        return metrics

    def _should_eval(self, step: int) -> bool:
        cfg = self.config
        return self.eval_data is not None and cfg.evaluation_strategy != "no" and (
            step % cfg.eval_steps == 0 or step == self.total_steps)

    def _should_save(self) -> bool:
        cfg = self.config
        if cfg.save_strategy == "steps":
            return self.step % cfg.save_steps == 0 or self.step == self.total_steps
        if cfg.save_strategy == "epoch":
            return self.rollout.sampler_point[1] or self.step == self.total_steps
        return False

    def train(self) -> dict:
        """Run to the end; the run's summary (monitor/summary.py) is logged last, finished or failed."""
        try:
            last = self._train()
        except BaseException as e:
            watchdog.leaving()  # peers raising the same error may exit first: not a dead rank
            self._log_summary(time.time() - self.started, e)
            raise
        finally:
            self.rollout.close()
        self._log_summary(time.time() - self.started)
        return last

    def _log_summary(self, seconds: float, error: Optional[BaseException] = None) -> None:
        if not self.layout.is_logging_rank:
            return
        try:
            saved = checkpoint_dirs(self.config.output_dir)
            lines = run_summary(self.log.path, self.log.logging_dir, self.log.dashboard_names, self.step,
                                self.total_steps, seconds, os.path.abspath(saved[-1]) if saved else None, error)
        except Exception as e:  # noqa: BLE001 - a failed run's own error is the one to raise
            logger.warning("run summary unavailable: %s: %s", type(e).__name__, e)
            return
        for line in lines:
            (logger.info if error is None else logger.error)("%s", line)

    def _train(self) -> dict:
        cfg = self.config
        if self.step == 0 and self.eval_data is not None and cfg.evaluation_strategy != "no":
            initial = self.evaluate()
            self.log.log(0, initial)
            logger.info("step 0 eval: %s", _summary(initial))
        last = {}
        # log records go through the bar while it is shown (monitor/progress.py), so they do not garble its line
        with _progress(self.total_steps, self.step,
                       cfg.disable_tqdm or not self.layout.is_logging_rank) as progress:
            while cfg.do_train and self.step < self.total_steps:
                metrics = self.train_step()
                self.rollout.stepped()
                if self._should_eval(self.step):
                    metrics.update(self.evaluate())
                self.log.log(self.step, metrics)
                last = metrics
                progress.update(_summary(metrics, short=True))
                if self.step % cfg.logging_steps == 0:
                    logger.info("step %d/%d %s", self.step, self.total_steps, _summary(metrics))
                if self._should_save():
                    self.save()
        self.log.close()
        # ranks leave together: one that exits while another is still working can take the rendezvous down
        # under it. A peer that passed this barrier may exit before this rank's barrier returns: expected.
        watchdog.leaving()
        self.layout.barrier()
        return last


def _topology(config):
    degrees = (config.tensor_parallel_degree, config.pipeline_parallel_degree, config.sharding_parallel_degree,
               max(config.data_parallel_degree, 1))
    if world_size_from_env() == 1 and all(d == 1 for d in degrees):
        return None
    return topology_from_config(config)


SUMMARY_KEYS = ("reward/mean", "accuracy", "eval/accuracy", "eval/reward_mean", "kl", "actor/pg_loss",
                "response_length/mean", "time/step")


def _summary(metrics: dict, short: bool = False) -> str:
    keys = list(SUMMARY_KEYS[:3] if short else SUMMARY_KEYS)
    if "eval/accuracy" in keys:  # several eval files: each one's accuracy beside the overall one
        at = keys.index("eval/accuracy") + 1
        keys[at:at] = sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def _progress(total: int, done: int, disabled: bool):
    """The step bar (a context manager yielding an object with update(summary)); logging goes through it."""
    return progress_bar(total, initial=done, disabled=disabled)

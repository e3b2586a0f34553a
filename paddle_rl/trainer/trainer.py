"""The RL step: rollout -> rewards -> reference / old log-probs -> advantages -> update.

Each stage is a call into its own module and reads / extends one StepBatch (paddle_rl/batch.py); the
parallel layout (paddle_rl/layouts) runs the model parts; the loop around the steps (data, optimizer, update,
checkpoints, metrics, eval) is the StepLoop (trainer/loop.py) that supervised fine-tuning runs too. This file
orders the stages and collects metrics.
"""
import contextlib
import logging
import time
from typing import Optional

import numpy as np
import paddle
from paddle.utils import unique_name

from ..algorithms import Objective
from ..batch import StepBatch, object_column
from ..config import ConfigError
from ..data.loader import load_prompt_dataset
from ..models import adapters_off
from ..monitor import StageTimer
from ..optim import make_state as make_optimizer_state
from ..parallel import watchdog
from ..rollout import SamplingParams, sample_key
from . import faults
from .checkpoint import resolve_resume
from .completions import completion_records, record_columns, sample_rows
from .critic import build_critic, check_critic_config
from .logprobs import old_logprobs_from_update, reuses_rollout_logprobs
from .loop import StepLoop
from .preflight import preflight
from .rollouts import RolloutParts, build_rollout
from .scoring import metric_columns, per_function_scores, reward_result, score

logger = logging.getLogger("paddle_rl")


class RLTrainer:
    """An RL run: a StepLoop (trainer/loop.py) with the RL step's parts around it (the objective, the reference,
    the rollout engine and where its batches come from, the reward, the critic)."""

    def __init__(self, config, topology=None):
        """`topology`: the process grid (parallel/topology.py); default: from the config's degrees when launched on
        several processes, else a single process."""
        preflight(config)  # every missing prerequisite (paths, data, reward, plugins) at once, before models load
        self.loop = loop = StepLoop(config, topology)
        self.config, self.layout, self.tokenizer, self.tokenizer_dir = config, loop.layout, loop.tokenizer, \
            loop.tokenizer_dir
        if config.env_plugin == "agent" and self.layout.is_parallel:
            raise ConfigError("env_plugin agent: the trainer runs as one process for now (each rank would run its own "
                              "programs and proxy); launch without data / sharding / tensor / pipeline parallelism")
        self.objective = Objective(config, reduce=self.layout.stats_reduce)
        check_critic_config(config, self.objective.uses_critic)  # the layouts a critic runs on, before models load
        loop.load_data(load_prompt_dataset(config.train_datasets, self.tokenizer, config.prompt_key,
                                           config.response_key, config.max_prompt_len, config.prompt_overflow,
                                           apply_chat_template=config.apply_chat_template,
                                           system_prompt=config.system_prompt))
        loop.load_actor()
        self.train_data, self.eval_data, self.sampler = loop.train_data, loop.eval_data, loop.sampler
        self.total_steps, self.mini_batches_per_step = loop.total_steps, loop.mini_batches_per_step
        self.precision, self.pad_id, self.stop_ids = loop.precision, loop.pad_id, loop.stop_ids
        self.reference = None
        self._reference_view = contextlib.nullcontext
        model_dir = config.actor_model_name_or_path
        reference_dir = config.reference_model_name_or_path or model_dir
        if self.objective.needs_reference:
            if loop.actor.lora is not None and reference_dir == model_dir:
                # LoRA: the reference is the frozen base itself, the actor with its adapters off (no second copy)
                self.reference, self._reference_view = loop.actor, adapters_off
            else:
                with unique_name.guard("reference_"):
                    self.reference = self.layout.load_model(reference_dir)
                self.reference.eval()
                for p in self.reference.parameters():
                    p.stop_gradient = True
                self.precision.prepare_model(self.reference)
        self.make_episodes, self.engine, self.reward_fn = loop.generation_parts()
        loop.build_optimizer()
        self.actor, self.optimizer, self.scheduler = loop.actor, loop.optimizer, loop.scheduler
        self.nonfinite, self.log = loop.nonfinite, loop.log
        self.critic = build_critic(config, self.layout, self.objective.uses_critic, loop.total_updates)
        if self.critic is not None:
            self.precision.prepare_model(self.critic.model)
            self.critic.model, self.critic.optimizer = self.precision.prepare_training(self.critic.model,
                                                                                       self.critic.optimizer)
            make_optimizer_state(self.critic.optimizer)
        self.old_logp_from_update = old_logprobs_from_update(config, self.mini_batches_per_step,
                                                             self.objective.uses_critic)
        # the update's own log-probs of the step's rows and their argmax (old_logp_from_update)
        self._update_logp = self._update_greedy = None
        # the rollout source reads these parts of the run, not the trainer
        rollout = build_rollout(RolloutParts(config, self.layout, self.engine, self.actor, self.sampler,
                                             self.tokenizer, self.pad_id, self.total_steps, self.episodes_for,
                                             lambda: loop.step))
        self.rollout = faults.wrap_rollout(rollout, self.layout.rank)   # the source itself outside fault tests
        loop.resume(resolve_resume(config.resume_from_checkpoint, config.output_dir), self._resume)

    @property
    def step(self) -> int:
        """RL steps applied (the loop's count)."""
        return self.loop.step

    @step.setter
    def step(self, value: int) -> None:
        self.loop.step = value

    # ---------------------------------------------------------------- resume / save
    def _resume(self, path: str, state: dict) -> None:
        """The RL parts of checkpoint `path`'s state (StepLoop.resume restores the rest)."""
        self.objective.set_state_dict(state.get("objective", {}))
        self.rollout.set_state_dict(state.get("rollout", {}), path)
        if self.critic is not None:
            self.critic.resume(path, state, **self.layout.resume_args())

    def save(self) -> Optional[str]:
        """checkpoint-<step>; None when it could not be written and save_error is continue."""
        state = {"objective": self.objective.state_dict(), "rollout": self.rollout.state_dict()}
        extra_parts = None
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            extra_parts = self.critic.checkpoint_writer(save_optimizer=not self.config.ignore_save_lr_and_optim,
                                                        **self.layout.resume_args())
        return self.loop.save(state, extra_files=self.rollout.extra_files(), extra_parts=extra_parts)

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
        metrics["batch/gen_rounds"] = float(gen_round)
        return StepBatch.concat(local_rounds), train, metrics

    def _update(self, batch: StepBatch, timer: StageTimer) -> dict:
        """The actor's update over the placed batch (StepLoop.update) with the Objective's loss."""
        # the update's log-probs are of logits / the sampling temperature, as the rollout's and the old policy's are
        return self.loop.update(batch, timer, self._loss_keys(batch), self._micro_loss, self.config.temperature,
                                self.objective.loss_normalizers, with_greedy=self._update_greedy is not None)

    @staticmethod
    def _loss_keys(batch: StepBatch) -> list:
        """The columns `_micro_loss` reads besides the response mask (row_index: the rows the update's own old
        log-probs go back to, when it gives them)."""
        return ["advantages"] + [k for k in ("old_logp", "ref_logp", "is_weight", "row_index") if batch.has(k)]

    def _micro_loss(self, part, logp, entropy, num_tokens: float, num_seqs: float):
        """One micro-batch's share of the mini-batch loss (a LossOutput): the Objective's. Without old_logp
        (old_logprob_pass auto, on-policy) the old policy is this forward's, detached, kept for the step's metrics."""
        old_logp = part.get("old_logp")
        if old_logp is None:
            old_logp = logp.detach()
            rows = part["row_index"].numpy()
            self._update_logp[rows, :logp.shape[1]] = old_logp.numpy()
            if "greedy" in part:
                self._update_greedy[rows, :logp.shape[1]] = part["greedy"].numpy()
        return self.objective.loss(logp, old_logp, part.get("ref_logp"), part["advantages"],
                                   part["response_mask"], entropy, num_tokens, num_seqs, part.get("is_weight"))

    # ---------------------------------------------------------------- one step
    def train_step(self) -> dict:
        cfg = self.config
        step = self.step + 1
        timer = StageTimer(on_stage=lambda name: watchdog.note(f"step {step}, {name}"))
        start = time.perf_counter()
        pool, batch, metrics = self._generate_batch(step, timer)
        metrics = self.layout.batch.reduce_metrics(metrics)
        metrics.update(self._group_accounting(pool, batch))
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
        self._log_completions(step, batch)
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
        metrics["training/epoch"] = float(self.rollout.sampler_point[0])
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
        reuse = batch.has("rollout_logp") and reuses_rollout_logprobs(cfg, self.mini_batches_per_step)
        from_update = self.old_logp_from_update and not reuse
        if from_update:  # on-policy: the update's forward gives them (old_logprob_pass auto), no pass, no stage
            rollout_logp = batch.pop("rollout_logp", None)
            batch["row_index"] = np.arange(batch.size, dtype=np.int64)
            self._update_logp = np.zeros(mask.shape, dtype=np.float32)
            if rollout_greedy is not None and rollout_logp is not None:
                self._update_greedy = np.full(mask.shape, -1, dtype=np.int64)
        elif reuse:
            with timer.stage("old_logprob"):
                batch["old_logp"] = batch.pop("rollout_logp") * mask
        else:
            with timer.stage("old_logprob"):
                # with the rollout's greedy choices, the pass gives the trainer's (argmax of the same logits)
                with_greedy = rollout_greedy is not None and batch.has("rollout_logp")
                with self.precision.autocast():
                    out = self.layout.logprobs(self.actor, batch, cfg.temperature, cfg.per_device_logprob_batch_size,
                                               with_greedy=with_greedy)
                batch["old_logp"], greedy = out if with_greedy else (out, None)
        if batch.has("rollout_logp"):  # the gap between the rollout's log-probs and the trainer's, every step
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
                batch["scores"], mask, batch["group"], batch.get("old_logp"), batch.get("ref_logp"),
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
        if from_update:  # what the old-log-prob pass reports, from the update's own log-probs
            batch["old_logp"], self._update_logp = self._update_logp * mask, None
            metrics.update(self.layout.batch.reduce_metrics(
                self.objective.old_policy_kl(mask, batch["old_logp"], batch.get("ref_logp"))))
            if rollout_logp is not None:
                greedy = None if self._update_greedy is None else (rollout_greedy,
                                                                   np.where(mask > 0, self._update_greedy, -1))
                self._update_greedy = None
                metrics.update(self.layout.batch.reduce_metrics(
                    self.objective.rollout_correction(batch["old_logp"], rollout_logp, mask, greedy=greedy)[2]))
        return metrics

    def _log_completions(self, step: int, batch: StepBatch) -> None:
        """log_completions: every log_completions_steps steps (default logging_steps), num_completions_to_print of
        the rows the step trained on (every rank's, gathered), to completions.jsonl and the dashboards."""
        cfg = self.config
        every = cfg.log_completions_steps or cfg.logging_steps
        if not cfg.log_completions or step % every:
            return
        rows = sample_rows(self.layout.batch.gather(batch, record_columns(batch)), cfg.num_completions_to_print)
        self.log.log_completions(step, completion_records(rows, self.tokenizer))

    def _group_accounting(self, pool: StepBatch, train: StepBatch) -> dict:
        """Where each prompt group the step drew went (summed over the ranks): `batch/groups_drawn` (every
        generation round's), `batch/groups_trained`, `batch/groups_dropped_reward_skipped` (a sample the reward server
        could not score: reward_server_on_failure skip), `batch/groups_dropped_unselected` (left out by dynamic
        sampling, or past the groups it needed), and `batch/partial_groups`: trained groups that do not hold all
        rollout_n samples (0 unless something is broken). drawn = trained + the two dropped counts."""
        drawn = np.unique(pool["group"])
        skipped = pool.get("skipped")
        lost = np.unique(pool["group"][skipped]) if skipped is not None and skipped.any() else drawn[:0]
        trained, counts = np.unique(train["group"], return_counts=True)
        partial = int((counts != self.config.rollout_n).sum())
        unselected = len(drawn) - len(trained) - len(lost)
        totals = self.layout.batch.sum([float(len(drawn)), float(len(trained)), float(len(lost)), float(unselected),
                                        float(partial)])
        names = ("groups_drawn", "groups_trained", "groups_dropped_reward_skipped", "groups_dropped_unselected",
                 "partial_groups")
        return {f"batch/{name}": float(value) for name, value in zip(names, totals)}

    @staticmethod
    def _length_metrics(batch: StepBatch) -> dict:
        lengths = batch["lengths"].astype(np.float64)
        out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
               "response_length/min": float(lengths.min()),
               "response_length/clipped_share": float(batch["truncated"].mean())}
        if batch.has("turns"):  # multi-turn episodes
            calls = float(batch["tool_calls"].sum())
            out.update({"episode/turns/mean": float(batch["turns"].mean()), "episode/turns/max":
                        float(batch["turns"].max()), "episode/tool_calls/mean": float(batch["tool_calls"].mean()),
                        "episode/tool_error_share": float(batch["tool_errors"].sum()) / calls if calls else 0.0,
                        "episode/policy_token_share": float(batch["policy_tokens"].sum() / max(lengths.sum(), 1.0))})
        if batch.has("agent_failed"):
            out["episode/agent_failed_share"] = float(batch["agent_failed"].mean())
        return out

    def episodes_for(self, items, n: Optional[int] = None):
        """The multi-turn episodes of a rollout of `items`, `n` samples each (None without env_plugin)."""
        return None if self.make_episodes is None else self.make_episodes(items, n or self.config.rollout_n)

    # ---------------------------------------------------------------- loop
    def evaluate(self) -> dict:
        return self.loop.evaluate(self.engine, self.reward_fn, self.make_episodes)

    def epoch_done(self) -> bool:
        """Whether the batch the last step trained on ended an epoch (save_strategy: epoch)."""
        return self.rollout.sampler_point[1]

    def stepped(self) -> None:
        self.rollout.stepped()

    def close(self) -> None:
        self.rollout.close()

    def train(self) -> dict:
        """Run to the end (StepLoop.run); returns the last step's metrics."""
        return self.loop.run(self)

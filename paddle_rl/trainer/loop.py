"""The step loop every trainer shares: RL (trainer.py) and supervised fine-tuning (sft.py) each hold one.

`StepLoop` is the part of a run that does not depend on what a step is: the checks before anything loads, the
parallel layout, the tokenizer, the training data and its sampler, held-out data, the actor with its precision,
optimizer and schedule, the non-finite guard and the metrics log, built in that order by the trainer that owns it
(`load_data`, `load_actor`, `build_optimizer`, so that each trainer can check its own options between them, before
a model loads); then its verbs:

- `update(batch, timer, ...)`: the optimizer steps over a placed batch (update_iters x mini-batches, micro-batches
  run by the layout, gradient clipping, non-finite updates skipped), with the trainer's loss per micro-batch;
- `resume(path, more)` / `save(state, ...)`: what every checkpoint holds (weights, optimizer, schedule, sampler,
  non-finite count, RNG, step), the trainer's own parts beside it;
- `run(job)`: step -> eval -> log -> save until the last step, a progress bar, the run's summary at the end
  (finished or failed). `job` is the trainer: `train_step()`, `evaluate()`, `save()`, `epoch_done()`,
  `stepped()` (after each step's update) and `close()` (when the loop ends, however it ends).
"""
import logging
import math
import os
import time
from typing import Callable, Optional

import numpy as np
from paddle.utils import unique_name

from .. import ops
from ..batch import StepBatch
from ..config import ConfigError
from ..env import training_heap
from ..data.loader import PromptSampler, load_prompt_dataset
from ..layouts import build_layout
from ..models import Tokenizer
from ..models.lora import lora_settings
from ..models.moe import SparseMoE
from ..monitor import MetricsLog, StageTimer, run_summary
from ..monitor.completions import one_line
from ..monitor.run_info import write_run_info
from ..monitor.progress import progress_bar
from ..optim import make_state as make_optimizer_state
from ..parallel import watchdog
from ..parallel.device import select_device
from ..parallel.topology import topology_from_config, world_size_from_env
from ..rewards import build_reward
from ..rollout import EngineSettings, RolloutEngine
from . import faults
from .checkpoint import (CheckpointError, check_shared_folder, checkpoint_dirs, load_optimizer, load_trainer_state,
                         master_state, save_checkpoint, seed_rngs, set_rng_state, warn_pickled)
from .evaluate import episode_maker, evaluate
from .nonfinite import NonFiniteGuard, first_nonfinite_grad
from .precision import precision_for
from .preflight import check_paths

logger = logging.getLogger("paddle_rl")


class StepLoop:
    def __init__(self, config, topology=None):
        """Checks the paths, picks the device, builds the layout (`topology`: the process grid; default: from the
        config's degrees when launched on several processes, else one process), seeds and loads the tokenizer."""
        self.started = time.time()  # the run's wall time counts its setup (models, data) too
        check_paths(config)
        self.config = config
        self.device = select_device()  # the launcher's GPU for this rank (or the CPU), before any tensor exists
        ops.configure(config.use_custom_ops)
        # the fused kernels built and loaded now, in the setup, not inside the first step's rollout: a source change
        # rebuilds them (~1.5 min on 2 cores), which step 1's time/rollout would otherwise count
        ops.available()
        ops.select_kernels(**config.kernel_switches)   # use_flash_attention, use_fused_rms_norm, ... (ops/switches.py)
        layout = build_layout(topology if topology is not None else _topology(config),
                              share_prompts=config.share_prompt_prefix, max_tokens=config.max_tokens_per_micro_batch,
                              remove_padding=config.use_remove_padding)
        self.layout = faults.wrap_layout(layout, lambda: self.step + 1)   # the layout itself outside fault tests
        self.layout.check_config(config)
        check_shared_folder(config.output_dir, self.layout.first_of_ranks, **self.layout.resume_args())
        seed_rngs(config.seed)
        self.tokenizer_dir = config.tokenizer_name_or_path or config.actor_model_name_or_path
        self.tokenizer = Tokenizer.from_pretrained(self.tokenizer_dir)
        self.pad_id = self.tokenizer.pad_token_id
        self.mini_batches_per_step = config.global_batch_size // config.mini_batch_prompts
        self.step = 0

    # ---------------------------------------------------------------- building
    def load_data(self, train_data) -> None:
        """The training records (loaded by the trainer: prompts, or prompt / response pairs), the held-out prompts
        (eval_datasets with do_eval), the sampler and the run's length in steps."""
        cfg = self.config
        self.train_data = train_data
        self.eval_data = None
        if cfg.do_eval and cfg.eval_datasets:
            self.eval_data = load_prompt_dataset(cfg.eval_datasets, self.tokenizer, cfg.prompt_key, cfg.response_key,
                                                 cfg.max_prompt_len, cfg.prompt_overflow, limit=cfg.max_eval_samples,
                                                 apply_chat_template=cfg.apply_chat_template,
                                                 system_prompt=cfg.system_prompt)
        self.sampler = PromptSampler(len(train_data), cfg.global_batch_size, cfg.seed, cfg.dataloader_shuffle,
                                     cfg.dataloader_drop_last)
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else max(
            1, math.ceil(cfg.num_train_epochs * self.sampler.batches_per_epoch))
        self.total_updates = self.total_steps * self.mini_batches_per_step * cfg.update_iters

    def load_actor(self) -> None:
        """The trained model (LoRA adapters on it when the config asks) in the run's precision; `stop_ids`: the
        tokenizer's and the model's end-of-sequence ids."""
        cfg = self.config
        with unique_name.guard("actor_"):
            self.actor = self.layout.load_model(cfg.actor_model_name_or_path, lora=lora_settings(cfg),
                                                adapter=cfg.lora_path or None)
        try:
            self.actor.set_recompute(cfg.recompute_what, cfg.recompute_use_reentrant, cfg.no_recompute_layers)
        except ValueError as e:
            raise ConfigError(f"no_recompute_layers: {e.args[0]}") from None
        if cfg.use_fused_head_and_loss_fn and self.actor.is_last and self.actor.unchunked_head:
            raise ops.SwitchError(self.actor.unchunked_head)
        if cfg.recompute_what == "core_attn_mlp" and any(isinstance(m, SparseMoE) for m in self.actor.sublayers()):
            logger.warning("recompute_granularity core_attn_mlp: the sparse MoE blocks keep their activations (the "
                           "dense MLP blocks and the attention cores are recomputed)")
        self.precision = precision_for(cfg)  # bf16 / use_fp32_compute (trainer/precision.py)
        self.precision.prepare_model(self.actor)
        if self.actor.router_aux_loss_coef and cfg.pipeline_parallel_degree > 1:
            raise ValueError("the MoE load-balancing loss (config.json output_router_logits: true, "
                             f"router_aux_loss_coef {self.actor.router_aux_loss_coef}) needs the routers of every "
                             "layer in one forward: not supported with pipeline_parallel_degree > 1")
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.actor.config.eos_token_ids))
        if not self.stop_ids:
            raise ValueError(f"{self.tokenizer_dir}: no EOS token (tokenizer_config.json eos_token or "
                             "generation_config.json eos_token_id)")

    def build_optimizer(self) -> None:
        """The actor's optimizer and schedule as the run trains them, the non-finite guard and the metrics log."""
        cfg = self.config
        optimizer, self.scheduler = self.layout.build_optimizer(self.actor, cfg, self.total_updates)
        self.actor, self.optimizer = self.precision.prepare_training(self.actor, optimizer)
        make_optimizer_state(self.optimizer)
        self.nonfinite = NonFiniteGuard(cfg.max_nonfinite_skips)
        self.log = MetricsLog(cfg.output_dir, cfg.logging_dir or os.path.join(cfg.output_dir, "logs"),
                              cfg.report_to, cfg.logging_steps, cfg.run_name, enabled=self.layout.is_logging_rank,
                              wandb_proxy=cfg.wandb_http_proxy)
        if self.log.enabled:  # the machine, the software and the config's hash (monitor/run_info.py)
            write_run_info(cfg.output_dir, cfg, self.started)

    # ---------------------------------------------------------------- the update
    def update(self, batch: StepBatch, timer: StageTimer, keys: list, micro_loss: Callable, temperature: float,
               normalizers: Callable, with_greedy: bool = False) -> dict:
        """update_iters passes over the batch's mini-batches (column `mini_batch`), one optimizer step each.
        `micro_loss(part, logp, entropy, num_tokens, num_seqs)`: a micro-batch's LossOutput, given the mini-batch's
        totals over every rank from `normalizers(response_mask) -> (tokens, sequences)`; `keys`: the per-token
        columns it reads besides the response mask; `temperature`: the log-probs' (logits / temperature);
        `with_greedy`: micro_loss's part also holds "greedy", the argmax of the logits (Layout.forward_backward)."""
        cfg = self.config
        batch.require(["mini_batch", "prompt_tokens", "response_mask", *keys], by="the update")
        minis = [np.flatnonzero(batch["mini_batch"] == m) for m in np.unique(batch["mini_batch"])]
        collected, weights, grad_norms, lrs = {}, [], [], []
        step = self.step + 1
        updates, skipped, overflowed = cfg.update_iters * len(minis), 0, 0
        scale = self.precision.loss_scale   # fp16's dynamic loss scale (trainer/precision.py), else None
        self.actor.train()
        with timer.stage("update"):
            for _ in range(cfg.update_iters):
                for rows in minis:
                    mini = batch.select(rows)
                    # global token / sequence counts (summed over data-parallel ranks)
                    num_tokens, num_seqs = (float(v) for v in self.layout.batch.sum(
                        normalizers(mini["response_mask"])))

                    def loss_fn(part, logp, entropy):
                        out = micro_loss(part, logp, entropy, num_tokens, num_seqs)
                        out = self._with_router_aux_loss(out, part, num_seqs)
                        if scale is not None:   # fp16: the backward runs on the scaled loss
                            out.loss = scale.scale(out.loss)
                        return out

                    finite_loss = True
                    with self.precision.autocast(), timer.part("update_forward_backward"):
                        outs = self.layout.forward_backward(self.actor, mini, keys, cfg.per_device_train_batch_size,
                                                            temperature, loss_fn, with_greedy)
                    for out in outs:
                        for k, v in out.metrics.items():
                            collected.setdefault(k, []).append(v)
                        weights.append(out.num_tokens)
                        finite_loss = finite_loss and math.isfinite(float(out.loss))
                    self.precision.finish_gradients(self.actor.parameters())   # O2: gradients stored in half
                    if scale is not None:
                        scale.unscale_(self.actor.parameters())
                    norm = self.layout.clip_grad_norm_(self.actor, cfg.max_grad_norm)
                    lrs.append(self.optimizer.get_lr())
                    if self.layout.any_rank(not (finite_loss and math.isfinite(norm))):
                        if scale is not None and scale.cures and not self.layout.any_rank(not finite_loss):
                            self._overflow(scale, step, len(lrs), updates)   # fp16: skipped, the scale backs off
                            overflowed += 1
                            continue
                        self._skip_update(step, len(lrs), updates, finite_loss)
                        skipped += 1
                        if scale is not None:
                            scale.update(found_inf=True)
                        continue
                    self.nonfinite.applied()
                    grad_norms.append(norm)
                    with timer.part("update_optimizer_step"):
                        self.optimizer.step()
                    self.optimizer.clear_grad(set_to_zero=not cfg.release_grads)
                    self.scheduler.step()
                    if scale is not None:
                        scale.update(found_inf=False)
        metrics = {f"actor/{k}": v for k, v in self.layout.weighted_means(collected, weights).items()}
        # the norms of the applied updates (NaN when every update of the step was skipped)
        metrics["actor/grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        metrics["actor/lr"] = float(lrs[-1])
        metrics["actor/nonfinite_skipped"] = float(skipped)
        metrics["actor/nonfinite_skipped_total"] = float(self.nonfinite.total)
        if scale is not None:
            metrics["actor/loss_scale"] = scale.value
            metrics["actor/overflow_skipped"] = float(overflowed)
            metrics["actor/overflow_skipped_total"] = float(scale.overflows)
        return metrics

    def _overflow(self, scale, step: int, update: int, updates: int) -> None:
        """fp16: an update whose gradients overflowed float16 at this loss scale (the loss finite on every rank):
        not applied (no optimizer or schedule step, gradients dropped), the scale told (it backs off), the skip
        counted (actor/overflow_skipped) and not held against max_nonfinite_skips while the scale can still back
        off."""
        self.optimizer.clear_grad(set_to_zero=False)
        before = scale.value
        scale.update(found_inf=True)
        scale.overflows += 1
        logger.info("step %d (update %d of %d) skipped: the gradients overflow float16 at loss scale %g; the scale "
                    "is now %g", step, update, updates, before, scale.value)

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

    # ---------------------------------------------------------------- checkpoints
    def resume(self, path: Optional[str], more: Callable[[str, dict], None] = lambda path, state: None) -> None:
        """Continue from checkpoint `path` (None: start fresh). `more(path, state)` restores the trainer's own parts,
        before the RNG state (restored last) and the step."""
        if path is None:
            return
        state = load_trainer_state(path)
        warn_pickled(path, **self.layout.resume_args())
        self.layout.load_weights(self.actor, master_state(path))
        load_optimizer(path, self.optimizer, self.scheduler, state, **self.layout.resume_args())
        self.sampler.set_state_dict(state["sampler"])
        self.nonfinite.set_state_dict(state.get("nonfinite", {}))
        if self.precision.loss_scale is not None:
            self.precision.loss_scale.set_state_dict(state.get("loss_scale", {}))
        more(path, state)
        set_rng_state(state["rng"], path, **self.layout.resume_args())
        self.step = int(state["step"])
        self.log.truncate_after(self.step)
        logger.info("resumed from %s at step %d", path, self.step)

    def save(self, state: dict, extra_files=None, extra_parts=None) -> Optional[str]:
        """checkpoint-<step> with the trainer's `state` (its own parts) beside the loop's; None when it could not
        be written and save_error is continue."""
        cfg = self.config
        watchdog.note(f"step {self.step}, checkpoint save")
        state = {"sampler": self.sampler.state_dict(), "total_steps": self.total_steps,
                 "nonfinite": self.nonfinite.state_dict(), **state}
        if self.precision.loss_scale is not None:
            state["loss_scale"] = self.precision.loss_scale.state_dict()
        try:
            return save_checkpoint(cfg.output_dir, self.step, self.actor, self.tokenizer_dir, self.optimizer,
                                   self.scheduler, state, save_optimizer=not cfg.ignore_save_lr_and_optim,
                                   total_limit=cfg.save_total_limit, extra_files=extra_files,
                                   extra_parts=extra_parts, save_dtype=cfg.save_dtype,
                                   **self.layout.checkpoint_args(self.actor))
        except CheckpointError as e:
            if cfg.save_error != "continue":
                raise
            logger.error("%s; training goes on (save_error: continue)", e)
            return None

    def generation_parts(self):
        """(make_episodes, engine, reward_fn) of the run: the multi-turn episode maker (None without env_plugin),
        the rollout engine on the actor and the reward: what RL's rollout and any held-out evaluation use."""
        cfg = self.config
        return (episode_maker(cfg, self.tokenizer, self.stop_ids),
                RolloutEngine(self.actor, settings=EngineSettings.from_config(cfg, self.pad_id, self.stop_ids)),
                build_reward(cfg, broadcast_group=self.layout.reward_group))

    # ---------------------------------------------------------------- held-out prompts
    def evaluate(self, engine, reward_fn, make_episodes) -> dict:
        """Greedy accuracy and mean reward on the held-out prompts ({} without them), generated by `engine` on
        the layout's rollout model; every response to eval_completions/step-<step>.jsonl, one on the terminal."""
        if self.eval_data is None:
            return {}
        timer = StageTimer(on_stage=lambda name: watchdog.note(f"after step {self.step}, {name}"))
        records = []
        with timer.stage("eval"):
            with self.layout.rollout_engine(engine) as rollout_engine:
                metrics = evaluate(rollout_engine, self.tokenizer, self.eval_data, reward_fn, self.config,
                                   self.stop_ids, make_episodes, records)
        path = self.log.log_eval_completions(self.step, records)
        if self.log.enabled and records:
            logger.info("step %d eval: %d responses in %s; the first: %s", self.step, len(records), path,
                        one_line(records[0]))
        metrics.update(timer.metrics())
        return metrics

    # ---------------------------------------------------------------- the loop
    def run(self, job) -> dict:
        """Run `job`'s steps to the end; the run's summary (monitor/summary.py) is logged last, finished or failed.
        Returns the last step's metrics. The steps allocate from glibc's heap and keep what they free
        (env.training_heap, PADDLE_RL_MALLOC)."""
        try:
            with training_heap():
                last = self._run(job)
        except BaseException as e:
            watchdog.leaving()  # peers raising the same error may exit first: not a dead rank
            self._log_summary(time.time() - self.started, e)
            raise
        finally:
            job.close()
        self._log_summary(time.time() - self.started)
        return last

    def _run(self, job) -> dict:
        cfg = self.config
        evaluates = self.eval_data is not None and cfg.evaluation_strategy != "no"
        if self.step == 0 and evaluates:
            initial = job.evaluate()
            self.log.log(0, initial)
            logger.info("step 0 eval: %s", summary_line(initial))
        last = {}
        # log records go through the bar while it is shown (monitor/progress.py), so they do not garble its line
        with progress_bar(self.total_steps, initial=self.step,
                          disabled=cfg.disable_tqdm or not self.layout.is_logging_rank) as progress:
            while cfg.do_train and self.step < self.total_steps:
                metrics = job.train_step()
                job.stepped()
                if evaluates and self._at_interval(job, cfg.evaluation_strategy, cfg.eval_steps):
                    metrics.update(job.evaluate())
                self.log.log(self.step, metrics)
                last = metrics
                progress.update(summary_line(metrics, short=True))
                if self.step % cfg.logging_steps == 0:
                    logger.info("step %d/%d %s", self.step, self.total_steps, summary_line(metrics))
                    if not cfg.skip_profile_timer:
                        logger.info("step %d timers: %s", self.step, timer_line(metrics))
                if self._should_save(job):
                    job.save()
        self.log.close()
        # ranks leave together: one that exits while another is still working can take the rendezvous down
        # under it. A peer that passed this barrier may exit before this rank's barrier returns: expected.
        watchdog.leaving()
        self.layout.barrier()
        return last

    def _should_save(self, job) -> bool:
        return self._at_interval(job, self.config.save_strategy, self.config.save_steps)

    def _at_interval(self, job, strategy: str, steps: int) -> bool:
        """Whether a save / evaluation strategy acts after this step: steps (every `steps` and at the end), epoch
        (when the step's batch ended a pass over the training data, and at the end), no."""
        if strategy == "steps":
            return self.step % steps == 0 or self.step == self.total_steps
        if strategy == "epoch":
            return job.epoch_done() or self.step == self.total_steps
        return False

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


def timer_line(metrics: dict) -> str:
    """A step's seconds per stage (time/* metrics) on one line, the step first (skip_profile_timer: false)."""
    seconds = {k[len("time/"):]: v for k, v in metrics.items() if k.startswith("time/")}
    order = sorted(seconds, key=lambda k: (k != "step", k))
    return ", ".join(f"{k} {seconds[k]:.3f}s" for k in order) or "none recorded"


def _topology(config):
    degrees = (config.tensor_parallel_degree, config.pipeline_parallel_degree, config.sharding_parallel_degree,
               max(config.data_parallel_degree, 1))
    if world_size_from_env() == 1 and all(d == 1 for d in degrees):
        return None
    return topology_from_config(config)


SUMMARY_KEYS = ("reward/mean", "reward/accuracy", "eval/accuracy", "eval/reward_mean", "actor/ref_kl",
                "actor/pg_loss", "response_length/mean", "time/step")


def summary_line(metrics: dict, short: bool = False) -> str:
    keys = list(SUMMARY_KEYS[:3] if short else SUMMARY_KEYS)
    if "eval/accuracy" in keys:  # several eval files: each one's accuracy beside the overall one
        at = keys.index("eval/accuracy") + 1
        keys[at:at] = sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)

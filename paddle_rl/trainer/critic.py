"""The critic of PPO (rl_algorithm ppo / advantage_estimator gae): its model, optimizer and checkpoint part, the
value pass on the rollout and the value update. The trainer asks it for values next to the old / reference
log-probs, passes them to the Objective (GAE), and runs `update` before the actor's update.

The critic runs on the actor's grid (`Layout.load_critic`): data parallelism and sharding stage 1 / 2 through a
GradientSync and sharded optimizer of its own (gradients summed over the batch group, Adam moments split over the
sharding ranks; `Layout.gradient_sync`, `Layout.sharded_optimizer`), sharding stage 3 with its parameters
partitioned like the actor's (layouts/partitioned.py: each decoder layer gathered for its forward and backward, the
optimizer over the slices, the checkpoint gathered), tensor parallelism with the actor's group (its value head
replicated), pipeline parallelism in the actor's stages (its value head on the last; its value pass and update on
the pipeline's schedules, layouts/pipelined.py). With LoRA it trains adapters of the actor's settings and its whole
value head, and is saved as a PEFT adapter (task SEQ_CLS, modules_to_save [score])."""
import copy
import logging
import math
import os
from typing import Optional

import numpy as np
import paddle
from paddle.utils import unique_name

from ..config import ConfigError
from ..config.critic_args import CRITIC_OPTIMIZER_KEYS
from ..models import save_model
from ..models.lora import has_adapter, lora_settings
from ..models.pretrained import saves_frozen
from .checkpoint import load_optimizer, optimizer_stem
from .state_files import write_state

logger = logging.getLogger("paddle_rl")

FOLDER = "critic"   # the critic's part of a checkpoint-N folder: a one-label sequence classifier + optimizer state


def check_critic_config(config, uses_critic: bool) -> None:
    """Check critic_model_name_or_path (before any model loads); warn about critic keys set for an estimator
    without a critic."""
    if not uses_critic:
        given = [k for k in CRITIC_OPTIMIZER_KEYS + ("critic_model_name_or_path",) if getattr(config, k)]
        if config.critic_warmup_steps:
            given.append("critic_warmup_steps")
        if given:
            logger.warning("%s: not applied: advantage estimator %r has no critic (rl_algorithm: ppo has one)",
                           ", ".join(given), config.resolved_estimator)
        return
    if getattr(config, "fp16", False):
        raise ConfigError(f"fp16: not with a critic (advantage estimator {config.resolved_estimator!r}): the critic's "
                          "update has no loss scaling, so its float16 gradients would underflow; use bf16 or float32")
    folder = config.critic_model_name_or_path
    if folder and not os.path.isfile(os.path.join(folder, "config.json")):
        if has_adapter(folder):
            raise ConfigError(f"critic_model_name_or_path: {folder} holds a LoRA adapter (a LoRA run's critic), not "
                              "a model; resume that run (resume_from_checkpoint) to continue its critic")
        raise ConfigError(f"critic_model_name_or_path: {os.path.join(folder, 'config.json')} not found")


class Critic:
    def __init__(self, config, layout, total_updates: int):
        self.config = config
        self.layout = layout
        folder = config.critic_model_name_or_path or config.actor_model_name_or_path
        with unique_name.guard("critic_"):
            try:
                self.model = layout.load_critic(folder, lora=lora_settings(config))
            except (KeyError, ValueError) as e:
                key = "critic_model_name_or_path" if config.critic_model_name_or_path else "actor_model_name_or_path"
                raise ConfigError(f"{key}: {e.args[0]}") from None
        try:
            self.model.set_recompute(config.recompute_what, config.recompute_use_reentrant, config.no_recompute_layers)
        except ValueError as e:
            raise ConfigError(f"no_recompute_layers: {e.args[0]} (the critic's)") from None
        settings = config.critic_optimizer_settings()
        self.max_grad_norm = settings.pop("max_grad_norm")
        optimizer_config = copy.copy(config)
        for key, value in settings.items():
            setattr(optimizer_config, key, value)
        self.sync = layout.gradient_sync(self.model)
        self.optimizer, self.scheduler = layout.sharded_optimizer(self.model, optimizer_config, total_updates,
                                                                  self.sync)
        logger.info("critic from %s (lr %g)", folder, settings["learning_rate"])
        if self.fuses_value_pass:
            default = type(config).__dataclass_fields__["per_device_value_batch_size"].default
            log = logger.warning if config.per_device_value_batch_size != default else logger.info
            log("per_device_value_batch_size %d: not used: one update pass per step (one mini-batch, update_iters 1), "
                "so the critic update's forward gives the rollout values (micro-batches of "
                "per_device_train_batch_size)", config.per_device_value_batch_size)

    # ---------------------------------------------------------------- the value pass
    def values(self, batch) -> np.ndarray:
        """The critic's values of the rollout, numpy [B, T] float32, zero outside response_mask, in the batch's
        order (micro-batches of per_device_value_batch_size rows, or the token budget)."""
        return self.layout.values(self.model, batch, self.config.per_device_value_batch_size)

    # ---------------------------------------------------------------- the update
    @property
    def fuses_value_pass(self) -> bool:
        """One mini-batch per step and update_iters 1: the update's only forward sees the weights the value pass
        would read, so it gives the rollout's values itself (`update_from_rollout`) and no value pass runs. Not with
        lora_dropout > 0 (the update's forward drops adapter inputs; the value pass does not)."""
        cfg = self.config
        dropout = self.model.lora is not None and self.model.lora.dropout > 0
        return cfg.update_iters == 1 and cfg.global_batch_size // cfg.mini_batch_prompts == 1 and not dropout

    def update_from_rollout(self, batch, objective):
        """(values [B, T] as `values` gives them, metrics as `update`) in one forward + backward per micro-batch
        (fuses_value_pass): each micro-batch's values, detached, are its rollout-time values V_old, its returns
        come from them (`Objective.critic_returns`: per row), and its value loss is taken against them (V = V_old:
        the clip is inactive, as in the first pass over a mini-batch). The trainer's GAE then reads these values."""
        assert self.fuses_value_pass
        out = np.zeros(batch["response_mask"].shape, dtype=np.float32)
        metrics = self.update(batch, objective, rollout_values=out)
        return self.layout.from_last_stage(out) * batch["response_mask"], metrics

    def update(self, batch, objective, rollout_values: Optional[np.ndarray] = None) -> dict:
        """The value loss over the batch's mini-batches (update_iters passes), one optimizer step per mini-batch;
        metrics critic/vf_loss, vpred_mean, vf_clipfrac (token means), grad_norm, lr. `rollout_values`: an array
        [B, T] to fill with the values (update_from_rollout); the batch then has no values or returns yet."""
        cfg, layout = self.config, self.layout
        minis = [np.flatnonzero(batch["mini_batch"] == m) for m in np.unique(batch["mini_batch"])]
        collected, weights, norms, skipped = {}, [], [], 0
        self.model.train()
        for _ in range(cfg.update_iters):
            for rows in minis:
                mini = batch.select(rows)
                num_tokens, num_seqs = (float(v) for v in layout.batch.sum(
                    objective.loss_normalizers(mini["response_mask"])))
                loss_fn = self._loss_fn(objective, rows, num_tokens, num_seqs, rollout_values)
                keys = ["values", "returns"] if rollout_values is None else None
                finite = True
                for out in layout.value_forward_backward(self.model, mini, keys, cfg.per_device_train_batch_size,
                                                         loss_fn):
                    finite = finite and math.isfinite(float(out.loss))
                    for k, v in out.metrics.items():
                        collected.setdefault(k, []).append(v)
                    weights.append(out.num_tokens)
                norm = self.sync.clip_(self.max_grad_norm)
                if layout.any_rank(not (finite and math.isfinite(norm))):
                    self.optimizer.clear_grad(set_to_zero=False)
                    skipped += 1
                    continue
                norms.append(norm)
                self.optimizer.step()
                self.optimizer.clear_grad(set_to_zero=False)
                self.scheduler.step()
        metrics = {f"critic/{k}": v for k, v in layout.weighted_means(collected, weights).items()}
        metrics["critic/grad_norm"] = float(np.mean(norms)) if norms else float("nan")
        metrics["critic/lr"] = float(self.optimizer.get_lr())
        metrics["critic/nonfinite_skipped"] = float(skipped)
        return metrics

    @staticmethod
    def _loss_fn(objective, rows, num_tokens: float, num_seqs: float, rollout_values):
        """The value loss of one micro-batch of the mini-batch at `rows` of the step's batch (Layout.
        value_forward_backward's loss_fn): against the batch's values and returns, or (`rollout_values` given) against
        the forward's own detached values, which it writes there, and the returns made from them."""
        def loss_fn(part_rows, part, t, values):
            if rollout_values is None:
                old, returns = t["values"], t["returns"]
            else:
                old = values.detach()
                v = old.numpy()
                rollout_values[rows[part_rows], :v.shape[1]] = v
                cut = {k: None if part.get(k) is None else part[k][:, :v.shape[1]]
                       for k in ("response_mask", "old_logp", "ref_logp")}
                returns = paddle.to_tensor(objective.critic_returns(
                    part["scores"], cut["response_mask"], part["group"], cut["old_logp"], cut["ref_logp"],
                    v * cut["response_mask"]))
            return objective.value_loss(values, old, returns, t["response_mask"], num_tokens, num_seqs)
        return loss_fn

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """What trainer_state.json keeps of the critic (its scheduler; the optimizer moments are files)."""
        return {"scheduler": self.scheduler.state_dict()}

    def checkpoint_writer(self, rank: int = 0, world_size: int = 1, save_optimizer: bool = True):
        """A function writing the critic into `folder`/critic (save_checkpoint's extra_parts; every rank calls
        both): its state is gathered over the tensor-parallel group and the pipeline stages now, before any rank
        writes, then rank 0 writes the weights (a LoRA critic: its adapters and value head) and each rank its
        optimizer state."""
        state = self.layout.full_state(self.model, saves_frozen(self.model))

        def write(folder: str) -> None:
            target = os.path.join(folder, FOLDER)
            os.makedirs(target, exist_ok=True)
            if rank == 0:
                save_model(self.model, target, state=state)
            if save_optimizer:
                write_state(target, optimizer_stem(rank, world_size), self.optimizer.state_dict())
        return write

    def resume(self, path: str, state: dict, rank: int = 0, world_size: int = 1) -> None:
        """Weights, optimizer and scheduler as `checkpoint_writer` and `state_dict` left them in checkpoint `path`."""
        target = os.path.join(path, FOLDER)
        if not os.path.isdir(target) or "critic" not in state:
            raise FileNotFoundError(f"{path}: no critic in this checkpoint ({FOLDER}/ and trainer_state.json "
                                    "'critic'); it was written by a run without rl_algorithm: ppo")
        self.layout.load_weights(self.model, target)
        load_optimizer(target, self.optimizer, self.scheduler,
                       dict(state, scheduler=state["critic"]["scheduler"]), rank=rank, world_size=world_size)


def build_critic(config, layout, uses_critic: bool, total_updates: int) -> Optional[Critic]:
    """The critic when the estimator needs one (check_critic_config has passed), else None."""
    return Critic(config, layout, total_updates) if uses_critic else None

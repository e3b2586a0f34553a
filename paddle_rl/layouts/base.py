"""The interface every parallel layout implements, and the batch group all of them share.

A layout answers: load a model (this rank's part), log-probs over a StepBatch, forward + backward of a
mini-batch, the same two for a critic (its values, its value loss), the full state (gathered under Hugging Face
names), gradient clipping, the optimizer, the arguments of checkpoint save / resume, and the model the rollout
decodes with.

With a single process every method does exactly what the plain trainer did (no collectives, same
arithmetic). Under a parallel topology:
- the batch is split over the batch group (data x sharding) by whole prompts, each rank taking the same
  share of every mini-batch, so mini-batch contents match the single-process run; with balance_batch the
  prompt groups of each mini-batch move between ranks after the rollout, balancing their tokens
  (`BatchGroup.place`);
- loss normalizers, statistics and metrics are summed over the batch group;
- gradients are summed over the batch group (parallel/sharding.py), the norm counts every element once;
- only global rank 0 writes metrics and checkpoints (each rank adds its optimizer shard).
"""
import abc
import contextlib
from typing import Callable, Dict, List

import numpy as np
import paddle

from ..batch import StepBatch
from ..models import load_weights
from ..models.pretrained import saves_frozen
from ..parallel import collectives as C
from ..parallel.sharding import GradientSync, build_sharded_optimizer, optimizer_state_bytes
from ..parallel.topology import TopologyError
from .micro import MicroBatching
from .rollout import Rollout


def balance_groups(tokens, ranks: int) -> np.ndarray:
    """The rank of each group: largest first onto the rank with the fewest tokens so far (ties: the lower rank)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    loads = np.zeros(ranks)
    owner = np.zeros(len(tokens), dtype=np.int64)
    for g in np.argsort(-tokens, kind="stable"):
        owner[g] = int(np.argmin(loads))
        loads[owner[g]] += tokens[g]
    return owner


def row_tokens(batch: StepBatch) -> np.ndarray:
    """Prompt + response tokens of each row (what its log-prob and update passes cost)."""
    return np.array([len(p) for p in batch["prompt_ids"]], dtype=np.int64) + np.asarray(batch["lengths"], np.int64)


class BatchGroup:
    """The ranks holding different parts of the batch (data x sharding): how a step's prompts split over them,
    and sums, means and gathers over them. One process: the whole batch, every operation the identity."""

    def __init__(self, topo):
        self.group = topo.group("batch")
        self.degree = topo.batch_degree
        self.rank = topo.batch_rank

    def check_config(self, config) -> None:
        if self.degree > 1 and config.mini_batch_prompts % self.degree:
            raise TopologyError(f"global_mini_batch_size ({config.mini_batch_prompts} prompts) must be divisible by "
                                f"data_parallel_degree x sharding_parallel_degree ({self.degree}): each rank takes "
                                "whole prompt groups")

    def local_prompt_indices(self, indices, mini_prompts: int) -> list:
        """This rank's share of the step's prompts: the same contiguous slice of every mini-batch."""
        if self.degree == 1:
            return list(indices)
        share = mini_prompts // self.degree
        out = []
        for start in range(0, len(indices), mini_prompts):
            mini = list(indices[start:start + mini_prompts])
            out += mini[self.rank * share:(self.rank + 1) * share]
        return out

    def global_groups(self, local, mini_prompts: int, gen_round: int = 0) -> np.ndarray:
        """The step-wide ids of this rank's prompts (`local`: their index in the rank's draw): the position of
        each in the sampler batch (see local_prompt_indices), round r's offset by r << 32 so that generation
        rounds never share an id. Sorting rows by (group, sample) is the single-process order."""
        local = np.asarray(local, dtype=np.int64)
        if self.degree == 1:
            position = local
        else:
            share = mini_prompts // self.degree
            position = (local // share) * mini_prompts + self.rank * share + local % share
        return (np.int64(gen_round) << 32) + position

    def to_global(self, batch: StepBatch) -> StepBatch:
        """Every rank's share of a sampler batch, gathered back into the single-process order (by the rows'
        `group` and `sample`)."""
        if self.group is None:
            return batch
        whole = StepBatch.concat(C.gather_objects(batch, self.group))
        return whole.select(np.lexsort((whole["sample"], whole["group"])))

    def local_share(self, batch: StepBatch, mini_prompts: int) -> StepBatch:
        """This rank's share of a batch held whole, in single-process order (the inverse of to_global): the same
        slice of every mini-batch of its prompt groups."""
        if self.group is None:
            return batch
        groups, position = batch.group_order()
        mine = np.zeros(len(groups), dtype=bool)
        mine[self.local_prompt_indices(range(len(groups)), mini_prompts)] = True
        return batch.select(np.flatnonzero(mine[position]))

    def local_prompts(self, prompts: int) -> int:
        return prompts // self.degree

    def place(self, batch: StepBatch, mini_prompts: int, balance: bool):
        """(this rank's rows for the log-prob and update passes, metrics). Adds column `mini_batch` (each row's
        mini-batch). Without `balance` the rows stay where the rollout put them (the same contiguous share of
        every mini-batch); with it, each mini-batch's prompt groups are assigned to the ranks by their tokens
        (`balance_groups`; ranks may hold different numbers of groups, the union is the same mini-batch).
        perf/token_imbalance: the largest rank's tokens of a mini-batch over the ranks' mean, averaged over the
        mini-batches (1 for one process)."""
        if balance and self.degree > 1:
            whole = self.to_global(batch)
            groups, position = whole.group_order()
            tokens = row_tokens(whole)
            sizes = np.zeros(len(groups), dtype=tokens.dtype)
            np.add.at(sizes, position, tokens)
            mine, minis = [], []
            for m, start in enumerate(range(0, len(sizes), mini_prompts)):
                owner = balance_groups(sizes[start:start + mini_prompts], self.degree)
                for g in start + np.flatnonzero(owner == self.rank):
                    rows = np.flatnonzero(position == g)
                    mine.append(rows)
                    minis += [m] * len(rows)
            batch = whole.select(np.concatenate(mine) if mine else np.zeros(0, np.int64))
            batch["mini_batch"] = np.array(minis, dtype=np.int64)
        else:
            batch["mini_batch"] = batch.group_order()[1] // self.local_prompts(mini_prompts)
        return batch, {"perf/token_imbalance": self.token_imbalance(batch)}

    def token_imbalance(self, batch: StepBatch) -> float:
        """Max over ranks of a mini-batch's tokens / their mean, averaged over the mini-batches."""
        if self.group is None:
            return 1.0
        mine = np.bincount(batch["mini_batch"], weights=row_tokens(batch)) if batch.size else np.zeros(0)
        parts = C.gather_objects(mine, self.group)
        width = max(len(p) for p in parts)
        loads = np.stack([np.pad(p, (0, width - len(p))) for p in parts])
        mean = loads.mean(0)
        return float(np.mean(loads.max(0)[mean > 0] / mean[mean > 0])) if (mean > 0).any() else 1.0

    def sum(self, values) -> np.ndarray:
        """float64 sum over the batch group."""
        return C.sum_numpy(values, self.group)

    def max(self, values) -> np.ndarray:
        return C.max_numpy(values, self.group)

    def gather(self, batch: StepBatch, keys) -> StepBatch:
        """The named columns of every rank's batch, concatenated in rank order (every rank gets them)."""
        mine = StepBatch({k: batch[k] for k in keys}, batch.pads)
        if self.group is None:
            return mine
        return StepBatch.concat(C.gather_objects(mine, self.group))

    def reduce_metrics(self, metrics: dict) -> dict:
        """Per-rank metrics of equal batch shares -> batch-wide: max for */max, min for */min, else the mean."""
        if self.degree == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = np.array([float(metrics[k]) for k in keys])
        means = self.sum(values) / self.degree
        maxes, mins = self.max(values), -self.max(-values)
        return {k: float(maxes[i] if k.endswith("/max") else mins[i] if k.endswith("/min") else means[i])
                for i, k in enumerate(keys)}

    def value_stats(self, prefix: str, values) -> dict:
        """{prefix}/mean, /std, /max, /min of every rank's values together ({} for one process: the caller's own
        statistics are already exact)."""
        if self.group is None:
            return {}
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        count, total, squares = self.sum([v.size, v.sum(), (v * v).sum()])
        hi = self.max([v.max() if v.size else -np.inf, -(v.min() if v.size else np.inf)])
        if count == 0:
            return {f"{prefix}/{k}": 0.0 for k in ("mean", "std", "max", "min")}
        mean = total / count
        return {f"{prefix}/mean": float(mean), f"{prefix}/std": float(np.sqrt(max(squares / count - mean * mean, 0.0))),
                f"{prefix}/max": float(hi[0]), f"{prefix}/min": float(-hi[1])}


class Layout(abc.ABC):
    """Base of the layouts: what they share. Subclasses implement the abstract methods (load_model, full_state,
    _logprob_chunks, forward_backward); the rest is common."""

    def __init__(self, topo, share_prompts: bool = True, max_tokens: int = 0, remove_padding: bool = False):
        self._topo = topo
        self.micro = MicroBatching(share_prompts, max_tokens, remove_padding)
        self.batch = BatchGroup(topo)
        self.grad_sync = None
        self.rollout = Rollout(topo, self)

    # ---------------------------------------------------------------- facts
    @property
    def is_parallel(self) -> bool:
        return self._topo.is_parallel

    @property
    def is_logging_rank(self) -> bool:
        return self._topo.is_logging_rank

    @property
    def rank(self) -> int:
        return self._topo.rank

    @property
    def stats_reduce(self):
        """The group batch statistics are summed over (None: this process holds the whole batch)."""
        return self.batch.group

    @property
    def reward_group(self):
        """The ranks that hold one copy of the model and the same data: one scores, the others receive."""
        return self._topo.group("model")

    def check_config(self, config) -> None:
        self.batch.check_config(config)

    # ---------------------------------------------------------------- decisions every rank makes alike
    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (a max over all ranks)."""
        if not self.is_parallel:
            return bool(flag)
        return bool(C.max_numpy([1.0 if flag else 0.0], self._topo.group("world"))[0] > 0)

    def first_of_ranks(self, value):
        """The first value that is not None over all ranks in rank order (the same on every rank), or None."""
        if not self.is_parallel:
            return value
        return next((v for v in C.gather_objects(value, self._topo.group("world")) if v is not None), None)

    # ---------------------------------------------------------------- models (per layout)
    @abc.abstractmethod
    def load_model(self, folder: str, lora=None, adapter=None):
        """This rank's part of the model in a Hugging Face folder (`lora`, `adapter`: LoRA adapters on it, as
        models.load_model)."""

    def load_critic(self, folder: str, lora=None):
        """This rank's part of a critic (models/critic.py) started from `folder` (`lora`: adapters on it, its value
        head trained whole). A layout that cannot hold one raises TopologyError naming the key."""
        raise TopologyError(f"{type(self).__name__}: no critic on this layout")

    def load_weights(self, model, folder: str) -> None:
        """Overwrite a model's parameters from a checkpoint folder (each rank its own shard / stage)."""
        load_weights(model, folder)

    @abc.abstractmethod
    def full_state(self, model, frozen: bool = True) -> Dict[str, np.ndarray]:
        """The whole model under Hugging Face names (gathered over tensor / pipeline groups; every rank calls it);
        `frozen=False`: the trained parameters only (a LoRA model's adapters)."""

    @paddle.no_grad()
    def logprobs(self, model, batch: StepBatch, temperature: float, micro_batch_size: int,
                 with_entropy: bool = False, with_greedy: bool = False):
        """No-grad log-probs of the batch's responses, numpy [B, T] (and the entropy), zero outside the mask, in the
        batch's row order. Micro-batches: `micro_batch_size` rows, or the token budget (self.micro).
        `with_greedy`: also the argmax of the model's logits at each response position, int64 [B, T], -1 outside
        the mask (returned last)."""
        was_training = model.training
        model.eval()
        chunks = self._logprob_chunks(model, batch, self.micro.plan(batch, micro_batch_size), temperature,
                                      with_entropy, with_greedy)
        if was_training:
            model.train()
        mask = batch["response_mask"]
        out = [np.zeros(mask.shape, dtype=np.float32) for _ in range(2 if with_entropy else 1)]
        greedy = np.full(mask.shape, -1, dtype=np.int64)
        for rows, logp, entropy, *rest in chunks:
            for full, value in zip(out, (logp, entropy)):
                full[rows, :value.shape[1]] = value
            if with_greedy:
                greedy[rows, :rest[0].shape[1]] = rest[0]
        out = [o * mask for o in out] + ([np.where(mask > 0, greedy, -1)] if with_greedy else [])
        return out[0] if len(out) == 1 else tuple(out)

    @abc.abstractmethod
    def _logprob_chunks(self, model, batch: StepBatch, plan: List[np.ndarray], temperature: float,
                        with_entropy: bool, with_greedy: bool = False) -> list:
        """(rows, logp, entropy or None[, greedy with `with_greedy`]) of each micro-batch of `plan` (row indices):
        numpy arrays [rows, width of the micro-batch]."""

    @abc.abstractmethod
    def forward_backward(self, model, mini: StepBatch, keys: List[str], micro: int, temperature: float,
                         loss_fn: Callable, with_greedy: bool = False) -> list:
        """Forward + backward of every micro-batch of a mini-batch (`micro` rows, or the token budget);
        loss_fn(part, logp, entropy) -> LossOutput with `part` the micro-batch's tensors (StepBatch.tensors of
        StepBatch.micro; with `with_greedy` also part["greedy"], the argmax of the logits [b, W]). Returns this
        rank's LossOutputs (under a pipeline only the last stage has them)."""

    # ---------------------------------------------------------------- a critic's passes
    @paddle.no_grad()
    def values(self, model, batch: StepBatch, micro_batch_size: int) -> np.ndarray:
        """A critic's no-grad values of the batch's responses, numpy [B, T] float32, zero outside response_mask, in
        the batch's row order; micro-batches as `logprobs`."""
        was_training = model.training
        model.eval()
        chunks = self._value_chunks(model, batch, self.micro.plan(batch, micro_batch_size))
        if was_training:
            model.train()
        mask = batch["response_mask"]
        out = np.zeros(mask.shape, dtype=np.float32)
        for rows, value in chunks:
            out[rows, :value.shape[1]] = value
        return out * mask

    @abc.abstractmethod
    def _value_chunks(self, model, batch: StepBatch, plan: List[np.ndarray]) -> list:
        """(rows, values) of each micro-batch of `plan`: numpy [rows, width of the micro-batch]."""

    @abc.abstractmethod
    def value_forward_backward(self, model, mini: StepBatch, keys: List[str], micro: int, loss_fn: Callable) -> list:
        """A critic's forward + backward over the micro-batches of a mini-batch, as `forward_backward`:
        loss_fn(rows, part, tensors, values) -> LossOutput with `rows` the micro-batch's rows in `mini`, `part` the
        micro-batch (StepBatch.micro), `tensors` its tensors with the columns `keys`, `values` [b, W] with their
        graph. Returns this rank's LossOutputs (under a pipeline only the last stage calls loss_fn and has them)."""

    def from_last_stage(self, array: np.ndarray) -> np.ndarray:
        """An array only the last pipeline stage filled (values a critic's update read), as that stage holds it;
        the array itself without a pipeline."""
        return array

    # ---------------------------------------------------------------- optimizer
    def build_optimizer(self, model, config, total_steps: int):
        """AdamW over the trained parameters (a LoRA model's adapters; frozen ones get no state)."""
        self.grad_sync = self.gradient_sync(model)
        return self.sharded_optimizer(model, config, total_steps, self.grad_sync)

    def gradient_sync(self, model) -> GradientSync:
        """A gradient sync of its own for a trained model on this grid (the actor's is `grad_sync`; a critic's): its
        gradients summed over the batch group, its norm, its clipping (parallel/sharding.py)."""
        return GradientSync(self._topo, model.parameters(), model.tensor_partial_parameters())

    def sharded_optimizer(self, model, config, total_steps: int, sync):
        """(optimizer, scheduler) of a trained model whose gradients `sync` (`gradient_sync`'s) sums: AdamW over its
        trained parameters, or over this rank's shard of them under sharding."""
        return build_sharded_optimizer(model, config, total_steps, sync)

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        """Sum gradients over ranks, clip to max_norm; the norm before clipping."""
        return self.grad_sync.clip_(max_norm)

    @staticmethod
    def optimizer_state_bytes(optimizer) -> dict:
        """Bytes of optimizer state this rank holds (Adam moments; accumulators exist after the first step)."""
        return optimizer_state_bytes(optimizer)

    # ---------------------------------------------------------------- metrics of the update
    def weighted_means(self, collected: dict, weights: list) -> dict:
        """Token-weighted means of per-micro-batch metrics over the whole batch (every rank gets them)."""
        sums, total = self._loss_sums(collected, weights)
        keys = sorted(sums)
        summed = self.batch.sum([sums[k] for k in keys] + [total])
        total = summed[-1]
        return {k: float(summed[i] / total) if total else 0.0 for i, k in enumerate(keys)}

    def _loss_sums(self, collected: dict, weights: list):
        sums = {k: sum(v * w for v, w in zip(vals, weights)) for k, vals in collected.items()}
        return sums, float(sum(weights))

    # ---------------------------------------------------------------- rollout
    def generate(self, engine, prompts, n: int, params, keys, episodes=None) -> StepBatch:
        """Responses of this rank's prompts (row i*n+j: sample j of prompt i), keyed by `keys`; `engine` holds
        the sampling settings and the training model; `episodes`: multi-turn (rollout/episodes.py)."""
        return self.rollout.generate(engine, prompts, n, params, keys, episodes)

    @contextlib.contextmanager
    def rollout_engine(self, engine):
        """`engine` bound to the model the rollout decodes with (the training model, or its resharded copy)."""
        yield self.rollout.engine_for(engine)

    # ---------------------------------------------------------------- saving / resuming
    def barrier(self) -> None:
        if self.is_parallel:
            C.barrier()

    def checkpoint_args(self, model) -> dict:
        """Extra arguments of checkpoint.save_checkpoint: the gathered model state and this rank's place."""
        if not self.is_parallel:
            return {}
        return {"model_state": self.full_state(model, saves_frozen(model)), "rank": self._topo.rank,
                "world_size": self._topo.world_size, "barrier": self.barrier, "first_error": self.first_of_ranks}

    def resume_args(self) -> dict:
        """Extra arguments of checkpoint.load_optimizer."""
        return {"rank": self._topo.rank, "world_size": self._topo.world_size} if self.is_parallel else {}

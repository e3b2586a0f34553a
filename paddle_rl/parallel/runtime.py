"""What the trainer asks of the process grid, in one place.

With a single process every method does exactly what the plain trainer did (no collectives, same
arithmetic). Under a parallel topology:
- the batch is split over the batch group (data x sharding) by whole prompts, each rank taking the
  same share of every mini-batch, so mini-batch contents match the single-process run;
- loss normalizers, statistics and metrics are summed over the batch group;
- gradients are summed over the batch group (sharding.py), the norm counts every element once;
- tensor-parallel models use vocabulary-parallel log-probs, pipeline stages the 1F1B schedule;
- the rollout runs on the training layout, or on a copy resharded in memory to
  `rollout_tensor_parallel_degree` (and a pipeline rolls out on a gathered copy);
- only global rank 0 writes metrics and checkpoints (each rank adds its optimizer shard).
"""
import contextlib
from types import SimpleNamespace
from typing import Callable, List, Optional

import numpy as np
import paddle

from . import collectives as C
from .logprobs import batched_logprobs as tp_batched_logprobs
from .logprobs import token_logprobs
from .sharding import GradientSync, build_sharded_optimizer, optimizer_state_bytes
from .topology import Topology, TopologyError, single_process


class ParallelRuntime:
    def __init__(self, topo: Optional[Topology] = None, share_prompts: bool = True):
        self.topo = topo or single_process()
        self.share_prompts = share_prompts  # run each distinct prompt of a micro-batch once (not under a pipeline)
        self.grad_sync: Optional[GradientSync] = None
        self._rollout_model = None

    # ------------------------------------------------------------------ facts
    @property
    def is_parallel(self) -> bool:
        return self.topo.is_parallel

    @property
    def is_logging_rank(self) -> bool:
        return self.topo.is_logging_rank

    @property
    def pipeline(self) -> bool:
        return self.topo.pp_degree > 1

    @property
    def stats_reduce(self):
        """The `reduce` argument of Objective: the batch group (None: this process holds the whole batch)."""
        return self.topo.group("batch")

    # ------------------------------------------------------------------ batch split
    def check_config(self, config) -> None:
        d = self.topo.batch_degree
        if d == 1:
            return
        mini = config.mini_batch_prompts
        if mini % d:
            raise TopologyError(f"global_mini_batch_size ({mini} prompts) must be divisible by data_parallel_degree x "
                                f"sharding_parallel_degree ({d}): each rank takes whole prompt groups")

    def local_prompt_indices(self, indices, mini_prompts: int) -> list:
        """This rank's share of the step's prompts: the same contiguous slice of every mini-batch."""
        d, r = self.topo.batch_degree, self.topo.batch_rank
        if d == 1:
            return list(indices)
        share = mini_prompts // d
        out = []
        for start in range(0, len(indices), mini_prompts):
            mini = list(indices[start:start + mini_prompts])
            out += mini[r * share:(r + 1) * share]
        return out

    def local_mini_prompts(self, mini_prompts: int) -> int:
        return mini_prompts // self.topo.batch_degree

    def sum(self, values) -> np.ndarray:
        """float64 sum over the batch group."""
        return C.sum_numpy(values, self.topo.group("batch"))

    # ------------------------------------------------------------------ models
    def load_model(self, folder: str):
        if self.pipeline:
            from .pipeline import load_stage
            return load_stage(folder, self.topo)
        from ..models import load_model
        return load_model(folder, tp_group=self.topo.group("tp"))

    def load_weights(self, model, folder: str) -> None:
        """Overwrite a model's parameters from a checkpoint folder (each rank its own shard / stage)."""
        from ..models.pretrained import load_local_state, read_local_state
        local = read_local_state(folder, model.config, self.topo.group("tp"))
        names = {n for n, _ in model.named_parameters()}
        load_local_state(model, {k: v for k, v in local.items() if k in names}, source=folder)

    def full_state(self, model) -> dict:
        """The whole model's local-layout numpy state (gathered over tensor and pipeline groups; every rank)."""
        if self.pipeline:
            from .pipeline import gather_stage_states
            return gather_stage_states(model, self.topo)
        from ..models.pretrained import model_state_numpy
        return model_state_numpy(model)

    # ------------------------------------------------------------------ log-probs and the update
    def batched_logprobs(self, model, batch, temperature: float, micro_batch_size: int, with_entropy: bool = False):
        if not self.pipeline:
            return tp_batched_logprobs(model, batch, temperature, micro_batch_size, with_entropy, self.share_prompts)
        from .pipeline import forward_logprobs
        was_training = model.training
        model.eval()
        parts = [batch.tensors(slice(s, s + micro_batch_size)) for s in range(0, batch.size, micro_batch_size)]
        outs = forward_logprobs(model, self.topo, parts, batch.prompt_width, temperature, with_entropy)
        if was_training:
            model.train()
        mask = batch.response_mask
        logp = np.concatenate([o[0] for o in outs]) * mask
        return (logp, np.concatenate([o[1] for o in outs]) * mask) if with_entropy else logp

    def forward_backward(self, model, mini, keys, micro: int, temperature: float, loss_fn: Callable) -> list:
        """Forward + backward of every micro-batch of a mini-batch; returns the LossOutputs of this rank
        (under a pipeline only the last stage has them)."""
        chunks = [slice(s, s + micro) for s in range(0, mini.size, micro)]
        if self.pipeline:
            from .pipeline import train_1f1b
            return train_1f1b(model, self.topo, [mini.tensors(c, keys) for c in chunks], mini.prompt_width,
                              temperature, loss_fn)
        outs = []
        for rows in chunks:
            part = mini.tensors(rows, keys)
            shared = mini.shared_prompts(rows) if self.share_prompts else None
            logp, entropy = token_logprobs(model, part["input_ids"], part["attention_mask"], mini.prompt_width,
                                           part["response_ids"], temperature, with_entropy=True,
                                           shared_prompts=shared)
            out = loss_fn(part, logp, entropy)
            out.loss.backward()
            outs.append(out)
        return outs

    def build_optimizer(self, model, config, total_steps: int):
        self.grad_sync = GradientSync(self.topo, model.parameters())
        return build_sharded_optimizer(model, config, total_steps, self.grad_sync)

    @staticmethod
    def optimizer_state_bytes(optimizer) -> dict:
        """Bytes of optimizer state this rank holds (Adam moments; accumulators exist after the first step)."""
        return optimizer_state_bytes(optimizer)

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        """Sum gradients over ranks (tied pipeline embeddings included), clip to max_norm; the norm before clipping."""
        if not self.is_parallel:
            from ..trainer.optim import clip_grad_norm_
            return clip_grad_norm_(model.parameters(), max_norm)
        if self.pipeline:
            from .pipeline import sync_tied_embedding
            sync_tied_embedding(model, self.topo)
        return self.grad_sync.clip_(max_norm)

    # ------------------------------------------------------------------ metrics
    def weighted_means(self, collected: dict, weights: list) -> dict:
        """Token-weighted means of per-micro-batch metrics over the whole batch (every rank gets them)."""
        sums = {k: sum(v * w for v, w in zip(vals, weights)) for k, vals in collected.items()}
        total = float(sum(weights))
        if self.pipeline:  # only the last stage computed losses
            sums, total = C.broadcast_object((sums, total), self.topo.ranks_of["pp"][-1], self.topo.group("pp"))
        keys = sorted(sums)
        summed = self.sum([sums[k] for k in keys] + [total])
        total = summed[-1]
        return {k: float(summed[i] / total) if total else 0.0 for i, k in enumerate(keys)}

    def mean_over_batch(self, metrics: dict) -> dict:
        """Plain means over the batch ranks (each holds an equal share of the batch)."""
        d = self.topo.batch_degree
        if d == 1:
            return metrics
        keys = sorted(metrics)
        summed = self.sum([float(metrics[k]) for k in keys])
        return {k: float(summed[i] / d) for i, k in enumerate(keys)}

    def reduce_value_metrics(self, metrics: dict, prefix: str, values) -> dict:
        """reduce_metrics, with {prefix}/mean, /std, /max, /min recomputed exactly from every rank's values."""
        out = self.reduce_metrics(metrics)
        group = self.topo.group("batch")
        if group is None:
            return out
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        count, total, squares = C.sum_numpy([v.size, v.sum(), (v * v).sum()], group)
        hi = C.max_numpy([v.max() if v.size else -np.inf, -(v.min() if v.size else np.inf)], group)
        if count > 0:
            mean = total / count
            exact = {"mean": mean, "std": float(np.sqrt(max(squares / count - mean * mean, 0.0))),
                     "max": hi[0], "min": -hi[1]}
            out.update({f"{prefix}/{k}": float(x) for k, x in exact.items() if f"{prefix}/{k}" in out})
        return out

    # ------------------------------------------------------------------ rollout
    def _rollout_is_direct(self) -> bool:
        return not self.pipeline and self.topo.rollout_tp == self.topo.tp_degree

    @contextlib.contextmanager
    def rollout_model(self, engine, model):
        """Point `engine` at the model to decode with: the training model itself, or a copy resharded in
        memory to the rollout tensor-parallel degree (gathered whole for a pipeline)."""
        if self._rollout_is_direct():
            previous, engine.model = engine.model, model
            try:
                yield model
            finally:
                engine.model = previous
            return
        from ..models import CausalLM
        from ..models.pretrained import load_local_state
        from .tensor_parallel import shard_state
        topo = self.topo
        state = self.full_state(model)
        group = topo.group("rollout")
        if self._rollout_model is None:
            with paddle.utils.unique_name.guard("rollout_"):
                self._rollout_model = CausalLM(model.config, group)
            self._rollout_model.eval()
            for p in self._rollout_model.parameters():
                p.stop_gradient = True
        rank, size = C.group_rank(group), C.group_size(group)
        load_local_state(self._rollout_model, shard_state(model.config, state, rank, size), source="training weights")
        del state
        previous, engine.model = engine.model, self._rollout_model
        try:
            yield self._rollout_model
        finally:
            engine.model = previous

    def generate(self, engine, model, prompts: List[List[int]], n: int, params, keys):
        """Responses of this rank's prompts (row i*n+j: sample j of prompt i), keyed by `keys`."""
        with self.rollout_model(engine, model):
            topo = self.topo
            if topo.rollout_tp <= topo.tp_degree or topo.group("rollout") is None:
                return engine.generate(prompts, n, params, keys)
            # a rollout group spanning several batch ranks decodes all of their prompts together
            shares = C.gather_objects((topo.batch_rank, prompts, keys), topo.group("rollout"))
            seen, all_prompts, all_keys, start = [], [], [], None
            for batch_rank, p, k in shares:
                if batch_rank in seen:
                    continue
                seen.append(batch_rank)
                if batch_rank == topo.batch_rank:
                    start = len(all_prompts)
                all_prompts += list(p)
                all_keys = None if k is None else all_keys + list(k)
            out = engine.generate(all_prompts, n, params, all_keys)
            return select_rows(out, np.arange(start * n, (start + len(prompts)) * n), engine.pad_id)

    # ------------------------------------------------------------------ saving / resuming
    def barrier(self) -> None:
        if self.is_parallel:
            C.barrier()

    def checkpoint_args(self, model) -> dict:
        """Extra arguments of checkpoint.save_checkpoint: the gathered model state and this rank's place."""
        if not self.is_parallel:
            return {}
        return {"model_state": self.full_state(model), "rank": self.topo.rank, "world_size": self.topo.world_size,
                "barrier": self.barrier}

    def resume_args(self) -> dict:
        """Extra arguments of checkpoint.load_optimizer."""
        return {"rank": self.topo.rank, "world_size": self.topo.world_size} if self.is_parallel else {}

    # ------------------------------------------------------------------ batch-wide metrics
    def batch_view(self, result, out):
        """(reward result, object with lengths / truncated) over the whole batch, for the step metrics."""
        group = self.topo.group("batch")
        if group is None:
            return result, out
        from ..rewards import concat_results
        parts = C.gather_objects((result, np.asarray(out.lengths), np.asarray(out.truncated)), group)
        return (concat_results([p[0] for p in parts]),
                SimpleNamespace(lengths=np.concatenate([p[1] for p in parts]),
                                truncated=np.concatenate([p[2] for p in parts])))

    def reduce_metrics(self, metrics: dict) -> dict:
        """Per-rank metrics of equal batch shares -> batch-wide: max for */max, min for */min, else the mean."""
        d = self.topo.batch_degree
        if d == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = np.array([float(metrics[k]) for k in keys])
        group = self.topo.group("batch")
        means = C.sum_numpy(values, group) / d
        maxes = C.max_numpy(values, group)
        mins = -C.max_numpy(-values, group)
        return {k: float(maxes[i] if k.endswith("/max") else mins[i] if k.endswith("/min") else means[i])
                for i, k in enumerate(keys)}


def select_rows(out, rows, pad_id: int):
    """Rows of a RolloutOutput, response arrays trimmed to the longest selected response."""
    from ..rollout.engine import RolloutOutput
    rows = np.asarray(rows)
    lengths = out.lengths[rows]
    width = max(int(lengths.max()) if lengths.size else 1, 1)
    return RolloutOutput([out.prompt_ids[i] for i in rows], out.response_ids[rows, :width].copy(),
                         out.response_mask[rows, :width].copy(), out.logprobs[rows, :width].copy(), lengths.copy(),
                         out.truncated[rows].copy())

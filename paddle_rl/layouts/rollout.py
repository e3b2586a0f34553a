"""The model the rollout decodes with: the training model itself, or a copy resharded in memory to
`rollout_tensor_parallel_degree` (gathered whole for a pipeline). A rollout group wider than the training
tensor group decodes the prompts of all its batch ranks together. A context-parallel group (whose ranks hold the
same prompts and the whole model) decodes once, on its first rank, and hands the responses to the others: the
rollout is not split, and its ranks cannot drift apart (sampling, agent programs and tools run once)."""
import numpy as np
import paddle

from ..batch import StepBatch
from ..models import load_weights, unfilled
from ..models.lora import merge_state
from ..parallel import collectives as C


class Rollout:
    def __init__(self, topo, layout):
        self._topo = topo
        self._layout = layout
        self.direct = topo.pp_degree == 1 and topo.rollout_tp == topo.tp_degree
        self._copy = None

    def engine_for(self, engine):
        """`engine` bound to the rollout model: the engine's own (training) model, or the resharded copy loaded
        with its current weights (a collective: every rank calls it)."""
        if self.direct:
            return engine
        model = engine.model
        state = merge_state(self._layout.full_state(model), model.lora)  # LoRA: the merged weights
        if self._copy is None:
            with paddle.utils.unique_name.guard("rollout_"):
                self._copy = unfilled(model.config, self._topo.group("rollout"))
            self._copy.eval()
            for p in self._copy.parameters():
                p.stop_gradient = True
        load_weights(self._copy, state)
        return engine.bind(self._copy)

    def generate(self, engine, prompts, n: int, params, keys, episodes=None) -> StepBatch:
        context = self._topo.group("cp")
        if context is not None:
            first = self._topo.ranks_of["cp"][0]
            out = self._generate(engine, prompts, n, params, keys, episodes) if self._topo.rank == first else None
            return C.broadcast_object(out, first, context)
        return self._generate(engine, prompts, n, params, keys, episodes)

    def _generate(self, engine, prompts, n: int, params, keys, episodes=None) -> StepBatch:
        engine = self.engine_for(engine)
        topo = self._topo
        if topo.rollout_tp <= topo.tp_degree or topo.group("rollout") is None:
            return engine.generate(prompts, n, params, keys, episodes)
        if episodes is not None:
            raise ValueError("env_plugin: not with a rollout_tensor_parallel_degree wider than the training one")
        # a rollout group spanning several batch ranks decodes all of their prompts together
        shares = C.gather_objects((topo.batch_rank, prompts, keys), topo.group("rollout"))
        seen, all_prompts, all_keys, all_groups, start = [], [], [], [], None
        for batch_rank, p, k in shares:
            if batch_rank in seen:
                continue
            seen.append(batch_rank)
            if batch_rank == topo.batch_rank:
                start = len(all_prompts)
            all_prompts += list(p)
            all_groups += range(len(p))   # each share's own prompt index
            all_keys = None if k is None else all_keys + list(k)
        out = engine.generate(all_prompts, n, params, all_keys, groups=all_groups)
        return out.select(np.arange(start * n, (start + len(prompts)) * n)).trim()

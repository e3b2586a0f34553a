"""Sharding stage 3 (`sharding: stage3`, sharding_parallel_degree > 1): the replicated layout with every parameter
partitioned over the sharding group (parallel/partitioned.py). Each rank keeps 1/d of every tensor between passes;
a micro-batch pass gathers each decoder layer for its forward and again for its backward, the embedding, final norm
and head for the whole pass; gradients land on the shards, and the optimizer updates the shards only.

Every rank of the sharding group runs the same number of passes (a gather is a collective): a rank with fewer
micro-batches than its peers runs idle one-token passes (their loss multiplied by 0). The rollout, a checkpoint and a
resume gather the whole model once and free it after; the reference model (a second partitioned model) and the
old log-probs gather per layer like the update's forward. A critic (rl_algorithm ppo) is partitioned the same way:
its value pass and its update gather per layer (its value head with the embedding and final norm, for the whole
pass) under the same idle-pass rule, its optimizer updates its slices, its checkpoint and resume gather it once.
"""
import contextlib

import paddle

from ..models import attention_bias_from_mask, load_weights, position_ids_from_mask
from ..optim import build_optimizer
from ..parallel import collectives as C
from ..parallel.partitioned import PartitionedOptimizer, PartitionedParams, PartitionedSync
from ..parallel.topology import TopologyError
from .replicated import Replicated


def idle_pass(model, backward: bool) -> None:
    """One token through every layer of `model` (and back with a zero loss): the gathers and reduce-scatters a
    real micro-batch makes, for a rank with fewer micro-batches than its sharding peers."""
    ids = paddle.zeros([1, 1], dtype="int64")
    mask = paddle.ones([1, 1], dtype="int64")
    hidden = model.hidden_states(ids, position_ids_from_mask(mask), attention_bias_from_mask(mask, 1, causal=True))
    if backward and not hidden.stop_gradient:
        (hidden.sum() * 0.0).backward()


class Partitioned(Replicated):
    def __init__(self, topo, share_prompts: bool = True, max_tokens: int = 0, remove_padding: bool = False):
        super().__init__(topo, share_prompts, max_tokens, remove_padding)
        self.params = PartitionedParams(topo)
        self.idle_passes = 0   # passes run only to keep this rank's collectives in step with its peers
        self._idle_of = {}     # the same per model (id: the actor, the reference, a critic)

    def check_config(self, config) -> None:
        super().check_config(config)
        refused = []
        if config.share_prompt_prefix and not config.use_remove_padding:
            refused.append("share_prompt_prefix: true runs the layers a second time for the responses of a padded "
                           "micro-batch, but not when its responses are one token wide, so the ranks would gather "
                           "different layers; set share_prompt_prefix: false, or use_remove_padding: true (packing "
                           "shares each prompt in one pass)")
        if config.bf16:
            refused.append("bf16: true keeps bfloat16 copies of the weights beside the parameters (the reference's "
                           "stored weights, AMP's master weights), which stage 3 does not partition; use float32")
        if config.fp16:
            refused.append("fp16: true unscales (and under O2 rounds) the whole gradients after the backward, which "
                           "stage 3 has already reduce-scattered to the slices; use float32")
        if config.recompute and config.recompute_granularity in ("full", "full_attn"):
            refused.append(f"recompute_granularity: {config.recompute_granularity} reruns a layer inside its own "
                           "backward, which stage 3's per-layer gather does not follow; use core_attn or "
                           "core_attn_mlp")
        if refused:
            raise TopologyError("sharding: stage3: " + "; ".join(refused))

    # ---------------------------------------------------------------- models
    def load_model(self, folder: str, lora=None, adapter=None):
        model = super().load_model(folder, lora=lora, adapter=adapter)
        self.params.partition(model)
        return model

    def load_critic(self, folder: str, lora=None):
        """The critic partitioned like the actor: its decoder layers one unit each, its embedding, final norm and
        value head the outer unit."""
        critic = super().load_critic(folder, lora=lora)
        self.params.partition(critic)
        return critic

    def load_weights(self, model, folder: str) -> None:
        with self.params.gathered(model):
            load_weights(model, folder)
            self.params.repartition(model)

    def full_state(self, model, frozen: bool = True) -> dict:
        with self.params.gathered(model):
            return super().full_state(model, frozen)

    def held_bytes(self, model) -> dict:
        """Bytes of `model`'s parameters this rank holds (PartitionedParams.held_bytes), and the idle passes it ran."""
        return dict(self.params.held_bytes(model), idle_passes=self._idle_of.get(id(model), 0))

    # ---------------------------------------------------------------- passes
    def _passes(self, model, plan) -> int:
        """Idle passes this rank adds so that every rank of the sharding group runs as many passes of `model` as the
        busiest (a collective: called before any of the passes)."""
        idle = int(C.max_numpy([len(plan)], self._topo.group("sharding"))[0]) - len(plan)
        self.idle_passes += idle
        self._idle_of[id(model)] = self._idle_of.get(id(model), 0) + idle
        return idle

    def _each_pass(self, model, plan, one, backward: bool) -> list:
        """`one(rows)` for each micro-batch of `plan` with `model`'s layers gathered as its passes run, then the idle
        passes (forward, and backward when `backward`) that keep this rank's gathers in step with its sharding
        peers'; the list of what `one` returned."""
        idle = self._passes(model, plan)
        outs = []
        for rows in plan:
            with self.params.running(model):
                outs.append(one(rows))
        for _ in range(idle):
            with self.params.running(model):
                idle_pass(model, backward=backward)
        return outs

    # ---------------------------------------------------------------- optimizer
    def gradient_sync(self, model) -> PartitionedSync:
        """The sync of a partitioned model (the actor's `grad_sync`, a critic's): its slices' gradients, already
        reduce-scattered by the passes, summed over the data axis; the norm over the slices."""
        return PartitionedSync(self._topo, self.params, model, model.tensor_partial_parameters())

    def sharded_optimizer(self, model, config, total_steps: int, sync):
        """AdamW over this rank's slices of the trained parameters (PartitionedOptimizer)."""
        inner, scheduler = build_optimizer(model, config, total_steps, parameters=sync.params)
        return PartitionedOptimizer(inner, sync), scheduler

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        return self.grad_sync.clip_(max_norm)

    # ---------------------------------------------------------------- rollout
    def generate(self, engine, prompts, n: int, params, keys, episodes=None):
        with self.params.gathered(engine.model):
            return super().generate(engine, prompts, n, params, keys, episodes)

    @contextlib.contextmanager
    def rollout_engine(self, engine):
        """The whole actor gathered while the rollout (or an evaluation) decodes with it, freed after."""
        with self.params.gathered(engine.model), super().rollout_engine(engine) as bound:
            yield bound


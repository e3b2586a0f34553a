"""Sparse Mixture-of-Experts blocks (Qwen2-MoE, Qwen3-MoE), parameters with their `ParamSpec` as in layers.py.

A block routes each token to its top-k experts: router logits = x @ gate (replicated), probabilities = softmax in
float32, the top-k of them (renormalized to sum 1 with `norm_topk_prob`) weight the experts' SwiGLU outputs.
Qwen2-MoE adds a shared expert every token takes, scaled by sigmoid(x @ shared_expert_gate). The experts run in a
loop over the experts that received tokens (gather, matmuls, one index_add back).

Tensor parallelism: each expert (and the shared expert) splits its intermediate dimension like the dense MLP
(gate|up column-wise, down row-wise), so a rank's experts give partial outputs that are summed once per block.
The routing weights and the shared-expert gate multiply partial outputs: they enter through copy_to_group, so
their gradients are summed over the ranks' partial products, and the replicated router sees the full gradient.

Checkpoints: the experts are read and written under the per-expert names transformers 5 writes (and the Hub
uses), `mlp.experts.{e}.{gate,up,down}_proj.weight`; transformers' fused 3-D layout (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) also loads (`ExpertSpec`).

The load-balancing loss (Switch Transformer; transformers' `load_balancing_loss_func`) needs every MoE layer of a
forward: each block adds its router statistics to the pass's `RouterStats` and `CausalLM.aux_loss()` reads them.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .. import ops
from ..parallel.collectives import copy_to_group, group_size, reduce_from_group
from .layers import Bf16Products, ParamSpec, _param


@dataclass(frozen=True)
class MoESettings:
    """The Mixture-of-Experts keys of a config.json (family defaults where absent: Family.setting)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int     # 0: no shared expert
    norm_topk_prob: bool
    sparse_step: int
    dense_layers: Tuple[int, ...]     # mlp_only_layers: a dense MLP there
    aux_loss_coef: float
    aux_loss_in_training: bool        # output_router_logits: transformers adds coef * aux_loss to its loss

    @classmethod
    def of(cls, config) -> Optional["MoESettings"]:
        """The settings of a config whose family has MoE blocks, else None."""
        family = config.family
        if family.mlp != "moe":
            return None
        get = lambda key: family.setting(config, key)  # noqa: E731
        settings = cls(num_experts=int(get("num_experts")), top_k=int(get("num_experts_per_tok")),
                       intermediate_size=int(get("moe_intermediate_size")),
                       shared_intermediate_size=int(get("shared_expert_intermediate_size"))
                       if family.shared_expert else 0,
                       norm_topk_prob=bool(get("norm_topk_prob")), sparse_step=int(get("decoder_sparse_step")),
                       dense_layers=tuple(int(i) for i in (get("mlp_only_layers") or ())),
                       aux_loss_coef=float(get("router_aux_loss_coef")),
                       aux_loss_in_training=bool(get("output_router_logits")))
        if settings.num_experts > 0 and not 0 < settings.top_k <= settings.num_experts:
            raise ValueError(f"num_experts_per_tok {settings.top_k} must be in [1, num_experts "
                             f"{settings.num_experts}]")
        if settings.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {settings.sparse_step}")
        return settings

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` has an MoE block (transformers' rule), else the dense MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ExpertSpec(ParamSpec):
    """One expert's weight: its per-expert HF tensors, or (when those are absent) expert `expert` of the fused
    3-D tensor `fused` ([E, 2I, H] gate|up rows, or [E, H, I] down), which transformers also loads."""
    fused: str = ""
    expert: int = 0

    def from_hf(self, tensors):
        if self.fused in tensors and not all(n in tensors for n in self.hf_names):
            full = np.asarray(tensors[self.fused][self.expert])
            return full.T if self.transpose else full
        return super().from_hf(tensors)


class Expert(Bf16Products):
    """A SwiGLU MLP's weights (gate|up fused, intermediate split over the group); `forward` gives this rank's
    partial output, which the block sums over the group once. `bf16`: both products take bfloat16 operands."""

    def __init__(self, hidden: int, intermediate: int, group, prefix: str, fused: str = "", expert: int = 0):
        super().__init__()
        tp = group_size(group)
        names = tuple(f"{prefix}.{s}.weight" for s in ("gate_proj", "up_proj"))
        spec = ExpertSpec(names, True, 1, (intermediate, intermediate), fused=f"{fused}.gate_up_proj" if fused else "",
                          expert=expert)
        self.gate_up_proj = _param(self, [hidden, spec.local_size(tp)], spec, group)
        spec = ExpertSpec((f"{prefix}.down_proj.weight",), True, 0, (intermediate,),
                          fused=f"{fused}.down_proj" if fused else "", expert=expert)
        self.down_proj = _param(self, [spec.local_size(tp), hidden], spec, group)

    def forward(self, x):
        return self.product(ops.swiglu(self.product(x, self.gate_up_proj)), self.down_proj)


class RouterStats:
    """What the load-balancing loss needs, summed over the MoE blocks of a forward (one or several passes):
    per expert the (weighted) number of top-k choices and the sum of router probabilities (differentiable), and
    the (weighted) token count. Token weights: 0 on padding; a shared prompt run once counts once per row."""

    def __init__(self):
        self.counts = self.probs = self.rows = None

    def add(self, probs, top_i, weight=None):
        """probs [N, E] float32, top_i [N, k], weight [N] float32 or None (all 1)."""
        with paddle.no_grad():
            chosen = F.one_hot(top_i, probs.shape[-1]).sum(axis=1)  # [N, E]
        if weight is None:
            counts, summed = chosen.sum(axis=0), probs.sum(axis=0)
            rows = paddle.full([], probs.shape[0], "float32")
        else:
            w = weight.reshape([-1, 1])
            counts, summed, rows = (chosen * w).sum(axis=0), (probs * w).sum(axis=0), weight.sum()
        if self.counts is None:
            self.counts, self.probs, self.rows = counts, summed, rows
        else:
            self.counts, self.probs, self.rows = self.counts + counts, self.probs + summed, self.rows + rows

    def loss(self):
        """E * sum_e (fraction of top-k choices for e) * (mean router probability of e); 0-d float32."""
        rows = paddle.clip(self.rows, min=1e-9).detach()
        return self.probs.shape[0] * ((self.counts.detach() / rows) * (self.probs / rows)).sum()


class SparseMoE(Bf16Products):
    """The MoE block of one layer (`prefix` = model.layers.{i}.mlp); `bf16`: the router's and the shared-expert
    gate's products take bfloat16 operands (the experts carry their own flag; the softmax stays float32)."""

    def __init__(self, config, settings: MoESettings, tp_group, prefix: str):
        super().__init__()
        self.group = tp_group
        self.top_k, self.norm_topk_prob = settings.top_k, settings.norm_topk_prob
        hidden, experts = config.hidden_size, settings.num_experts
        self.gate = _param(self, [hidden, experts], ParamSpec((f"{prefix}.gate.weight",), True), None)
        self.experts = nn.LayerList([Expert(hidden, settings.intermediate_size, tp_group, f"{prefix}.experts.{e}",
                                            fused=f"{prefix}.experts", expert=e) for e in range(experts)])
        self.shared_expert = None
        if settings.shared_intermediate_size:
            self.shared_expert = Expert(hidden, settings.shared_intermediate_size, tp_group, f"{prefix}.shared_expert")
            self.shared_expert_gate = _param(self, [hidden, 1], ParamSpec((f"{prefix}.shared_expert_gate.weight",),
                                                                          True), None)

    def forward(self, x, p=None):
        """x [B, T, hidden]; `p` (the Pass) collects router statistics in p.router, weighted by p.token_weight."""
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        probs = F.softmax(self.product(flat, self.gate).astype("float32"), axis=-1)
        top_w, top_i = paddle.topk(probs, self.top_k, axis=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(axis=-1, keepdim=True)
        if p is not None and p.router is not None:
            p.router.add(probs, top_i, p.token_weight)
        inputs = copy_to_group(flat, self.group)
        out = self._routed(inputs, top_i, copy_to_group(top_w.astype(x.dtype), self.group))
        if self.shared_expert is not None:
            gate = F.sigmoid(self.product(flat, self.shared_expert_gate))
            out = out + copy_to_group(gate, self.group) * self.shared_expert(inputs)
        return reduce_from_group(out, self.group).reshape(shape)

    def _routed(self, x, top_i, top_w):
        """sum_k top_w[n, k] * expert_{top_i[n, k]}(x[n]): [N, hidden] (this rank's partial sums)."""
        k = top_i.shape[-1]
        choices = top_i.reshape([-1])
        order = paddle.argsort(choices, stable=True)            # the N*k choices grouped by expert
        counts = np.bincount(choices.numpy(), minlength=len(self.experts))
        tokens = order // k
        outputs, start = [], 0
        for e, count in enumerate(counts.tolist()):
            if count:
                outputs.append(self.experts[e](paddle.gather(x, tokens[start:start + count])))
                start += count
        y = paddle.concat(outputs) * paddle.gather(top_w.reshape([-1]), order).unsqueeze(-1)
        return paddle.index_add(paddle.zeros([x.shape[0], y.shape[-1]], y.dtype), tokens, 0, y)

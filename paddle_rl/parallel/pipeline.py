"""Pipeline parallelism: decoder layers split into consecutive stages, micro-batches moved over send/recv.

- PipelineStage: the part of the decoder one stage holds (the embedding on the first stage; the final
  norm and LM head on the last). Parameter names are those of the full model (`layers.7.mlp...`), so
  checkpoints load and save by name. Tied embeddings keep a copy of the table on the last stage whose
  gradient is summed with the first stage's.
- train_1f1b: one forward and one backward in turn per stage after a warm-up of (stages - stage - 1)
  forwards (PipeDream-flush / Megatron's non-interleaved schedule). Paired exchanges are ordered so
  blocking send/recv cannot deadlock: the lower stage sends first, the higher stage receives first.
- forward_logprobs: forward only, the last stage computes the log-probs and broadcasts them to the stage
  group.

Every stage of a pipeline holds the same micro-batch data (token ids and masks), so activation shapes
([batch, tokens, hidden]) are known on both sides of each transfer without a header.
"""
from typing import Callable, Dict, List, Optional

import paddle
import paddle.distributed as dist
import paddle.nn as nn

from ..models.config import ModelConfig
from ..models.decoder import (DecoderLayer, RMSNorm, RotaryEmbedding, attention_bias_from_mask,
                              position_ids_from_mask)
from . import tensor_parallel as tp
from .collectives import group_size
from .tensor_parallel import vocab_parallel_logprobs


def stage_layers(num_layers: int, num_stages: int, stage: int) -> List[int]:
    """Layer indices of a stage: consecutive, sizes differ by at most one (earlier stages take the extra)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_degree {num_stages} exceeds num_hidden_layers {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


class PipelineStage(nn.Layer):
    def __init__(self, config: ModelConfig, stage: int, num_stages: int, tp_group=None):
        super().__init__()
        self.config = config
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.tp_group = tp_group
        self.layer_ids = stage_layers(config.num_hidden_layers, num_stages, stage)
        if self.is_first or (self.is_last and config.tie_word_embeddings):
            self.embed_tokens = tp.embedding(config.vocab_size, config.hidden_size, tp_group)
        self.layers = nn.LayerDict({str(i): DecoderLayer(config, tp_group) for i in self.layer_ids})
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if not config.tie_word_embeddings:
                self.lm_head = tp.column_linear(config.hidden_size, [config.vocab_size], False, tp_group)
        self.recompute = False
        if self.is_last and not self.is_first and config.tie_word_embeddings:
            self.embed_tokens.weight.pp_duplicate = True  # the first stage's copy counts in the gradient norm

    def forward(self, x, position_ids, attention_bias):
        """Token ids (first stage) or the previous stage's hidden states -> this stage's output hidden states."""
        if self.is_first:
            x = self.embed_tokens(x)
        cos, sin = self.rotary(position_ids)
        for i in self.layer_ids:
            layer = self.layers[str(i)]
            if self.recompute and self.training:
                from paddle.distributed.fleet.utils import recompute
                x = recompute(layer, x, cos, sin, attention_bias, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attention_bias)
        return self.norm(x) if self.is_last else x

    def local_logits(self, hidden):
        if self.config.tie_word_embeddings:
            return paddle.matmul(tp.copy_to_group(hidden, self.tp_group), self.embed_tokens.weight, transpose_y=True)
        return self.lm_head(hidden)

    @property
    def vocab_start(self) -> int:
        return tp.group_rank(self.tp_group) * (self.config.vocab_size // group_size(self.tp_group))

    def response_logprobs(self, hidden, prompt_width: int, response_ids, temperature: float, with_entropy: bool):
        length = response_ids.shape[1]
        logits = self.local_logits(hidden[:, prompt_width - 1:prompt_width - 1 + length])
        if temperature > 0:
            logits = logits / temperature
        return vocab_parallel_logprobs(logits, response_ids, self.tp_group, self.vocab_start, with_entropy)


# ---------------------------------------------------------------------- point-to-point

class _Link:
    """Blocking send/recv between neighbouring stages of this rank's pipeline."""

    def __init__(self, topo):
        ranks = topo.ranks_of["pp"]
        self.stage = topo.pp_rank
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage + 1 < len(ranks) else None

    @staticmethod
    def _recv(shape, src):
        buf = paddle.empty(shape, dtype="float32")
        dist.recv(buf, src=src)
        return buf

    def recv_forward(self, shape):
        if self.prev is None:
            return None
        x = self._recv(shape, self.prev)
        x.stop_gradient = False
        return x

    def send_forward(self, y):
        if self.next is not None:
            dist.send(y.detach(), dst=self.next)

    def recv_backward(self, shape):
        return None if self.next is None else self._recv(shape, self.next)

    def send_backward(self, grad):
        if self.prev is not None:
            dist.send(grad, dst=self.prev)

    def send_forward_recv_backward(self, y, shape):
        """Lower side of an exchange: send first."""
        self.send_forward(y)
        return self.recv_backward(shape)

    def send_backward_recv_forward(self, grad, shape):
        """Higher side of an exchange: receive first."""
        x = self.recv_forward(shape)
        self.send_backward(grad)
        return x


def _micro_inputs(part: Dict[str, paddle.Tensor]):
    mask = part["attention_mask"]
    return (part["input_ids"], position_ids_from_mask(mask),
            attention_bias_from_mask(mask, part["input_ids"].shape[1], causal=True))


def _act_shape(part, hidden_size):
    ids = part["input_ids"]
    return [ids.shape[0], ids.shape[1], hidden_size]


def train_1f1b(stage: PipelineStage, topo, parts: List[Dict[str, paddle.Tensor]], prompt_width: int,
               temperature: float, loss_fn: Callable) -> list:
    """Forward and backward of every micro-batch through the pipeline; gradients accumulate in the stage's
    parameters. loss_fn(part, logp, entropy) -> LossOutput runs on the last stage; returns its outputs
    (empty on other stages)."""
    link = _Link(topo)
    hidden = stage.config.hidden_size
    m = len(parts)
    warmup = min(topo.pp_degree - topo.pp_rank - 1, m)
    outputs, pending = [], []

    def forward(i, x):
        ids, pos, bias = _micro_inputs(parts[i])
        y = stage(ids if stage.is_first else x, pos, bias)
        if stage.is_last:
            logp, entropy = stage.response_logprobs(y, prompt_width, parts[i]["response_ids"], temperature, True)
            out = loss_fn(parts[i], logp, entropy)
            outputs.append(out)
            return out.loss
        return y

    def backward(x, y, grad_y):
        if stage.is_last:
            y.backward()
        else:
            paddle.autograd.backward([y], [grad_y])
        return None if x is None else x.grad

    for i in range(warmup):
        x = link.recv_forward(_act_shape(parts[i], hidden))
        y = forward(i, x)
        link.send_forward(y)
        pending.append((x, y, i))
    remaining = m - warmup
    x = link.recv_forward(_act_shape(parts[warmup], hidden)) if remaining > 0 else None
    for j in range(remaining):
        i = warmup + j
        y = forward(i, x)
        pending.append((x, y, i))
        x0, y0, i0 = pending.pop(0)
        grad_y = None if stage.is_last else link.send_forward_recv_backward(y, _act_shape(parts[i0], hidden))
        gx = backward(x0, y0, grad_y)
        if j == remaining - 1:
            x = None
            link.send_backward(gx)
        else:
            x = link.send_backward_recv_forward(gx, _act_shape(parts[i + 1], hidden))
    while pending:
        x0, y0, i0 = pending.pop(0)
        grad_y = link.recv_backward(_act_shape(parts[i0], hidden))
        link.send_backward(backward(x0, y0, grad_y))
    return outputs


@paddle.no_grad()
def forward_logprobs(stage: PipelineStage, topo, parts: List[Dict[str, paddle.Tensor]], prompt_width: int,
                     temperature: float, with_entropy: bool = False):
    """Per micro-batch (logp, entropy) numpy arrays, identical on every stage (broadcast from the last)."""
    link = _Link(topo)
    hidden = stage.config.hidden_size
    last_rank = topo.ranks_of["pp"][-1]
    out = []
    for part in parts:
        ids, pos, bias = _micro_inputs(part)
        x = link.recv_forward(_act_shape(part, hidden))
        y = stage(ids if stage.is_first else x, pos, bias)
        shape = list(part["response_ids"].shape)
        if stage.is_last:
            logp, ent = stage.response_logprobs(y, prompt_width, part["response_ids"], temperature, with_entropy)
        else:
            link.send_forward(y)
            logp = paddle.empty(shape, dtype="float32")
            ent = paddle.empty(shape, dtype="float32") if with_entropy else None
        dist.broadcast(logp, src=last_rank, group=topo.group("pp"))
        if with_entropy:
            dist.broadcast(ent, src=last_rank, group=topo.group("pp"))
        out.append((logp.numpy(), None if ent is None else ent.numpy()))
    return out


def load_stage(folder: str, topo, config: Optional[ModelConfig] = None) -> PipelineStage:
    """This rank's stage of a Hugging Face checkpoint (tensor-parallel shards under tensor parallelism)."""
    from ..models.pretrained import load_local_state, read_local_state
    config = config or ModelConfig.from_pretrained(folder)
    stage = PipelineStage(config, topo.pp_rank, topo.pp_degree, topo.group("tp"))
    local = read_local_state(folder, config, topo.group("tp"))
    names = {n for n, _ in stage.named_parameters()}
    load_local_state(stage, {k: v for k, v in local.items() if k in names}, source=folder)
    return stage


def gather_stage_states(stage: PipelineStage, topo) -> dict:
    """The full local-layout state of the whole model, on every rank of the stage group."""
    from .collectives import gather_objects
    state = tp.gather_state(stage, topo.group("tp"))
    merged = {}
    for part in gather_objects(state, topo.group("pp")):
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


def sync_tied_embedding(stage: PipelineStage, topo) -> None:
    """Sum the gradients of the tied embedding's two copies (first and last stage)."""
    if not stage.config.tie_word_embeddings or topo.pp_degree == 1:
        return
    group = topo.group("embed")
    if group is None or not (stage.is_first or stage.is_last):
        return
    grad = stage.embed_tokens.weight.grad
    if grad is not None:
        dist.all_reduce(grad, group=group)


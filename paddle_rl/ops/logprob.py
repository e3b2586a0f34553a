"""Per-token log-prob (and entropy) of labels from hidden states and the LM-head weight, in chunks of rows.

`lm_head_logprobs` never forms a [rows, vocab] log-softmax: each chunk of logits yields the per-row log-prob,
entropy, log-sum-exp and mean logit, and the backward forms d logits = scale * (g_logp * (onehot - p) -
g_entropy * p * (z - mean z)) chunk by chunk. The raw logits are kept for the backward while they fit in
SAVE_LOGITS_BYTES in all (a small vocabulary or few rows); beyond that each chunk's logits are recomputed (one
extra LM-head matmul) so memory stays at one chunk. The per-chunk softmax work is a fused kernel when
available, else the same formulas in Paddle.
`lm_head_logprobs_reference` is plain autograd over the full logits (the definition the tests hold it to).
With `bf16` (bf16 training with the LM head in bfloat16) the head's three products take bfloat16-rounded operands
(hidden, weight, d logits) with float32 sums, as ops.bf16_linear (by its bf16 matmul kernel where the CPU has
one); the softmax and log-probs stay float32.
"""
from typing import Optional

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from . import build
from ._util import contiguous, fusable
from .linear import (bf16_kernel, bf16_linear_reference, bf16_matmul_accumulate, bf16_matmul_fused,
                     bf16_matmul_packed, bf16_pack_b, round_bf16)

CHUNK_ELEMENTS = 1 << 24       # logits per chunk (64 MB of float32)
SAVE_LOGITS_BYTES = 256 << 20  # keep the logits for the backward up to this size, else recompute them


def _head(hidden, weight, transpose_weight: bool, bf16_fused: bool = False, packed=None):
    """The logits; `bf16_fused`: by the bf16 matmul kernel (it rounds the operands to bfloat16 itself), from
    `packed` (the weight's bf16_pack_b, made once per pass) when given."""
    if packed is not None:
        return bf16_matmul_packed(hidden, packed)
    if bf16_fused:
        return bf16_matmul_fused(hidden, weight, trans_b=transpose_weight)
    return paddle.matmul(hidden, weight, transpose_y=transpose_weight)


def _bf16_fused(bf16: bool, hidden, weight) -> bool:
    """Whether the head's bf16 products run the bf16 matmul kernel (else rounded copies and float32 matmuls)."""
    return bf16 and bf16_kernel(hidden, weight) != "emulated"


def lm_head_logprobs_reference(hidden, weight, labels, temperature: float, with_entropy: bool = False,
                               transpose_weight: bool = False, bf16: bool = False, with_greedy: bool = False):
    """hidden [N, H]; weight [H, V] ([V, H] with transpose_weight); labels [N] -> (logp [N], entropy [N] or None)
    (and the argmax of each row's logits [N] with `with_greedy`)."""
    if bf16:
        logits = bf16_linear_reference(hidden, weight.T if transpose_weight else weight)
    else:
        logits = _head(hidden, weight, transpose_weight)
    out = logprobs_from_logits(logits, labels, temperature, with_entropy)
    return (*out, paddle.argmax(logits, axis=-1)) if with_greedy else out


def logprobs_from_logits(logits, labels, temperature: float, with_entropy: bool = False):
    """log softmax(logits / T) at labels (and the entropy), over the last axis.

    Written out instead of F.log_softmax, whose CPU kernel is far slower at [tokens, vocab] sizes.
    """
    if temperature > 0:
        logits = logits / temperature
    shifted = logits - logits.max(axis=-1, keepdim=True).detach()
    logp_all = shifted - shifted.exp().sum(axis=-1, keepdim=True).log()
    logp = paddle.take_along_axis(logp_all, labels.unsqueeze(-1), axis=-1).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(axis=-1) if with_entropy else None
    return logp, entropy


# ------------------------------------------------------------------------------------------ chunk kernels

def chunk_forward_reference(logits, labels, scale: float):
    """(logp, entropy, lse, mean_z) of z = scale * logits, each [n]."""
    z = logits * scale
    top = z.max(axis=-1, keepdim=True)
    e = (z - top).exp()
    total = e.sum(axis=-1, keepdim=True)
    lse = total.log() + top
    mean_z = ((e / total) * z).sum(axis=-1, keepdim=True)
    logp = paddle.take_along_axis(z, labels.unsqueeze(-1), axis=-1) - lse
    return logp.squeeze(-1), (lse - mean_z).squeeze(-1), lse.squeeze(-1), mean_z.squeeze(-1)


def chunk_backward_reference(logits, labels, lse, mean_z, grad_logp, grad_entropy, scale: float):
    z = logits * scale
    p = (z - lse.unsqueeze(-1)).exp()
    grad = -grad_logp.unsqueeze(-1) * p
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(-1) * p * (z - mean_z.unsqueeze(-1))
    grad = grad + F.one_hot(labels, logits.shape[-1]).astype(grad.dtype) * grad_logp.unsqueeze(-1)
    return grad * scale


def chunk_forward_fused(logits, labels, scale: float):
    return tuple(build.run("prl_logprob", contiguous(logits), labels, float(scale)))


def chunk_backward_fused(logits, labels, lse, mean_z, grad_logp, grad_entropy, scale: float):
    return build.run("prl_logprob_backward", contiguous(logits), labels, lse, mean_z, contiguous(grad_logp),
                     None if grad_entropy is None else contiguous(grad_entropy), float(scale))[0]


def chunk_backward_over_logits(logits, labels, lse, mean_z, grad_logp, grad_entropy, scale: float):
    """chunk_backward_fused written over `logits` (the caller's own contiguous CPU chunk, not read again): no new
    [rows, vocab] tensor per chunk. Returns the overwritten tensor."""
    build.run("prl_logprob_backward_inplace", logits, labels, lse, mean_z, contiguous(grad_logp),
              None if grad_entropy is None else contiguous(grad_entropy), float(scale))
    return logits


def row_argmax(logits):
    """paddle.argmax(logits, axis=-1) of [N, V] logits (the first index of each row's largest value), by the CPU
    kernel where it runs (Paddle's CPU argmax reads a [341, 49152] chunk in ~25 ms)."""
    if fusable(logits) and logits.place.is_cpu_place() and len(logits.shape) == 2 and logits.shape[1] > 0:
        return build.run("prl_row_argmax", contiguous(logits))[0]
    return paddle.argmax(logits, axis=-1)


def _kernels(fused: bool):
    if fused:
        return chunk_forward_fused, chunk_backward_fused
    return chunk_forward_reference, chunk_backward_reference


def _chunk_rows(rows: int, vocab: int, chunk_rows: Optional[int]) -> int:
    if chunk_rows:
        return max(1, int(chunk_rows))
    return max(1, min(rows, CHUNK_ELEMENTS // max(vocab, 1)))


def _forward_chunks(hidden, weight, labels, scale, transpose, rows_per_chunk, fused, keep_logits=False,
                    greedy=None, bf16_fused=False):
    """(logp, entropy, lse, mean_z) over all rows, and the list of chunk logits when keep_logits. `greedy`: a list
    that gets each chunk's argmax over the vocabulary (one more read of the chunk's logits)."""
    forward, _ = _kernels(fused)
    outs, kept = [], []
    # the head's weight rounded and packed once for all the chunks (bf16_matmul would pack it for each)
    packed = bf16_pack_b(weight, trans_b=transpose) if bf16_fused and hidden.shape[0] > rows_per_chunk else None
    for start in range(0, hidden.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, hidden.shape[0])
        logits = _head(hidden[start:stop], weight, transpose, bf16_fused, packed)
        outs.append(forward(logits, labels[start:stop], scale))
        if keep_logits:
            kept.append(logits)
        if greedy is not None:
            greedy.append(row_argmax(logits))
    if len(outs) == 1:
        return outs[0], kept
    return tuple(paddle.concat([o[i] for o in outs]) for i in range(4)), kept


class _ChunkedLMHead(PyLayer):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, transpose, rows_per_chunk, fused, bf16=False, greedy=None):
        ctx.needs = (not hidden.stop_gradient, not weight.stop_gradient)
        bf16_fused = _bf16_fused(bf16, hidden, weight)
        if bf16 and not bf16_fused:  # the products' operands in bfloat16 (d logits rounded in the backward)
            hidden, weight = round_bf16(hidden), round_bf16(weight)
        vocab = weight.shape[0] if transpose else weight.shape[1]
        keep = hidden.shape[0] * vocab * 4 <= SAVE_LOGITS_BYTES
        (logp, entropy, lse, mean_z), kept = _forward_chunks(hidden, weight, labels, scale, transpose,
                                                             rows_per_chunk, fused, keep_logits=keep,
                                                             greedy=greedy, bf16_fused=bf16_fused)
        ctx.save_for_backward(hidden, weight, labels, lse, mean_z)
        ctx.kept_logits = kept
        ctx.config = (scale, transpose, rows_per_chunk, fused, bf16, bf16_fused)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, lse, mean_z = ctx.saved_tensor()
        scale, transpose, rows_per_chunk, fused, bf16, bf16_fused = ctx.config
        _, backward = _kernels(fused)
        kept, ctx.kept_logits = ctx.kept_logits, None
        grad_hidden, grad_weight = [], None
        # over several chunks, the weight packed once for the logits (unless kept) and once for d hidden
        many = bf16_fused and hidden.shape[0] > rows_per_chunk
        packed = bf16_pack_b(weight, trans_b=transpose) if many and not kept else None
        packed_dx = bf16_pack_b(weight, trans_b=not transpose) if many and ctx.needs[0] else None
        for index, start in enumerate(range(0, hidden.shape[0], rows_per_chunk)):
            stop = min(start + rows_per_chunk, hidden.shape[0])
            h = hidden[start:stop]
            logits = kept[index] if kept else _head(h, weight, transpose, bf16_fused, packed)
            g_ent = None if grad_entropy is None else grad_entropy[start:stop]
            # the chunk's logits are this loop's own: the CPU kernel writes d logits over them
            over = fused and logits.place.is_cpu_place() and logits.is_contiguous()
            g = (chunk_backward_over_logits if over else backward)(
                logits, labels[start:stop], lse[start:stop], mean_z[start:stop], grad_logp[start:stop], g_ent, scale)
            if kept:
                kept[index] = None
            if bf16_fused:  # the kernel rounds g, h and the weight
                grad_hidden.append(bf16_matmul_packed(g, packed_dx) if packed_dx is not None
                                   else bf16_matmul_fused(g, weight, trans_b=not transpose))
                left, right = (g, h) if transpose else (h, g)
                if grad_weight is None:
                    grad_weight = bf16_matmul_fused(left, right, trans_a=True)
                else:  # summed in place over the chunks: no [vocab, hidden] tensor per chunk
                    bf16_matmul_accumulate(grad_weight, left, right, trans_a=True)
            else:
                g = round_bf16(g) if bf16 else g
                grad_hidden.append(paddle.matmul(g, weight, transpose_y=not transpose))
                part = paddle.matmul(g, h, transpose_x=True) if transpose else paddle.matmul(h, g, transpose_x=True)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)  # in place: no new [V, H]
        grad_hidden = grad_hidden[0] if len(grad_hidden) == 1 else paddle.concat(grad_hidden)
        grads = []
        if ctx.needs[0]:
            grads.append(grad_hidden)
        if ctx.needs[1]:
            grads.append(grad_weight)
        return tuple(grads) if len(grads) != 1 else grads[0]


def lm_head_logprobs(hidden, weight, labels, temperature: float, with_entropy: bool = False,
                     transpose_weight: bool = False, chunk_rows: Optional[int] = None,
                     fused: Optional[bool] = None, bf16: bool = False, with_greedy: bool = False) -> tuple:
    """Chunked (logp [N], entropy [N] or None) of labels under softmax(hidden @ weight / temperature).

    Differentiable in hidden and weight. `fused` forces the kernel choice (default: the fused kernels when
    available); `bf16`: the head's products from bfloat16-rounded operands. `with_greedy` adds a third output: the
    argmax over the vocabulary of each row's logits [N] int64 (the distribution's greedy choice; the first index of
    a tie, as paddle.argmax), from the same chunks (no gradient)."""
    scale = 1.0 / temperature if temperature > 0 else 1.0
    if fused is None:
        fused = fusable(hidden, weight)
    vocab = weight.shape[0] if transpose_weight else weight.shape[1]
    rows = _chunk_rows(hidden.shape[0], vocab, chunk_rows)
    needs_grad = paddle.is_grad_enabled() and not (hidden.stop_gradient and weight.stop_gradient)
    greedy = [] if with_greedy else None
    if needs_grad:
        logp, entropy = _ChunkedLMHead.apply(hidden, weight, labels, scale, transpose_weight, rows, fused, bf16,
                                             greedy)
    else:
        bf16_fused = _bf16_fused(bf16, hidden, weight)
        if bf16 and not bf16_fused:
            hidden, weight = round_bf16(hidden), round_bf16(weight)
        (logp, entropy, _, _), _ = _forward_chunks(hidden, weight, labels, scale, transpose_weight, rows, fused,
                                                   greedy=greedy, bf16_fused=bf16_fused)
    if not with_greedy:
        return logp, (entropy if with_entropy else None)
    return logp, (entropy if with_entropy else None), greedy[0] if len(greedy) == 1 else paddle.concat(greedy)

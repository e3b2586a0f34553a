"""Sequences packed into one row of real tokens (`use_remove_padding`): the token-wise work (projections, MLP, norms,
the LM head) runs on real tokens only, and attention runs on blocks of segments gathered from the row by index.

A packed micro-batch holds each distinct prompt once, followed by the responses that continue it:
[prompt_u | r_1 | ... | r_k] for every prompt u (rows that do not share prompts: one prompt per row). Positions
count from each prompt's start, so a response's tokens sit where they would in its own sequence. Attention is a
set of segments: a prompt attends causally to itself; a response attends to its prompt and causally to itself.
On the CPU with the fused kernels, one op (ops.packed_attention_fused) reads each token's keys from its spans
(prefix range, own segment up to itself) and keeps no probabilities: its backward recomputes them from each row's
log-sum-exp. Elsewhere (and with use_flash_attention: false), segments of similar sizes are gathered into
padded blocks (queries [rows, Lq], keys
[rows, Lk]); a dynamic program over the segments sorted by size chooses the blocks, trading padded query-key
pairs against a fixed cost per block (`BLOCK_PAIRS`). Each block runs the attention of the padded path (the
materialized masked softmax, or with use_flash_attention: true ops.blocked_attention), and every token's
output is gathered back to its packed position. Gathers carry gradients (a scatter-add
backward). Both give the padded layout's log-probs and gradients up to float rounding.

As in the padded pass, a response's last column of the micro-batch is not run (it predicts nothing): each row
runs min(length, width - 1) response tokens, so the MoE router statistics count the same tokens.
"""
from typing import List, Sequence

import numpy as np
import paddle

from .. import ops

NEG_INF = -1e9
# the cost of one more attention block, in query-key pairs (its ~25 framework ops forward and backward per layer
# against the pairs a wider block pads); 0 to 131072 measured alike on W2's lengths (docs/performance_history.md)
BLOCK_PAIRS = 32768


class Block:
    """One attention block: `rows` segments padded to `length` queries and `keys` keys."""

    def __init__(self, rows: int, length: int, keys: int, q_index, k_index, allowed):
        self.shape = (rows, length, keys)
        self.q_index = paddle.to_tensor(q_index.reshape(-1))
        self.k_index = paddle.to_tensor(k_index.reshape(-1))
        bias = np.where(allowed, 0.0, NEG_INF).astype(np.float32)
        self.bias = paddle.to_tensor(bias[:, None])  # [rows, 1, length, keys], as the padded path's bias


def partition(queries: np.ndarray, keys: np.ndarray, block_pairs: int = BLOCK_PAIRS) -> List[np.ndarray]:
    """Segments (query and key counts) in blocks: sorted by keys, cut where the padded pairs of a block
    (rows x longest queries x longest keys) plus `block_pairs` per block are least (exact over cuts of the
    sorted order). Returns the segment indices of each block."""
    order = np.lexsort((-queries, -keys))
    q, k = queries[order].astype(np.float64), keys[order].astype(np.float64)
    count = len(order)
    best = np.zeros(count + 1)
    start = np.zeros(count + 1, dtype=np.int64)
    for end in range(1, count + 1):
        longest_q = np.maximum.accumulate(q[:end][::-1])[::-1]   # longest queries of [i, end) for every i
        cost = best[:end] + (end - np.arange(end)) * longest_q * k[:end] + block_pairs
        start[end] = int(np.argmin(cost))
        best[end] = cost[start[end]]
    blocks, end = [], count
    while end > 0:
        blocks.append(order[start[end]:end])
        end = start[end]
    return blocks[::-1]


class Packing:
    """One packed micro-batch: the row's tokens (`input_ids`, `position_ids`, `token_weight` [1, N]), its
    attention blocks, and where each response's log-probs come from and go (`select`, `targets`, `place`)."""

    def __init__(self, prompts: Sequence[Sequence[int]], prompt_of_row, response_ids, lengths,
                 block_pairs: int = BLOCK_PAIRS):
        """prompts: the distinct prompts (token lists); prompt_of_row [b]: each row's prompt; response_ids [b, W];
        lengths [b]: each row's real response tokens (its first `lengths[i]` columns)."""
        prompt_of_row = np.asarray(prompt_of_row, dtype=np.int64)
        response_ids = np.asarray(response_ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        rows, width = response_ids.shape
        run = np.minimum(lengths, width - 1)
        uses = np.bincount(prompt_of_row, minlength=len(prompts))
        ids, positions, weights, prefixes, queries, spans = [], [], [], [], [], []
        last_prompt = np.zeros(rows, dtype=np.int64)
        response_start = np.zeros(rows, dtype=np.int64)
        n = 0
        for u, prompt in enumerate(prompts):
            p = len(prompt)
            prompt_at = np.arange(n, n + p)
            ids.append(np.asarray(prompt, dtype=np.int64))
            positions.append(np.arange(p))
            weights.append(np.full(p, uses[u], dtype=np.float32))
            prefixes.append(prompt_at[:0])
            queries.append(prompt_at)
            prompt_start = n
            prompt_spans = np.tile(np.array([n, n, n, 0], dtype=np.int64), (p, 1))
            spans.append(prompt_spans)
            n += p
            for i in np.flatnonzero(prompt_of_row == u):
                last_prompt[i], response_start[i] = prompt_at[-1], n
                r = int(run[i])
                ids.append(response_ids[i, :r])
                positions.append(np.arange(p, p + r))
                weights.append(np.ones(r, dtype=np.float32))
                # a response token attends to its prompt and to its own tokens up to itself
                spans.append(np.tile(np.array([prompt_start, prompt_start + p, n, n + r],
                                              dtype=np.int64), (r, 1)))
                if r:
                    prefixes.append(prompt_at)
                    queries.append(np.arange(n, n + r))
                n += r
            prompt_spans[:, 3] = n  # a prompt token's key is read by the prompt after it and every response
        self.rows, self.width, self.tokens = rows, width, n
        self.input_ids = paddle.to_tensor(np.concatenate(ids)[None])
        # per token (prefix_begin, prefix_end, segment_begin, query_end): the packed attention kernel's spans
        self.spans = paddle.to_tensor(np.concatenate(spans) if spans else np.zeros((0, 4), np.int64))
        self.position_ids = paddle.to_tensor(np.concatenate(positions)[None])
        self.token_weight = paddle.to_tensor(np.concatenate(weights)[None])
        self._blocks(prefixes, queries, block_pairs)
        self._head(response_ids, lengths, last_prompt, response_start)

    def _blocks(self, prefixes, queries, block_pairs: int) -> None:
        lq = np.array([len(q) for q in queries])
        lk = np.array([len(p) + len(q) for p, q in zip(prefixes, queries)])
        out_index = np.zeros(self.tokens, dtype=np.int64)
        self.blocks, offset = [], 0
        for members in partition(lq, lk, block_pairs):
            rows, length, keys = len(members), int(lq[members].max()), int(lk[members].max())
            q_index = np.zeros((rows, length), dtype=np.int64)
            k_index = np.zeros((rows, keys), dtype=np.int64)
            for j, s in enumerate(members):
                key_at = np.concatenate([prefixes[s], queries[s]])
                q_index[j, :lq[s]] = queries[s]
                k_index[j, :lk[s]] = key_at
                out_index[queries[s]] = offset + j * length + np.arange(lq[s])
            prefix = (lk[members] - lq[members])[:, None, None]
            q_at, k_at = np.arange(length)[None, :, None], np.arange(keys)[None, None, :]
            allowed = (q_at < lq[members][:, None, None]) & (k_at <= prefix + q_at)
            self.blocks.append(Block(rows, length, keys, q_index, k_index, allowed))
            offset += rows * length
        self.out_index = paddle.to_tensor(out_index)

    def _head(self, response_ids, lengths, last_prompt, response_start) -> None:
        """Response token t of row i is predicted at its prompt's last token (t = 0) or at its token t - 1."""
        rows, width = response_ids.shape
        row = np.repeat(np.arange(rows), lengths)
        t = np.concatenate([np.arange(n) for n in lengths]) if rows else np.zeros(0, np.int64)
        select = np.where(t == 0, last_prompt[row], response_start[row] + t - 1)
        targets = response_ids[row, t]
        if not len(select):  # nothing to predict: one unused position keeps the graph (its values are never placed)
            select, targets = np.zeros(1, np.int64), np.zeros(1, np.int64)
        place = np.full(rows * width, len(select), dtype=np.int64)  # the zero after the values
        place[row * width + t] = np.arange(len(row))
        self.select = paddle.to_tensor(select.astype(np.int64))
        self.targets = paddle.to_tensor(targets.astype(np.int64)[None])
        self.place_index = paddle.to_tensor(place)

    @staticmethod
    def fused(q, k, v) -> bool:
        """Whether attend runs the packed kernel for these q, k, v [1, N, heads, d] (where it runs, unless
        use_flash_attention is false)."""
        return ops.kernel_switch("attention") is not False and ops.packed_attention_usable(q, k, v)

    @classmethod
    def stores_probabilities(cls, q, k, v) -> bool:
        """Whether attend keeps its probabilities for the backward (neither the kernel nor the blocked path)."""
        return not cls.fused(q, k, v) and not ops.kernel_switch("attention")

    def attend(self, q, k, v, scale: float):
        """Attention of the packed row: q [1, N, heads, d], k, v [1, N, kv_heads, d] (rotary applied) ->
        [1, N, heads * d]."""
        n, heads, kv_heads, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
        q, k, v = q.reshape([n, heads, d]), k.reshape([n, kv_heads, d]), v.reshape([n, kv_heads, d])
        if self.fused(q, k, v):  # the CPU kernel: no gathered blocks, no stored probabilities
            return ops.packed_attention_fused(q, k, v, self.spans, scale).unsqueeze(0)
        outs = []
        for block in self.blocks:
            rows, length, keys = block.shape
            qb = paddle.gather(q, block.q_index).reshape([rows, length, heads, d]).transpose([0, 2, 1, 3])
            qb = qb.reshape([rows, kv_heads, heads // kv_heads * length, d])  # a kv head's query heads folded in
            kb = paddle.gather(k, block.k_index).reshape([rows, keys, kv_heads, d]).transpose([0, 2, 1, 3])
            vb = paddle.gather(v, block.k_index).reshape([rows, keys, kv_heads, d]).transpose([0, 2, 1, 3])
            if ops.kernel_switch("attention"):  # use_flash_attention without the kernel: no probabilities kept
                out = ops.blocked_attention(qb, kb, vb, block.bias, scale)
            else:
                out = paddle.matmul(ops.masked_softmax(paddle.matmul(qb, kb, transpose_y=True), block.bias, scale), vb)
            out = out.reshape([rows, heads, length, d]).transpose([0, 2, 1, 3])
            outs.append(out.reshape([rows * length, heads * d]))
        out = outs[0] if len(outs) == 1 else paddle.concat(outs)
        return paddle.gather(out, self.out_index).unsqueeze(0)

    def place(self, values):
        """Per-target values [1, M] -> [b, W] in the rows' response columns (0 where nothing is predicted)."""
        flat = paddle.concat([values.reshape([-1]), paddle.zeros([1], values.dtype)])
        return paddle.gather(flat, self.place_index).reshape([self.rows, self.width])

"""The running batch of the rollout engine: its sequences, their KV cache and per-row sampling state, kept
compact.

The KV cache is contiguous: per layer k, v [rows, kv_heads, capacity, head_dim]; slots [0, slot) are written
and row r attends to slots [start[r], slot). Every row writes its next token at the same slot, so a decode step
is one batched call of the model's fused decode path. When rows finish they leave at once: the last rows move
into their places and the buffers become views of the rows left (`drop`: only the moved rows' windows are
copied). Joining rows, and a buffer that is full, take one relayout: a fresh buffer filled by `ops.kv_place` (one
copy of the live window) from which the slots before the oldest live row's prompt are dropped; joining rows are
placed so that their prompt ends at `slot`. docs/performance.md and ARCHITECTURE.md say why this and not a paged
cache.
"""
import math
from typing import List, Optional

import numpy as np
import paddle

from ..models.decoder import LayerCache
from ..ops.kv_cache import kv_place
from .sequence import Sequence

GROWTH = 128   # slots added past the widest window when a buffer is (re)built (bounded by prompt + max_dec_len)
ROW_STATE = ("logits", "seen")   # the per-row tensors, aligned with seqs
# the per-row numpy arrays, aligned with seqs
ROW_ARRAYS = ("uniforms", "prompt_lengths", "generated", "last", "origin")


class RunningBatch:
    def __init__(self, num_layers: int, max_dec_len: int, zero_fill: bool = True):
        """`zero_fill`: new cache buffers are zeroed (the reference decode attention reads every slot below the
        step's, masked: 0 x an uninitialized NaN would be NaN); False where the decode kernel reads them, which
        reads each row's window only (ops.decode_attention_reads_windows), every slot of which is written first."""
        self.max_dec_len = max_dec_len
        self.zero_fill = zero_fill
        self.layers: List[LayerCache] = [LayerCache() for _ in range(num_layers)]
        self.seqs: List[Sequence] = []
        self.start = np.zeros(0, dtype=np.int64)
        self._start_t = None
        self.capacity = 0
        # per-row tensors, aligned with seqs
        self.logits = None        # [R, V] the next token's logits
        self.seen = None          # [R, V] float32 (repetition penalty)
        # per-row numpy arrays, aligned with seqs (what each step reads without a loop over the rows)
        self.uniforms = None      # [R, max_dec_len] float32 (sampling)
        self.prompt_lengths = np.zeros(0, dtype=np.int64)
        self.generated = np.zeros(0, dtype=np.int64)   # tokens so far (len(seq.tokens))
        self.last = np.zeros(0, dtype=np.int64)        # each row's last token (the next decode step's input)
        # the prefill row each row's prompt was placed from (rows with the same origin hold the same keys and values
        # in their prompt's slots: a prompt's samples), numbered afresh by each prefill
        self.origin = None
        self._origins = 0      # origins given so far
        self._shared_t = None  # shared_tensor(), made after each change of rows (False: no row shares)
        self.relayouts = 0
        self.copied_slots = 0      # row-slots copied by relayouts (per layer, keys and values each)
        self.peak_slots = 0        # the most row-slots the buffers held (rows x capacity)
        self.peak_kv_bytes = 0     # the most bytes the buffers held (keys and values of every layer)

    @property
    def slot(self) -> int:
        """The cache slot the next decode step writes (the model's decode path advances the layers' length)."""
        return self.layers[0].length

    def __len__(self) -> int:
        return len(self.seqs)

    # ---------------------------------------------------------------- row-aligned values
    def lengths(self) -> np.ndarray:
        """Tokens so far per row (len(seq.tokens))."""
        return self.generated.copy()

    def positions(self) -> np.ndarray:
        """The position id of each row's next token (prompt tokens + tokens so far, minus one for the last
        sampled token not yet in the cache)."""
        return self.prompt_lengths + self.generated - 1

    def advance(self, tokens: np.ndarray) -> None:
        """Every row took one more token, `tokens` [R] (its sample, or an observation's token fed in)."""
        self.generated = self.generated + 1
        self.last = np.asarray(tokens, dtype=np.int64)

    def buffer(self, shape, dtype):
        """A new cache buffer (zeroed with `zero_fill`, else uninitialized)."""
        return paddle.zeros(shape, dtype) if self.zero_fill else paddle.empty(shape, dtype)

    # ---------------------------------------------------------------- relayout
    def relayout(self, keep: np.ndarray, new_seqs: List[Sequence] = (), prefill: Optional[List[LayerCache]] = None,
                 fan: Optional[np.ndarray] = None, prompt_width: int = 0, new_rows: Optional[dict] = None,
                 decode_count: int = 0) -> None:
        """Keep rows `keep` (indices, in order), then append `new_seqs` whose keys and values are rows `fan` of
        the prefill caches (prompts left-padded to `prompt_width`); `new_rows` holds their logits / uniforms /
        seen tensors. Builds buffers just wide enough for the live window plus GROWTH slots; rows that only
        leave are dropped in place instead (`drop`)."""
        keep = np.asarray(keep, dtype=np.int64)
        if prefill is None and not new_seqs and 0 < len(keep) < len(self.seqs) and (np.diff(keep) > 0).all():
            return self.drop(keep)
        kept = [self.seqs[i] for i in keep]
        origin = int(self.start[keep].min()) if len(keep) else self.slot
        old_width = self.slot - origin
        width = max(old_width, prompt_width if new_seqs else 0)
        seqs = kept + list(new_seqs)
        if not seqs:
            counters = (self.relayouts + 1, self.copied_slots, self.peak_slots, self.peak_kv_bytes)
            self.__init__(len(self.layers), self.max_dec_len, self.zero_fill)
            self.relayouts, self.copied_slots, self.peak_slots, self.peak_kv_bytes = counters
            return
        widest = max(len(s.prompt) for s in seqs) + self.max_dec_len
        remaining = max(self.max_dec_len - len(s.tokens) for s in seqs)
        capacity = max(width + 1, min(width + min(GROWTH, remaining), widest))
        keep_t = paddle.to_tensor(keep)
        fan_t = None if fan is None else paddle.to_tensor(np.asarray(fan, dtype=np.int64))
        for i, layer in enumerate(self.layers):
            source = prefill[i] if prefill is not None else None
            shape_of = layer.k if layer.k is not None else source.k
            shape = [len(seqs), shape_of.shape[1], capacity, shape_of.shape[3]]
            k, v = self.buffer(shape, shape_of.dtype), self.buffer(shape, shape_of.dtype)
            if len(keep) and old_width:
                kv_place(k, layer.k, keep_t, 0, origin, width - old_width, old_width)
                kv_place(v, layer.v, keep_t, 0, origin, width - old_width, old_width)
            if source is not None:
                kv_place(k, source.k, fan_t, len(keep), 0, width - prompt_width, prompt_width)
                kv_place(v, source.v, fan_t, len(keep), 0, width - prompt_width, prompt_width)
            layer.k, layer.v, layer.length, layer.capacity = k, v, width, capacity
        starts = [self.start[keep] - origin + (width - old_width)] + \
                 [np.array([width - len(s.prompt) for s in new_seqs], dtype=np.int64)]
        self.start = np.concatenate(starts).astype(np.int64)
        self._start_t = self._shared_t = None
        for s in new_seqs:
            s.joined_at = decode_count
        whole = len(keep) == len(self.seqs) and (keep == np.arange(len(keep))).all()
        for name in ROW_STATE:
            old = getattr(self, name)
            parts = []
            if old is not None and len(keep):
                parts.append(old if whole else paddle.gather(old, keep_t))
            if new_rows is not None and new_rows.get(name) is not None:
                parts.append(new_rows[name])
            setattr(self, name, None if not parts else parts[0] if len(parts) == 1 else paddle.concat(parts))
        joining = {"uniforms": None if new_rows is None else new_rows.get("uniforms"),
                   "prompt_lengths": np.array([len(s.prompt) for s in new_seqs], dtype=np.int64),
                   "generated": np.array([len(s.tokens) for s in new_seqs], dtype=np.int64),
                   "last": np.array([s.tokens[-1] if s.tokens else 0 for s in new_seqs], dtype=np.int64),
                   "origin": self._origins + (np.asarray(fan, dtype=np.int64) if fan is not None
                                              else np.arange(len(new_seqs), dtype=np.int64))}
        self._origins = int(joining["origin"].max()) + 1 if new_seqs else self._origins
        for name in ROW_ARRAYS:
            old, parts = getattr(self, name), []
            if old is not None and len(keep):
                parts.append(old if whole else old[keep])
            if joining[name] is not None and new_seqs:
                parts.append(joining[name])
            setattr(self, name, None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts))
        self.seqs, self.capacity = seqs, capacity
        self.relayouts += 1
        self.copied_slots += len(keep) * old_width + (len(new_seqs) * prompt_width if new_seqs else 0)
        self.peak_slots = max(self.peak_slots, len(seqs) * capacity)
        first = self.layers[0].k
        held = 2 * len(self.layers) * math.prod(first.shape) * first.element_size()   # (Tensor.size is an op)
        self.peak_kv_bytes = max(self.peak_kv_bytes, held)

    def drop(self, keep: np.ndarray) -> None:
        """Keep rows `keep` (increasing) in the buffers they are in: the last kept rows move into the places of the
        rows that left before them (only the moved rows' windows are copied, through a scratch buffer), and the
        buffers become views of their first len(keep) rows. Row order changes; nothing a row computes depends on
        its place. Slots and capacity stay (the next full relayout drops the dead slots)."""
        n = len(keep)
        live = np.zeros(len(self.seqs), dtype=bool)
        live[keep] = True
        holes = np.flatnonzero(~live[:n])
        tails = np.flatnonzero(live[n:]) + n
        order = np.arange(n)
        order[holes] = tails          # new row i is old row order[i]
        if len(holes):
            first = int(self.start[tails].min())
            width = self.slot - first
            tails_t = paddle.to_tensor(tails)
            # hole j takes scratch row j: a run of consecutive holes is one copy of consecutive scratch rows
            runs = np.flatnonzero(np.diff(holes) != 1) + 1
            moved = [(paddle.to_tensor(np.arange(a, b, dtype=np.int64)), int(holes[a]))
                     for a, b in zip(np.r_[0, runs], np.r_[runs, len(holes)])]
            for layer in self.layers:
                for buf in (layer.k, layer.v):
                    scratch = paddle.empty([len(tails), buf.shape[1], width, buf.shape[3]], buf.dtype)
                    kv_place(scratch, buf, tails_t, 0, first, 0, width)
                    for rows, hole in moved:
                        kv_place(buf, scratch, rows, hole, 0, first, width)
            self.copied_slots += len(tails) * width
        for layer in self.layers:
            layer.k, layer.v = layer.k._slice(0, n), layer.v._slice(0, n)   # views: no copy
        self.start = self.start[order]
        self._start_t = self._shared_t = None
        self.seqs = [self.seqs[i] for i in order]
        order_t = paddle.to_tensor(order)
        for name in ROW_STATE:
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, paddle.gather(old, order_t))
        for name in ROW_ARRAYS:
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, old[order])
        self.relayouts += 1

    def start_tensor(self):
        """`start` as a tensor (rebuilt only after a relayout changes it)."""
        if self._start_t is None:
            self._start_t = paddle.to_tensor(self.start)
        return self._start_t

    def shared_tensor(self):
        """[R, 2] int64 for the decode step (ops.decode_layer's `shared`): per row, the first row placed from the
        same prefill row (itself for the first) and the slot its prompt ends at, so the samples of a prompt read its
        keys and values from one row; None when no two rows share a prompt. Rebuilt only after the rows change."""
        if self._shared_t is None:
            if self.origin is None or len(self.origin) != len(self.seqs):   # (rows not placed by `relayout`)
                return None
            first, which = np.unique(self.origin, return_index=True, return_inverse=True)[1:]
            if len(first) == len(self.origin):
                self._shared_t = False
            else:
                rows = np.stack([first[which], self.start + self.prompt_lengths], axis=1)
                self._shared_t = paddle.to_tensor(rows.astype(np.int64))
        return self._shared_t if self._shared_t is not False else None

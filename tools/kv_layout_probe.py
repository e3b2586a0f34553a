"""Compare the two KV-cache ideas for continuous batching on one workload's length timeline (W2 by default:
the W1 model's KV shape, 8 prompts x 8 samples, the long-tailed EOS schedule of paddle-rl bench).

- contiguous + compaction (what rollout/running.py does): one buffer [rows, kv_heads, capacity, head_dim] per
  layer, a decode step attends with the fused `decode_attention`; when rows finish, one relayout copies the live
  window into a fresh buffer (`kv_place`).
- paged: blocks of `--block` slots in a pool, a block table per row. Without a paged attention kernel every
  decode step gathers each row's blocks into a contiguous tensor for the same `decode_attention`; a dedicated
  kernel would read the blocks in place (its cost is then about the contiguous step's, minus nothing).

Prints, for the attention and cache work of one layer over the whole rollout: seconds of each idea, the slots
copied, and the peak slots held (memory). Usage: python tools/kv_layout_probe.py [--lengths w2|w4] [--block 16]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()
import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_rl import ops  # noqa: E402
from paddle_rl.ops.kv_cache import kv_place  # noqa: E402
from paddle_rl.bench import long_tail_lengths  # noqa: E402


def timeline(lengths, prompt: int):
    """Per decode step t: the rows alive (all admitted at step 0)."""
    lengths = np.asarray(lengths)
    return [np.flatnonzero(lengths > t + 1) for t in range(int(lengths.max()) - 1)]


def contiguous(lengths, prompt, kv, dim, heads, growth=128):
    rows = np.arange(len(lengths))
    cap = prompt + min(growth, int(max(lengths)))
    k = paddle.randn([len(rows), kv, cap, dim])
    v = paddle.randn([len(rows), kv, cap, dim])
    start = paddle.zeros([len(rows)], dtype="int64")
    copy_s = attn_s = 0.0
    copied = 0
    peak = len(rows) * cap
    alive_prev = rows
    for t, alive in enumerate(timeline(lengths, prompt)):
        slot = prompt + t
        if len(alive) != len(alive_prev) or slot >= k.shape[2]:
            keep = np.searchsorted(alive_prev, alive)
            cap = min(slot + min(growth, int(max(lengths)) - t), prompt + int(max(lengths)))
            t0 = time.perf_counter()
            nk = paddle.zeros([len(alive), kv, cap, dim])
            nv = paddle.zeros([len(alive), kv, cap, dim])
            keep_t = paddle.to_tensor(keep.astype(np.int64))
            kv_place(nk, k, keep_t, 0, 0, 0, slot)
            kv_place(nv, v, keep_t, 0, 0, 0, slot)
            copy_s += time.perf_counter() - t0
            copied += 2 * len(alive) * slot
            k, v, alive_prev = nk, nv, alive
            start = paddle.zeros([len(alive)], dtype="int64")
            peak = max(peak, len(alive) * cap)
        q = paddle.randn([len(alive), 1, heads, dim])
        t0 = time.perf_counter()
        ops.decode_attention(q, k, v, start, slot + 1, 0.125).numpy()
        attn_s += time.perf_counter() - t0
    return {"attention_s": attn_s, "copy_s": copy_s, "total_s": attn_s + copy_s, "copied_slots": copied,
            "peak_slots": peak}


def paged(lengths, prompt, kv, dim, heads, block):
    lengths = np.asarray(lengths)
    total_blocks = int(sum(-(-(prompt + int(n)) // block) for n in lengths))
    pool_k = paddle.randn([total_blocks, kv, block, dim])
    pool_v = paddle.randn([total_blocks, kv, block, dim])
    tables, used = [], 0
    for n in lengths:
        count = -(-(prompt + int(n)) // block)
        tables.append(np.arange(used, used + count))
        used += count
    gather_s = attn_s = 0.0
    gathered = 0
    peak = 0
    for t, alive in enumerate(timeline(lengths, prompt)):
        slot = prompt + t
        nblocks = slot // block + 1
        peak = max(peak, len(alive) * nblocks * block)  # blocks allocated as rows grow: the live ones
        index = paddle.to_tensor(np.stack([tables[r][:nblocks] for r in alive]).reshape(-1))
        q = paddle.randn([len(alive), 1, heads, dim])
        t0 = time.perf_counter()
        k = paddle.gather(pool_k, index).reshape([len(alive), nblocks, kv, block, dim]).transpose(
            [0, 2, 1, 3, 4]).reshape([len(alive), kv, nblocks * block, dim])
        v = paddle.gather(pool_v, index).reshape([len(alive), nblocks, kv, block, dim]).transpose(
            [0, 2, 1, 3, 4]).reshape([len(alive), kv, nblocks * block, dim])
        gather_s += time.perf_counter() - t0
        gathered += 2 * len(alive) * nblocks * block
        t0 = time.perf_counter()
        ops.decode_attention(q, k, v, paddle.zeros([len(alive)], dtype="int64"), slot + 1, 0.125).numpy()
        attn_s += time.perf_counter() - t0
    return {"attention_s": attn_s, "gather_s": gather_s, "total_s": attn_s + gather_s, "gathered_slots": gathered,
            "peak_slots": peak}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    paddle.seed(0)
    lengths = long_tail_lengths(args.rows)
    shape = (args.prompt, args.kv_heads, args.head_dim, args.heads)
    result = {"generated_tokens": int(sum(lengths)), "longest": int(max(lengths)), "custom_ops": ops.available(),
              "contiguous": contiguous(lengths, *shape), "paged": paged(lengths, *shape, args.block)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

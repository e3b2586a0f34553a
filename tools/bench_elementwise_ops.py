"""Time per call of the element-wise CPU kernels (rms_norm, swiglu, masked_softmax, the log-prob chunk, sampling,
decode and packed attention) on the quickstart's shapes (the tiny_arith model: hidden 128, ffn 344, vocab 300, 256
rows) and SmolLM2-135M's (W3: hidden 576, ffn 1536, vocab 49152, 8192 tokens), plus one-row calls (the per-call
overhead).

    python tools/bench_elementwise_ops.py                      # the library of the current sources
    python tools/bench_elementwise_ops.py --library old.so --library new.so --rounds 3

With several --library, each round runs every library once in a child process of its own (the ops of two builds
cannot be registered in one process), alternated, so that the shared machine's load drifts alike for each; per op
the fastest over rounds (each the fastest of 5 batches of calls: other work on a shared machine only ever adds
time), and the speed-up of each library over the first. A library is a paddle_rl_ops.so (e.g. a
copy of an earlier build from the ops cache). Forward: the op alone under no_grad; "+bwd": the op and the
backward of its output. The last line is one JSON object.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads, training_heap  # noqa: E402

configure_threads()

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_rl import ops  # noqa: E402
from paddle_rl.models.packing import Packing  # noqa: E402
from paddle_rl.ops import build  # noqa: E402

SHAPES = {
    "quickstart": dict(rows=256, hidden=128, ffn=344, vocab=300, heads=4, kv=2, head_dim=32, seqs=8, seq_len=32,
                       batch=64, packed_seqs=8, groups=(8, 23, 34)),
    # (the attention cases take 16 sequences of 512 tokens, 8192 in all; the packed one 4 of them: the same cost per
    # token, a quarter of the seconds)
    "w3": dict(rows=8192, hidden=576, ffn=1536, vocab=49152, heads=9, kv=3, head_dim=64, seqs=16, seq_len=512,
               batch=16, packed_seqs=4, groups=(8, 32, 128)),
}
# groups: (prompts, prompt tokens, response tokens) of a packed micro-batch as GRPO makes it (models/packing.py):
# each prompt once, then its 8 responses (the quickstart's micro-batch: 64 rows of 23-token prompts and responses of
# ~34 tokens; W3's step: 8 prompts of ~32 and 64 responses of 128)


def timed(fn, min_seconds: float, batches: int = 5) -> float:
    """Seconds per call: the fastest of `batches` batches of calls (each at least min_seconds / batches long), after
    an untimed call. The fastest, not the median: other work on a shared machine only ever adds time."""
    fn()
    best = float("inf")
    for _ in range(batches):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / batches:
                break
        best = min(best, elapsed / calls)
    return best


def cases(shape: dict):
    """(name, elements, function) of each timed call."""
    rng = np.random.default_rng(0)

    def t(*dims, grad=False, scale=1.0):
        x = paddle.to_tensor((rng.standard_normal(dims) * scale).astype("float32"))
        x.stop_gradient = not grad
        return x

    def with_backward(op, *args):
        def fn():
            y = op(*args)
            y.backward(paddle.ones_like(y))
            for a in args:   # every input that took a gradient, so none accumulates over the calls
                if isinstance(a, paddle.Tensor) and not a.stop_gradient:
                    a.clear_gradient()
        return fn

    def no_grad(op, *args):
        def fn():
            with paddle.no_grad():
                op(*args)
        return fn

    rows, hidden, ffn, vocab = shape["rows"], shape["hidden"], shape["ffn"], shape["vocab"]
    heads, kv, d, seqs, seq_len, batch = (shape[k] for k in ("heads", "kv", "head_dim", "seqs", "seq_len", "batch"))
    x, w = t(rows, hidden, grad=True), t(hidden)
    yield "rms_norm", rows * hidden, no_grad(ops.rms_norm_fused, x, w, 1e-6)
    yield "rms_norm+bwd", rows * hidden, with_backward(ops.rms_norm_fused, x, w, 1e-6)
    g = t(rows, 2 * ffn, grad=True, scale=3.0)
    yield "swiglu", rows * 2 * ffn, no_grad(ops.swiglu_fused, g)
    yield "swiglu+bwd", rows * 2 * ffn, with_backward(ops.swiglu_fused, g)
    # the padded path's scores: [seqs, kv, groups * L, L] with a causal bias
    scores = t(seqs, kv, heads // kv * seq_len, seq_len, grad=True)
    causal = np.triu(np.full((seq_len, seq_len), -1e9, dtype="float32"), 1)
    bias = paddle.to_tensor(np.broadcast_to(causal, (seqs, 1, seq_len, seq_len)).copy())
    yield "masked_softmax", scores.numel().item(), no_grad(ops.masked_softmax_fused, scores, bias, 0.125)
    yield "masked_softmax+bwd", scores.numel().item(), with_backward(ops.masked_softmax_fused, scores, bias, 0.125)
    # one chunk of the LM head's log-probs (CHUNK_ELEMENTS logits at most)
    chunk = max(1, min(rows, (1 << 24) // vocab))
    logits = t(chunk, vocab, scale=4.0)
    labels = paddle.to_tensor(rng.integers(0, vocab, chunk).astype("int64"))
    fwd = ops.logprob.chunk_forward_fused
    yield "logprob", chunk * vocab, no_grad(fwd, logits, labels, 1.0)
    _, _, lse, mean_z = fwd(logits, labels, 1.0)
    ones = paddle.ones([chunk], "float32")
    yield "logprob_bwd", chunk * vocab, no_grad(ops.logprob.chunk_backward_fused, logits, labels, lse, mean_z, ones,
                                                ones, 1.0)
    # one decode step's sampling and attention
    step_logits = t(batch, vocab, scale=4.0)
    uniforms = paddle.to_tensor(rng.random(batch).astype("float32"))
    yield "sample", batch * vocab, no_grad(lambda: ops.sample_fused(step_logits, uniforms, temperature=1.0))
    yield "sample_top_p", batch * vocab, no_grad(lambda: ops.sample_fused(step_logits, uniforms, temperature=1.0,
                                                                          top_p=0.9))
    cap = seq_len * 2
    q = t(batch, 1, heads, d)
    cache_k, cache_v = t(batch, kv, cap, d), t(batch, kv, cap, d)
    start = paddle.zeros([batch], "int64")
    yield "decode_attention", batch * heads * cap * d, no_grad(ops.decode_attention_fused, q, cache_k, cache_v, start,
                                                               cap, d ** -0.5)
    # a packed row of packed_seqs sequences of seq_len tokens
    n = shape["packed_seqs"] * seq_len
    spans = np.zeros((n, 4), dtype="int64")
    for s in range(shape["packed_seqs"]):
        spans[s * seq_len:(s + 1) * seq_len, 2] = s * seq_len
        spans[s * seq_len:(s + 1) * seq_len, 3] = (s + 1) * seq_len
    spans = paddle.to_tensor(spans)
    pq, pk, pv = t(n, heads, d, grad=True), t(n, kv, d, grad=True), t(n, kv, d, grad=True)
    elements = n * heads * seq_len
    yield "packed_attention", elements, no_grad(ops.packed_attention_fused, pq, pk, pv, spans, d ** -0.5)
    yield "packed_attention+bwd", elements, with_backward(ops.packed_attention_fused, pq, pk, pv, spans, d ** -0.5)
    # a packed micro-batch of prompts shared by 8 responses each
    prompts, prompt_len, response_len = shape["groups"]
    group = Packing([list(range(1, prompt_len + 1))] * prompts, np.repeat(np.arange(prompts), 8),
                    np.ones((prompts * 8, response_len + 1), dtype="int64"), np.full(prompts * 8, response_len))
    n = group.tokens
    gq, gk, gv = t(n, heads, d, grad=True), t(n, kv, d, grad=True), t(n, kv, d, grad=True)
    elements = prompts * heads * (prompt_len * (prompt_len + 1) // 2
                                  + 8 * (response_len * prompt_len + response_len * (response_len + 1) // 2))
    yield "packed_groups", elements, no_grad(ops.packed_attention_fused, gq, gk, gv, group.spans, d ** -0.5)
    yield "packed_groups+bwd", elements, with_backward(ops.packed_attention_fused, gq, gk, gv, group.spans,
                                                       d ** -0.5)
    # one row: the per-call overhead
    x1, g1 = t(1, hidden, grad=True), t(1, 2 * ffn, grad=True)
    yield "rms_norm[1]", hidden, no_grad(ops.rms_norm_fused, x1, w, 1e-6)
    yield "rms_norm[1]+bwd", hidden, with_backward(ops.rms_norm_fused, x1, w, 1e-6)
    yield "swiglu[1]", 2 * ffn, no_grad(ops.swiglu_fused, g1)
    yield "swiglu[1]+bwd", 2 * ffn, with_backward(ops.swiglu_fused, g1)


def child(args) -> dict:
    if args.library:
        names = build._register(args.library[0])
        build._State.library, build._State.ops, build._State.loaded = args.library[0], tuple(names), True
    else:
        ops.configure("on")
    result = {}
    with training_heap():  # freed blocks stay in the heap, as in training (no page faults on each new output)
        for shape_name in args.shapes.split(","):
            for name, elements, fn in cases(SHAPES[shape_name]):
                seconds = timed(fn, args.min_seconds)
                result[f"{shape_name}/{name}"] = {"us": seconds * 1e6, "ns_per_element": seconds * 1e9 / elements}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--library", action="append", default=[], help="a paddle_rl_ops.so (repeat to compare)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", default="quickstart,w3")
    p.add_argument("--min-seconds", type=float, default=0.3, help="timed seconds per op and round")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    libraries = args.library or [""]
    runs = {lib: [] for lib in libraries}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for lib in libraries:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", args.shapes,
                   "--min-seconds", str(args.min_seconds)] + (["--library", lib] if lib else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[lib].append(json.loads(out.strip().splitlines()[-1]))
        loads.append(os.getloadavg()[0])
    table = {}
    for key in runs[libraries[0]][0]:
        row = {}
        for i, lib in enumerate(libraries):
            us = min(r[key]["us"] for r in runs[lib])
            ns = min(r[key]["ns_per_element"] for r in runs[lib])
            row[f"lib{i}"] = {"us": round(us, 2), "ns_per_element": round(ns, 3)}
        table[key] = row
        line = f"{key:36s}" + "".join(f"  {row[f'lib{i}']['us']:11.1f} us {row[f'lib{i}']['ns_per_element']:8.3f} ns/el"
                                      for i in range(len(libraries)))
        if len(libraries) > 1:
            line += "".join(f"  x{row['lib0']['us'] / row[f'lib{i}']['us']:5.2f}" for i in range(1, len(libraries)))
        print(line, flush=True)
    print(json.dumps({"libraries": libraries, "rounds": args.rounds, "load": loads, "ops": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

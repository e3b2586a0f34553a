"""Each fused-kernel switch on against off in one process, alternated: the update pass of one micro-batch (the
log-prob forward, the loss and its backward) on W1's or SmolLM2-135M's shapes at random init, padded (the shared
prompt prefix, as `paddle-rl bench` trains W1) or packed (use_remove_padding, as W3).

    python tools/bench_kernel_switches.py --model w1 --rows 64 --prompt-len 32 --response-len 64 --rounds 5
    python tools/bench_kernel_switches.py --model smollm2-135m --rows 16 --response-len 128 --packed --rounds 3

For every switch, rounds of (on, off) in turn after one untimed pass of each (a shared machine's load drifts
between separate runs; alternating in one process sees the same drift on both sides): the median seconds of each
side, and the peak of the bytes Paddle's CPU allocator handed to live tensors during the pass (reset before each
pass; what the switch changes in what the pass holds, exact and independent of the load). The last line is one JSON
object.
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
from paddle_rl.bench import MODELS  # noqa: E402
from paddle_rl.models import CausalLM, ModelConfig  # noqa: E402
from paddle_rl.models.logprobs import packed_token_logprobs, token_logprobs  # noqa: E402
from paddle_rl.models.packing import Packing  # noqa: E402

SWITCHES = ("attention", "rms_norm", "rope", "head", "linear")


def build(args):
    paddle.seed(0)
    shape = dict(MODELS[args.model])
    model = CausalLM(ModelConfig(model_type="qwen2", **shape))
    model.init_weights(0.02)
    model.train()
    rng = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    groups = max(1, args.rows // args.rollout_n)
    prompts = [list(rng.integers(1, vocab, args.prompt_len)) for _ in range(groups)]
    rows = np.repeat(np.arange(groups), args.rollout_n)
    responses = rng.integers(1, vocab, (len(rows), args.response_len))
    if args.packed:
        packing = Packing(prompts, rows, responses, np.full(len(rows), args.response_len))

        def loss():
            logp, entropy = packed_token_logprobs(model, packing, 1.0, with_entropy=True)
            return -(logp.mean() + 0.01 * entropy.mean())
        return model, loss
    ids = paddle.to_tensor(np.concatenate([np.asarray(prompts)[rows], responses], axis=1))
    mask = paddle.ones_like(ids)
    first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    shared = (paddle.to_tensor(first), paddle.to_tensor(rows))
    response = ids[:, args.prompt_len:]

    def loss():
        logp, entropy = token_logprobs(model, ids, mask, args.prompt_len, response, 1.0, with_entropy=True,
                                       shared_prompts=shared)
        return -(logp.mean() + 0.01 * entropy.mean())
    return model, loss


def one_pass(model, loss, settings) -> tuple:
    core = paddle.base.core
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    base = core.host_memory_stat_current_value("Allocated", 0) / 2**20
    start = time.perf_counter()
    with ops.kernels_selected(**settings):
        loss().backward()
    seconds = time.perf_counter() - start
    peak = core.host_memory_stat_peak_value("Allocated", 0) / 2**20 - base
    model.clear_gradients()
    return seconds, peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="w1")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--rollout-n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--packed", action="store_true", help="one packed row (use_remove_padding) instead of padded rows")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--switches", default=",".join(SWITCHES))
    args = p.parse_args(argv)
    ops.configure("on")
    model, loss = build(args)
    result = {"model": args.model, "rows": args.rows, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "packed": args.packed, "rounds": args.rounds,
              "load_before": os.getloadavg()[0]}
    for name in args.switches.split(","):
        sides = {True: [], False: []}
        peaks = {}
        for value in (True, False):   # untimed: the first pass of each side
            one_pass(model, loss, {name: value})
        for _ in range(args.rounds):
            for value in (True, False):
                seconds, peak = one_pass(model, loss, {name: value})
                sides[value].append(seconds)
                peaks[value] = max(peaks.get(value, 0.0), peak)
        on, off = float(np.median(sides[True])), float(np.median(sides[False]))
        result[name] = {"on_s": on, "off_s": off, "on_peak_mb": peaks[True], "off_peak_mb": peaks[False]}
        print(f"{ops.switches.KEYS[name]:28s} on {on:7.3f} s  off {off:7.3f} s  (off / on {off / on:5.2f})   "
              f"tensors' peak on {peaks[True]:8.1f} MB  off {peaks[False]:8.1f} MB", flush=True)
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pipeline schedules' bubble, measured: each rank's time inside send / recv over the schedule's wall time, for
plain 1F1B and the interleaved schedule (virtual_pp_degree k) at the same micro-batch counts.

    python -m paddle.distributed.launch --nproc_per_node 2 tools/bench_pipeline.py --out bubble.json

Each rank builds its stage of a random decoder (--layers, --hidden; the same layers for every k), runs
--repeats training schedules (forward and backward of --micro micro-batches of --rows x --tokens tokens, the
loss the mean of the last hidden states) after one untimed, and rank 0 writes one record per (k, micro): the
median over the repeats of each rank's idle fraction (`Link.waited` / the schedule's wall time) and of the wall
time, and each rank's peak RSS so far, beside Narayanan et al.'s (2021) bubble (p - 1) / (m k) of the ideal time,
i.e. an idle fraction of (p - 1) / (m k + p - 1).
"""
import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_rl.models import CausalLM, ModelConfig  # noqa: E402
from paddle_rl.models.decoder import attention_bias_from_mask, position_ids_from_mask  # noqa: E402
from paddle_rl.parallel import collectives as C  # noqa: E402
from paddle_rl.parallel.pipeline import Link, train_1f1b, train_interleaved  # noqa: E402
from paddle_rl.parallel.topology import build_topology, world_size_from_env  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per row")
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches per schedule")
    ap.add_argument("--virtual", type=int, nargs="+", default=[1, 2, 4], help="chunks per stage (1: plain 1F1B)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="", help="JSON file for rank 0's records")
    return ap.parse_args(argv)


def one_schedule(link, model, virtual, micro, ids, pos, bias, threaded=True):
    """Wall seconds of one training schedule and the seconds this rank's computations waited for transfers.
    `threaded` False with one chunk: train_1f1b (transfers in the computing thread, as the layout runs it)."""
    last_chunk = virtual - 1

    def forward(chunk, i, x):
        first = model.is_first and chunk in (None, 0)
        y = model.hidden_states(ids[i] if first else x, pos, bias, chunk=chunk)
        return y.mean() if model.is_last and chunk in (None, last_chunk) else y

    shape = lambda i: [*ids[i].shape, model.config.hidden_size]
    link.waited = 0.0
    C.barrier()
    start = time.perf_counter()
    if virtual == 1 and not threaded:
        train_1f1b(link, micro, lambda i, x: forward(None, i, x), shape)
    else:
        train_interleaved(link, virtual, micro, forward, shape)
    wall = time.perf_counter() - start
    model.clear_gradients()
    return wall, link.waited


def main(argv=None):
    args = parse(argv)
    topo = build_topology(pipe=world_size_from_env())
    stages = topo.pp_degree
    config = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2)
    rng = np.random.default_rng(0)
    ids = [paddle.to_tensor(rng.integers(0, 512, size=[args.rows, args.tokens]), dtype="int64")
           for _ in range(max(args.micro))]
    mask = paddle.ones([args.rows, args.tokens], dtype="int64")
    pos, bias = position_ids_from_mask(mask), attention_bias_from_mask(mask, args.tokens, causal=True)
    link = Link(topo)
    records = []
    cases = [(1, False)] * (1 in args.virtual) + [(k, True) for k in args.virtual]
    for virtual, threaded in cases:
        paddle.seed(1)
        model = CausalLM(config, None, (topo.pp_rank, stages, virtual))
        model.init_weights()
        model.train()
        for micro in args.micro:
            one_schedule(link, model, virtual, micro, ids, pos, bias, threaded)  # untimed: allocations, first kernels
            runs = [one_schedule(link, model, virtual, micro, ids, pos, bias, threaded) for _ in range(args.repeats)]
            idle = float(np.median([w / t for t, w in runs]))
            wall = float(np.median([t for t, _ in runs]))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB (Linux: KiB)
            per_rank = C.gather_objects((idle, wall, peak), topo.group("pp"))
            name = "interleaved" if virtual > 1 else "1f1b, transfer thread" if threaded else "1f1b (train_1f1b)"
            records.append({"schedule": name, "stages": stages, "virtual": virtual, "micro": micro,
                            "idle_per_rank": [r[0] for r in per_rank], "wall_s": max(r[1] for r in per_rank),
                            "peak_rss_mb_per_rank": [round(r[2]) for r in per_rank],
                            "literature_bubble": (stages - 1) / (micro * virtual),
                            "literature_idle": (stages - 1) / (micro * virtual + stages - 1)})
            if topo.rank == 0:
                r = records[-1]
                idle_text = [round(x, 3) for x in r["idle_per_rank"]]
                print(f"{name}: p {stages} k {virtual} m {micro}: idle per rank {idle_text} "
                      f"(literature {r['literature_idle']:.3f}), schedule {r['wall_s']:.3f} s", flush=True)
    if topo.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "records": records}, f, indent=1)
    C.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

"""Activation memory per rank of context parallelism (Ulysses, `context_parallel_degree`) against no split
(docs/parallelism.md).

    python -m paddle.distributed.launch --nproc_per_node 2 tools/context_parallel_memory.py [--hidden 512 ...]

Each rank builds the same random Qwen2-style model and runs one training pass (forward, loss, backward) of a packed
micro-batch (`use_remove_padding`: one prompt and its responses, 4,096 tokens by default) twice: the whole
micro-batch on the rank (what one process runs), then split over the context group of all the ranks. Measured per
rank: the bytes of the activations autograd keeps for the backward (saved tensors, each storage counted once, the
parameters left out), and the peak of the bytes Paddle's CPU allocator handed to live tensors during the forward and
backward above what was live before (parameters, their gradients from an earlier pass and the inputs excluded). Rank
0 prints a table and, with --json, writes the numbers.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

import paddle  # noqa: E402

from paddle_rl.models import CausalLM, ModelConfig  # noqa: E402
from paddle_rl.models.logprobs import packed_token_logprobs  # noqa: E402
from paddle_rl.models.pretrained import hf_state, load_weights  # noqa: E402
from paddle_rl.parallel.collectives import barrier, gather_objects  # noqa: E402
from paddle_rl.parallel.topology import build_topology  # noqa: E402
from sequence_parallel_memory import packed_batch, saved_bytes  # noqa: E402


def measure(config: ModelConfig, packing, group, state) -> tuple:
    """(saved activation bytes, peak allocated bytes above the start, seconds, loss) of one training pass on this
    rank; `group` None: the whole micro-batch, else split over it."""
    core = paddle.base.core
    model = CausalLM(config)
    load_weights(model, state)
    model.set_context_parallel(group)
    model.train()
    for _ in range(2):  # the second pass is measured: the gradients' buffers exist from the first
        model.clear_gradients(set_to_zero=True)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        base = core.host_memory_stat_current_value("Allocated", 0)
        start = time.perf_counter()
        saved, (logp, entropy) = saved_bytes(lambda: packed_token_logprobs(model, packing, 1.0, True),
                                             model.parameters())
        loss = -(logp.mean() + 0.01 * entropy.mean())
        loss.backward()
        seconds = time.perf_counter() - start
        peak = core.host_memory_stat_peak_value("Allocated", 0) - base
        del logp, entropy
    return saved, int(peak), seconds, float(loss)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--response-len", type=int, default=896)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    topo = build_topology(context=int(os.environ.get("PADDLE_TRAINERS_NUM", "2")))
    group = topo.group("cp")
    config = ModelConfig(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    paddle.seed(1)
    whole = CausalLM(config)
    whole.init_weights()
    state = hf_state(whole)
    del whole
    packing = packed_batch(args.vocab, args.prompt, args.responses, args.response_len)
    rows = {}
    for name, split in (("no split", None), (f"context {topo.cp_degree}", group)):
        rows[name] = gather_objects(measure(config, packing, split, state), group)
        barrier()
    if topo.rank == 0:
        print(f"{packing.tokens} packed tokens; hidden {args.hidden}, intermediate {args.intermediate}, heads "
              f"{args.heads}/{args.kv_heads}, {args.layers} layers, vocabulary {args.vocab}")
        print("| layout | saved activations per rank (MiB) | peak of live tensors per rank, forward + backward (MiB) "
              "| seconds per rank | loss |")
        print("|---|---|---|---|---|")
        for name, ranks in rows.items():
            cells = [", ".join(f"{r[0] / 2**20:.1f}" for r in ranks), ", ".join(f"{r[1] / 2**20:.1f}" for r in ranks),
                     ", ".join(f"{r[2]:.2f}" for r in ranks)]
            print(f"| {name} | {' | '.join(cells)} | {ranks[0][3]:.6f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tokens": packing.tokens, "args": vars(args), "rows": rows}, f)
    barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

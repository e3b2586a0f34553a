"""Activation memory per rank of tensor parallelism with and without sequence parallelism (docs/parallelism.md).

    python -m paddle.distributed.launch --nproc_per_node 2 tools/sequence_parallel_memory.py [--hidden 512 ...]

Each rank builds the same random Qwen2-style model (tensor degree 2) and runs one training forward of a packed
micro-batch (`use_remove_padding`: the CPU attention kernel keeps no probabilities) of one prompt and its
responses, twice: tensor parallel alone, then with `sequence_parallel`; the decoder's layers alone, then the whole
log-prob pass (with the vocabulary-parallel LM head). Measured per rank while the graph is alive: the bytes of the
activations autograd keeps for the backward (saved tensors, each storage counted once, the parameters left out)
and the growth of the process's resident memory over the forward (RSS, from /proc/self/statm; allocator caching
makes it a rougher figure). Rank 0 prints a table and, with --json, writes the numbers.
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

import paddle  # noqa: E402

from paddle_rl.models import CausalLM, ModelConfig  # noqa: E402
from paddle_rl.models.logprobs import packed_token_logprobs  # noqa: E402
from paddle_rl.models.packing import Packing  # noqa: E402
from paddle_rl.models.pretrained import hf_state, load_weights  # noqa: E402
from paddle_rl.parallel.collectives import barrier, gather_objects  # noqa: E402
from paddle_rl.parallel.topology import build_topology  # noqa: E402


def saved_bytes(forward, params=()):
    """(bytes, output): the bytes of the activations autograd keeps for the backward of `forward()` (each storage
    once; the parameters in `params`, which products keep too, left out), the graph alive."""
    weights = {p.data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.data_ptr() not in weights:
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), int(np.prod(t.shape)) * t.element_size())
        return t

    with paddle.autograd.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return int(sum(seen.values())), out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed_batch(vocab: int, prompt: int, responses: int, length: int, seed: int = 0) -> Packing:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (responses, length + 1))
    return Packing([list(rng.integers(3, vocab, prompt))], [0] * responses, ids, np.full(responses, length + 1))


def measure(config: ModelConfig, packing: Packing, group, sequence_parallel: bool, state=None):
    """(saved bytes of the decoder's layers, saved bytes of the whole pass, its RSS growth, the sum of its log-probs)
    of training forwards on this rank: the decoder alone (packed_hidden_states: embedding, layers, final norm), then
    the whole log-prob pass (the LM head and log-probs of the response tokens too)."""
    model = CausalLM(config, group)
    load_weights(model, state)
    model.sequence_parallel = sequence_parallel
    model.train()
    body, hidden = saved_bytes(lambda: model.packed_hidden_states(packing), model.parameters())
    del hidden
    before = rss_bytes()
    saved, (logp, _) = saved_bytes(lambda: packed_token_logprobs(model, packing, 1.0, False), model.parameters())
    grown = rss_bytes() - before
    loss = float(logp.sum())
    del logp
    return body, saved, grown, loss


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
    topo = build_topology(tensor=2, sequence_parallel=True)
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
    for name, sp in (("tensor 2", False), ("tensor 2 + sequence parallel", True)):
        rows[name] = gather_objects(measure(config, packing, topo.group("tp"), sp, state), topo.group("tp"))
        barrier()
    if topo.rank == 0:
        print(f"{packing.tokens} packed tokens; hidden {args.hidden}, intermediate {args.intermediate}, heads "
              f"{args.heads}/{args.kv_heads}, {args.layers} layers, vocabulary {args.vocab}")
        print("| layout | saved activations per rank, decoder (MiB) | the same, whole log-prob pass (MiB) | RSS growth "
              "per rank, whole pass (MiB) | sum of log-probs |")
        print("|---|---|---|---|---|")
        for name, ranks in rows.items():
            cells = [", ".join(f"{r[i] / 2**20:.1f}" for r in ranks) for i in range(3)]
            print(f"| {name} | {' | '.join(cells)} | {ranks[0][3]:.4f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tokens": packing.tokens, "args": vars(args), "rows": rows}, f)
    barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

"""Sequence parallelism (`sequence_parallel: true`, Megatron's) on tensor parallelism 2, 2 real processes (gloo).

One launch; each rank builds the micro model three times from the same weights: whole (one process's model, run
on the rank itself), tensor parallel, tensor parallel + sequence parallel. Both parallel models run the same
micro-batches as the whole one, padded (the shared-prompt passes) and packed, with token counts the degree does not
divide (the split pads them), through a loss of log-probs and entropy and its backward; GradientSync sums the
norms' gradients over the tensor group as training does. Compared: log-probs, entropy, loss, every gradient
(gathered), and one SGD update of the weights; also with LoRA adapters, Qwen3's q/k norms (their gradients summed
over the tensor group, with or without sequence parallelism), whole layers recomputed, and bf16 products
recomputing each attention block (against tensor parallelism alone there). The same run with the collectives
perturbed must lose parity:
  - the reduce-scatter replaced by the tensor-parallel all-reduce and a slice of this rank's tokens (the
    all-reduce's identity backward then hands each rank's partial products the gradient of its own tokens only);
  - the reduce-scatter without its sum (each rank keeps its own tokens of its partial products);
  - the column layers' all-gather with its backward's reduce-scatter dropped (own tokens of a partial gradient);
  - the norms' gradient sum over the tensor group dropped.
Activation memory: the bytes autograd keeps for the backward (saved tensors, counted once per storage, parameters
left out) of a packed decoder pass per rank, sequence parallel against tensor parallel alone
(tools/sequence_parallel_memory.py).
The run of the trainer (three RL steps, weights and losses) is in tests/test_parallel.py.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_parallel import ROOT, launch  # noqa: E402

TOL = 2e-5          # relative, per tensor (||a - b|| / ||a||): float32 sums in another order
BROKEN = 1e-3       # a perturbed run differs by more than this somewhere


def test_sequence_parallel_equals_one_process(micro, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    launch([os.path.abspath(__file__), "--worker", micro["model"], str(out)], str(tmp_path / "log"), timeout=300)
    result = json.load(open(out / "rank0.json"))
    rank1 = json.load(open(out / "rank1.json"))
    for case in ("padded", "packed", "lora", "qwen3", "recompute full", "bf16 core_attn_mlp"):
        for layout in result[case]:
            errors = result[case][layout]
            worst = max(errors, key=errors.get)
            print(f"{case} {layout}: max rel err {errors[worst]:.2e} ({worst}) over {len(errors)} values")
            assert errors[worst] <= TOL, (case, layout, worst, errors[worst])
    for name, errors in result["perturbed"].items():
        worst = max(errors, key=errors.get)
        print(f"perturbed ({name}): max rel err {errors[worst]:.2e} ({worst})")
        assert errors[worst] > BROKEN, name
    memory = {layout: [result["memory"][layout], rank1["memory"][layout]] for layout in ("tp", "sp")}
    print(f"saved activations per rank, {result['memory']['tokens']} tokens: tensor 2 {memory['tp']} bytes, "
          f"+ sequence parallel {memory['sp']} bytes")
    for rank in range(2):
        assert memory["sp"][rank] < 0.8 * memory["tp"][rank]


def test_sequence_parallel_needs_tensor_parallelism():
    from paddle_rl.config import ConfigError, load_config
    from paddle_rl.parallel.topology import TopologyError, build_topology
    for keys, says in ((["sequence_parallel=true"], "needs tensor_parallel_degree > 1"),
                       (["sequence_parallel=true", "tensor_parallel_degree=2", "pipeline_parallel_degree=2"],
                        "with pipeline_parallel_degree 2 is not implemented")):
        with pytest.raises(ConfigError, match=f"sequence_parallel: true {says}"):
            load_config(None, ["actor_model_name_or_path=x", *keys])
    with pytest.raises(TopologyError, match="sequence_parallel: true needs tensor_parallel_degree > 1"):
        build_topology(sequence_parallel=True)
    from paddle_rl.config.parallel_args import ParallelArgs
    from paddle_rl.config.fields import ACTED
    assert ParallelArgs.__dataclass_fields__["sequence_parallel"].metadata[ACTED]


# --------------------------------------------------------------------------------------------- worker

def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


def _inputs(rng, vocab):
    """Two prompts (5 and 8 tokens) with two responses each (8 columns, 8 / 5 / 3 / 5 real tokens): the padded
    passes run 8 prompt columns and 7 response columns (odd: the split pads it), the packed one 5 + 8 + 7 + 5 + 3 +
    5 = 33 tokens (odd)."""
    prompts = [list(rng.integers(3, vocab, 5)), list(rng.integers(3, vocab, 8))]
    rows = [0, 0, 1, 1]
    lengths = np.array([8, 5, 3, 5])
    response = rng.integers(3, vocab, (4, 8))
    mask = (np.arange(8)[None] < lengths[:, None]).astype(np.float32)
    response = np.where(mask > 0, response, 0)
    weight = rng.normal(size=(4, 8)).astype(np.float32)
    return prompts, rows, lengths, response, mask, weight


def _padded(model, data):
    import paddle
    from paddle_rl.models.logprobs import token_logprobs
    prompts, rows, lengths, response, mask, _ = data
    width = max(len(p) for p in prompts)
    prompt_ids = np.array([[0] * (width - len(prompts[r])) + prompts[r] for r in rows])
    prompt_mask = np.array([[0] * (width - len(prompts[r])) + [1] * len(prompts[r]) for r in rows])
    ids = paddle.to_tensor(np.concatenate([prompt_ids, response], 1).astype(np.int64))
    attention = paddle.to_tensor(np.concatenate([prompt_mask, mask.astype(np.int64)], 1).astype(np.int64))
    shared = (paddle.to_tensor(np.array([0, 2], np.int64)), paddle.to_tensor(np.array(rows, np.int64)))
    return token_logprobs(model, ids, attention, width, paddle.to_tensor(response.astype(np.int64)), 1.0, True,
                          shared)


def _packed(model, data):
    from paddle_rl.models.logprobs import packed_token_logprobs
    from paddle_rl.models.packing import Packing
    prompts, rows, lengths, response, _, _ = data
    return packed_token_logprobs(model, Packing(prompts, rows, response, lengths), 1.0, True)


def _run(model, data, forward, topo, lr=0.1):
    """Loss, backward, the tensor group's gradient sums (GradientSync, as training), one SGD step: log-probs,
    entropy, loss, gradients and updated weights, all gathered whole (numpy, by Hugging Face-free names)."""
    import paddle
    from paddle_rl.parallel.collectives import gather_objects
    from paddle_rl.parallel.sharding import GradientSync
    mask, weight = paddle.to_tensor(data[4]), paddle.to_tensor(data[5])
    logp, entropy = forward(model, data)
    loss = (logp * mask * weight).sum() / mask.sum() + 0.1 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    GradientSync(topo, model.parameters(), model.tensor_partial_parameters()).sync()
    out = {"logp": logp.numpy() * data[4], "entropy": entropy.numpy() * data[4], "loss": float(loss)}
    group = model.tp_group
    for name, param in model.named_parameters():
        if param.stop_gradient:
            continue
        grad, value = param.grad.numpy(), param.numpy() - lr * param.grad.numpy()
        if group is not None:
            grads, values = gather_objects(grad, group), gather_objects(value, group)
            if param.spec.axis is None:  # replicated: every rank must hold the same gradient
                out[f"{name}/rank-spread"] = max(_rel(grads[0], g) for g in grads)
            grad, value = param.spec.unshard(grads), param.spec.unshard(values)
        out[f"{name}/grad"], out[f"{name}/updated"] = grad, value
    return out


def _errors(ref, got):
    errors = {}
    for key, value in got.items():
        if key.endswith("/rank-spread"):
            errors[key] = value
        elif key == "loss":
            errors[key] = abs(value - ref[key]) / max(abs(ref[key]), 1e-2)
        else:
            errors[key] = _rel(ref[key], value)
    return errors


def _models(folder, group, lora=None):
    from paddle_rl.models import load_model
    whole = load_model(folder, lora=lora)
    tp = load_model(folder, tp_group=group, lora=lora)
    sp = load_model(folder, tp_group=group, lora=lora)
    sp.sequence_parallel = True
    if lora is not None:  # B away from zero (same values everywhere), so every adapter tensor takes a gradient
        full = {n: p.numpy() for n, p in whole.named_parameters()}
        rng = np.random.default_rng(7)
        for name, param in whole.named_parameters():
            if "lora_B" in name:
                full[name] = rng.normal(0, 0.1, param.shape).astype(np.float32)
                param.set_value(full[name])
        for model in (tp, sp):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.set_value(param.spec.shard(full[name], group.rank, group.nranks))
    return whole, tp, sp


def _worker(folder, out_dir):
    from paddle_rl.env import configure_threads
    configure_threads()
    import paddle
    from paddle_rl.models.lora import LoraSettings
    from paddle_rl.parallel import collectives
    from paddle_rl.parallel.topology import build_topology
    topo = build_topology(tensor=2, sequence_parallel=True)
    group = topo.group("tp")
    data = _inputs(np.random.default_rng(11), 400)
    from paddle_rl.models import CausalLM, ModelConfig
    from paddle_rl.models.pretrained import hf_state, save_model
    from sequence_parallel_memory import measure, packed_batch
    result = {}
    for case, forward, lora in (("padded", _padded, None), ("packed", _packed, None),
                                ("lora", _padded, LoraSettings(rank=4, alpha=8.0))):
        whole, tp, sp = _models(folder, group, lora)
        ref = _run(whole, data, forward, topo)
        result[case] = {"tp": _errors(ref, _run(tp, data, forward, topo)),
                        "sp": _errors(ref, _run(sp, data, forward, topo))}
        if case == "padded":
            reference = ref
    # Qwen3's q/k norms: each rank normalizes its own heads, so their gradients are summed over the tensor group
    # (with or without sequence parallelism)
    qwen3 = ModelConfig(model_type="qwen3", vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    paddle.seed(2)
    model = CausalLM(qwen3)
    model.init_weights()
    for name, param in model.named_parameters():
        if "norm" in name:  # away from 1, so that every norm's gradient depends on its weight
            param.set_value(paddle.normal(1.0, 0.3, param.shape))
    qwen3_folder = os.path.join(out_dir, f"qwen3-rank{topo.rank}")
    save_model(model, qwen3_folder)
    whole, tp, sp = _models(qwen3_folder, group)
    ref = _run(whole, data, _padded, topo)
    result["qwen3"] = {name: _errors(ref, _run(model, data, _padded, topo)) for name, model in (("tp", tp), ("sp", sp))}
    # recompute: whole layers (float32, against one process), and bf16 products with core_attn_mlp (each attention
    # block recomputed from its input's bfloat16 rounding, collectives inside; against tensor parallelism alone,
    # as bf16 against one process differs at bf16's rounding)
    for case, bf16, recompute in (("recompute full", False, "full"), ("bf16 core_attn_mlp", True, "core_attn_mlp")):
        models = _models(folder, group)
        for model in models:
            model.recompute = recompute
            model.set_bf16(bf16, bf16)
        outs = [_run(model, data, _padded, topo) for model in models]
        result[case] = {"sp": _errors(outs[1] if bf16 else outs[0], outs[2])}
    # perturbations of the padded case: each must break parity
    perturbed = {}
    split = collectives.TokenSplit
    keep = split.reduce_scatter, split.gather, split.gather_matmul

    def all_reduce(self, x):  # the tensor-parallel all-reduce, then this rank's tokens (its backward: the identity)
        summed = collectives.reduce_from_group(collectives._pad_tokens(x, self.padded), self.group)
        return summed[:, self.rank * self.local:(self.rank + 1) * self.local]

    def without_sum(self, x):  # each rank's own tokens of its partial sums
        return collectives._SplitTokens.apply(x, self)

    def gather_without_sum(self, x):  # all-gather whose backward keeps this rank's tokens of its partial gradient
        return self.whole(x)

    for name, attribute, patch in (("reduce-scatter as an all-reduce", "reduce_scatter", all_reduce),
                                   ("reduce-scatter without its sum", "reduce_scatter", without_sum),
                                   ("all-gather's backward without the reduce-scatter", "gather", gather_without_sum)):
        setattr(split, attribute, patch)
        split.gather_matmul = lambda self, x, w: paddle.matmul(self.gather(x), w)
        _, _, sp = _models(folder, group)
        perturbed[name] = _errors(reference, _run(sp, data, _padded, topo))
        split.reduce_scatter, split.gather, split.gather_matmul = keep
    _, _, sp = _models(folder, group)
    sp.tensor_partial_parameters = lambda: []
    perturbed["norm gradients not summed"] = _errors(reference, _run(sp, data, _padded, topo))
    result["perturbed"] = perturbed
    # activation memory: the decoder's saved activations of one packed micro-batch of 1,200 tokens (a model with
    # hidden 128: the micro model's 32 leaves the norms' share small; docs/parallelism.md has the tool's larger run)
    config = ModelConfig(model_type="qwen2", vocab_size=400, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    paddle.seed(1)
    whole = CausalLM(config)
    whole.init_weights()
    state = hf_state(whole)
    packing = packed_batch(400, 300, 4, 225)
    result["memory"] = {"tokens": packing.tokens}
    for name, sp in (("tp", False), ("sp", True)):
        result["memory"][name] = measure(config, packing, group, sp, state)[0]
    with open(os.path.join(out_dir, f"rank{topo.rank}.json"), "w") as f:
        json.dump(result, f)
    collectives.barrier()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
    _worker(sys.argv[2], sys.argv[3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

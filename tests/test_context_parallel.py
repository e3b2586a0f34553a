"""Context parallelism (`context_parallel_degree`, Ulysses) on 2 real processes (gloo) against one process.

One launch; each rank builds the micro model (4 heads, 2 key/value heads) twice from the same weights: whole (one
process's model, run on the rank itself) and split over the context group of 2. Both run the same micro-batches,
padded (every row's prompt; 207 columns, odd: the split pads them) and packed (a few hundred tokens), through a loss
of log-probs and entropy and its backward; GradientSync sums the gradients over the context group as training does.
Compared: log-probs, entropy, loss, every gradient, one SGD update of the weights (and that both ranks hold the same
gradients); also with LoRA adapters, a Qwen3 model with one key/value head (q/k norms, the key/value head repeated
for the degree), whole layers recomputed (the all-to-alls inside the recomputed layer), the critic's values, and the
no-grad pass's argmax. The same run with the collective perturbed must lose parity:
  - the all-to-all's chunks exchanged in the wrong order (each rank attends over the tokens in another order);
  - the gradients not summed over the context group.
The run of the trainer (dp 1 x cp 2 and dp 2 x cp 1 against one process, three RL steps) is
`test_context_parallel_trainer_equals_one_process`; memory per rank: tools/context_parallel_memory.py
(docs/parallelism.md).
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_parallel import ROOT, check_parity, launch, run_layout, run_overrides, setup, train_and_probe  # noqa: E402,F401

TOL = 2e-5          # relative, per tensor (||a - b|| / ||a||): float32 sums in another order
BROKEN = 1e-3       # a perturbed run differs by more than this somewhere


def _check(result):
    for case, errors in result.items():
        if case in ("perturbed", "greedy"):
            continue
        worst = max(errors, key=errors.get)
        print(f"{case}: max rel err {errors[worst]:.2e} ({worst}) over {len(errors)} values")
        assert errors[worst] <= TOL, (case, worst, errors[worst])
    assert result["greedy"] == 0
    for name, errors in result.get("perturbed", {}).items():
        worst = max(errors, key=errors.get)
        print(f"perturbed ({name}): max rel err {errors[worst]:.2e} ({worst})")
        assert errors[worst] > BROKEN, name


def test_context_parallel_equals_one_process(micro, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    launch([os.path.abspath(__file__), "--worker", micro["model"], str(out), "default"], str(tmp_path / "log"),
           timeout=300)
    for rank in range(2):
        _check(json.load(open(out / f"rank{rank}.json")))


@pytest.mark.slow
def test_context_parallel_4k_tokens_equals_one_process(micro, tmp_path):
    """A packed micro-batch of 4,096 tokens and a padded one of 2 x 2,048 columns."""
    out = tmp_path / "out"
    out.mkdir()
    launch([os.path.abspath(__file__), "--worker", micro["model"], str(out), "long"], str(tmp_path / "log"),
           timeout=900)
    for rank in range(2):
        _check(json.load(open(out / f"rank{rank}.json")))


@pytest.fixture(scope="module")
def single(setup):
    """One process's GRPO run (3 steps) and its greedy tokens, as tests/test_parallel.py's reference."""
    out_dir = str(setup["root"] / "single-grpo")
    os.makedirs(out_dir, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], out_dir, setup["plugin"], rl_algorithm="grpo"), out_dir,
                    setup["prompts"])
    return {"grpo": out_dir}


def test_context_parallel_trainer_equals_one_process(setup, single):
    """context 2 through the trainer (3 RL steps: the rollout on the group's first rank handed to the other, the
    reference and old log-prob passes and the update split over the tokens, gradients summed over the group, AdamW,
    clipping) equals one process: losses, statistics, weights and the greedy tokens after training."""
    out_dir, _ = run_layout(setup, "cp2", context_parallel_degree=2, share_prompt_prefix=False)
    check_parity(setup, single, out_dir)
    with open(os.path.join(out_dir, "log", "workerlog.0"), errors="replace") as f:
        assert "x context 2 x tensor 1" in f.read()


@pytest.mark.slow
@pytest.mark.parametrize("name,degrees", [
    ("cp2-packed-lora", dict(context_parallel_degree=2, use_remove_padding=True, lora=True, lora_rank=4,
                             lora_alpha=8, learning_rate=2e-2, merge_lora=True)),
    ("dp2-cp2", dict(context_parallel_degree=2, data_parallel_degree=2, use_remove_padding=True)),
    ("dp2", dict(data_parallel_degree=2, use_remove_padding=True))])
def test_context_parallel_trainer_layouts(setup, name, degrees):
    """Packed micro-batches with LoRA on context 2; data 2 x context 2 (4 processes) and data 2 alone: each against
    one process with the same keys."""
    ref_keys = {k: v for k, v in degrees.items() if k not in ("context_parallel_degree", "data_parallel_degree")}
    ref_dir = str(setup["root"] / f"single-{name}")
    os.makedirs(ref_dir, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], ref_dir, setup["plugin"], rl_algorithm="grpo", **ref_keys), ref_dir,
                    setup["prompts"])
    nproc = degrees.get("context_parallel_degree", 1) * degrees.get("data_parallel_degree", 1)
    out_dir, _ = run_layout(setup, name, nproc=nproc, **degrees)
    check_parity(setup, {"grpo": ref_dir}, out_dir)


def test_context_parallel_refusals():
    from paddle_rl.config import ConfigError, load_config
    from paddle_rl.models import CausalLM, ModelConfig
    from paddle_rl.parallel.topology import TopologyError, build_topology, resolve_degrees
    base = ["actor_model_name_or_path=x", "context_parallel_degree=2"]
    for keys, says in ((["tensor_parallel_degree=2"], "with tensor_parallel_degree 2"),
                       (["pipeline_parallel_degree=2"], "with pipeline_parallel_degree 2"),
                       (["sharding_parallel_degree=2", "sharding=stage3"], "with sharding: stage3"),
                       (["rollout_tensor_parallel_degree=2"], "with rollout_tensor_parallel_degree 2")):
        with pytest.raises(ConfigError, match=f"context_parallel_degree > 1 is not implemented {says}"):
            load_config(None, base + keys)
    with pytest.raises(ConfigError, match="context_parallel_degree 2 with share_prompt_prefix: true"):
        load_config(None, base)
    for keys in (["share_prompt_prefix=false"], ["use_remove_padding=true"]):
        assert load_config(None, base + keys).context_parallel_degree == 2
    # verl's and ms-swift's spellings
    for keys in (["ulysses_sequence_parallel_size=2"], ["sequence_parallel_size=2"],
                 ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                  "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"]):
        assert load_config(None, ["actor_model_name_or_path=x", "use_remove_padding=true", *keys]
                           ).context_parallel_degree == 2
    with pytest.raises(ConfigError, match="sets context_parallel_degree to 1"):
        load_config(None, ["actor_model_name_or_path=x", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                           "critic.ulysses_sequence_parallel_size=1"])
    with pytest.raises(TopologyError, match="context_parallel_degree > 1 is not implemented with tensor"):
        build_topology(tensor=2, context=2)
    assert resolve_degrees(context=2, world_size=4) == {"data": 2, "sharding": 1, "pipe": 1, "tensor": 1,
                                                        "context": 2}
    with pytest.raises(TopologyError, match=r"context_parallel_degree \(2\)"):
        resolve_degrees(context=2, world_size=3)

    class Group:  # a stand-in group of 4 ranks: the model's checks read its size alone
        nranks, rank = 4, 0
    with pytest.raises(ValueError, match=r"context_parallel_degree 4: num_attention_heads \(6\) must be divisible"):
        CausalLM(ModelConfig(model_type="qwen2", vocab_size=50, hidden_size=48, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2)
                 ).set_context_parallel(Group())
    with pytest.raises(ValueError, match="sparse MoE blocks"):
        CausalLM(ModelConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=50, hidden_size=32, intermediate_size=64,
                                            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                            head_dim=8))).set_context_parallel(Group())


def test_topology_places_the_context_axis():
    from paddle_rl.parallel.topology import Topology
    topo = Topology({"data": 2, "sharding": 1, "pipe": 1, "context": 2, "tensor": 1}, rank=3)
    assert topo.coords() == {"data": 1, "sharding": 0, "pipe": 0, "context": 1, "tensor": 0}
    assert topo.axis_ranks(("context",)) == [2, 3]        # the context group: neighbours
    assert topo.axis_ranks(("data", "sharding")) == [1, 3]   # the batch group: the same context rank
    assert topo.batch_degree == 2 and topo.cp_degree == 2


# --------------------------------------------------------------------------------------------- worker

def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


def _inputs(rng, vocab, prompt_lens, lengths, width):
    """Prompts of `prompt_lens` tokens, two responses each of `lengths` real tokens in `width` columns."""
    prompts = [list(rng.integers(3, vocab, n)) for n in prompt_lens]
    rows = [i // 2 for i in range(len(lengths))]
    lengths = np.array(lengths)
    response = rng.integers(3, vocab, (len(lengths), width))
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    response = np.where(mask > 0, response, 0)
    weight = rng.normal(size=mask.shape).astype(np.float32)
    return prompts, rows, lengths, response, mask, weight


def _padded_tensors(data):
    import paddle
    prompts, rows, lengths, response, mask, _ = data
    width = max(len(p) for p in prompts)
    prompt_ids = np.array([[0] * (width - len(prompts[r])) + prompts[r] for r in rows])
    prompt_mask = np.array([[0] * (width - len(prompts[r])) + [1] * len(prompts[r]) for r in rows])
    ids = paddle.to_tensor(np.concatenate([prompt_ids, response], 1).astype(np.int64))
    attention = paddle.to_tensor(np.concatenate([prompt_mask, mask.astype(np.int64)], 1).astype(np.int64))
    return ids, attention, width, paddle.to_tensor(response.astype(np.int64))


def _padded(model, data, greedy=False):
    from paddle_rl.models.logprobs import token_logprobs
    ids, attention, width, response = _padded_tensors(data)
    return token_logprobs(model, ids, attention, width, response, 1.0, True, None, with_greedy=greedy)


def _packing(data):
    from paddle_rl.models.packing import Packing
    prompts, rows, lengths, response, _, _ = data
    return Packing(prompts, rows, response, lengths)


def _packed(model, data, greedy=False):
    from paddle_rl.models.logprobs import packed_token_logprobs
    return packed_token_logprobs(model, _packing(data), 1.0, True, with_greedy=greedy)


def _values(model, data):
    from paddle_rl.models.critic import token_values
    ids, attention, width, response = _padded_tensors(data)
    values = token_values(model, ids, attention, width, response.shape[1])
    return values, values * 0.0


def _packed_values(model, data):
    from paddle_rl.models.critic import packed_token_values
    values = packed_token_values(model, _packing(data))
    return values, values * 0.0


def _run(model, data, forward, topo, lr=0.1):
    """Loss, backward, the gradient sums (GradientSync, as training), one SGD step: log-probs, entropy, loss,
    gradients and updated weights (numpy), and how far the context ranks' gradients differ."""
    import paddle
    from paddle_rl.parallel.collectives import gather_objects
    from paddle_rl.parallel.sharding import GradientSync
    mask, weight = paddle.to_tensor(data[4]), paddle.to_tensor(data[5])
    logp, entropy = forward(model, data)
    loss = (logp * mask * weight).sum() / mask.sum() + 0.1 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    if model.context_group is not None:  # (the whole model's gradients are whole already)
        GradientSync(topo, model.parameters()).sync()
    out = {"logp": logp.numpy() * data[4], "entropy": entropy.numpy() * data[4], "loss": float(loss)}
    group = model.context_group
    for name, param in model.named_parameters():
        if param.stop_gradient:
            continue
        grad = param.grad.numpy()
        out[f"{name}/grad"], out[f"{name}/updated"] = grad, param.numpy() - lr * grad
        if group is not None:
            grads = gather_objects(grad, group)
            out[f"{name}/rank-spread"] = max(_rel(grads[0], g) for g in grads)
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


def _models(folder, group, lora=None, critic=False):
    from paddle_rl.models import load_model
    from paddle_rl.models.critic import load_critic
    load = (lambda: load_critic(folder, lora=lora)) if critic else (lambda: load_model(folder, lora=lora))
    whole, split = load(), load()
    split.set_context_parallel(group)
    if lora is not None or critic:  # LoRA's B and the value head away from zero, so every tensor takes a gradient
        rng = np.random.default_rng(7)
        for name, param in whole.named_parameters():
            if "lora_B" in name or "score" in name:
                value = rng.normal(0, 0.1, param.shape).astype(np.float32)
                param.set_value(value)
                dict(split.named_parameters())[name].set_value(value)
    return whole, split


def _pair(folder, group, data, forward, topo, lora=None, critic=False, recompute=None):
    whole, split = _models(folder, group, lora, critic)
    for model in (whole, split):
        model.recompute = recompute
    return _errors(_run(whole, data, forward, topo), _run(split, data, forward, topo))


def _worker(folder, out_dir, size):
    from paddle_rl.env import configure_threads
    configure_threads()
    import paddle
    from paddle_rl.models import CausalLM, ModelConfig, load_model
    from paddle_rl.models.lora import LoraSettings
    from paddle_rl.models.pretrained import save_model
    from paddle_rl.parallel import collectives
    from paddle_rl.parallel.topology import build_topology
    topo = build_topology(context=2)
    group = topo.group("cp")
    vocab = load_model(folder).config.vocab_size
    if size == "long":   # 4,096 packed tokens; padded 2 x (48 + 2,000) columns
        data = _inputs(np.random.default_rng(5), vocab, [48], [2000, 2000], 2000)
        packed = _inputs(np.random.default_rng(6), vocab, [96, 200], [1000, 900, 1000, 900], 1001)
    else:                # padded 2 x ... 47 + 160 = 207 columns (odd); packed 30 + 47 + 481 = 558 tokens
        data = _inputs(np.random.default_rng(11), vocab, [30, 47], [160, 97, 131, 45], 160)
        packed = data
    result = {"padded": _pair(folder, group, data, _padded, topo),
              "packed": _pair(folder, group, packed, _packed, topo)}
    if size == "default":
        result["lora"] = _pair(folder, group, data, _padded, topo, lora=LoraSettings(rank=4, alpha=8.0))
        result["lora packed"] = _pair(folder, group, packed, _packed, topo, lora=LoraSettings(rank=4, alpha=8.0))
        result["recompute full"] = _pair(folder, group, data, _padded, topo, recompute="full")
        result["critic"] = _pair(folder, group, data, _values, topo, critic=True)
        result["critic packed"] = _pair(folder, group, packed, _packed_values, topo, critic=True)
        # Qwen3: q/k norms, and one key/value head for two ranks (repeated before the all-to-all)
        config = ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16)
        paddle.seed(2)
        model = CausalLM(config)
        model.init_weights()
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so that every norm's gradient depends on its weight
                param.set_value(paddle.normal(1.0, 0.3, param.shape))
        qwen3 = os.path.join(out_dir, f"qwen3-rank{topo.rank}")
        save_model(model, qwen3)
        result["qwen3 one kv head"] = _pair(qwen3, group, data, _padded, topo)
        # the no-grad pass's argmax at every response position
        whole, split = _models(folder, group)
        with paddle.no_grad():
            greedy = [_padded(m, data, greedy=True)[2].numpy() for m in (whole, split)]
            greedy += [_packed(m, packed, greedy=True)[2].numpy() for m in (whole, split)]
        result["greedy"] = int((greedy[0] != greedy[1]).sum() + (greedy[2] != greedy[3]).sum())
        # perturbations: each must break parity
        whole, _ = _models(folder, group)
        reference = _run(whole, data, _padded, topo)
        perturbed = {}
        keep = collectives._all_to_all

        def reversed_chunks(x, split_axis, concat_axis, group):
            parts = paddle.split(keep(x, split_axis, concat_axis, group), group.nranks, axis=concat_axis)
            return paddle.concat(parts[::-1], axis=concat_axis)

        collectives._all_to_all = reversed_chunks
        _, split = _models(folder, group)
        perturbed["all-to-all chunks in the wrong order"] = _errors(reference, _run(split, data, _padded, topo))
        collectives._all_to_all = keep
        _, split = _models(folder, group)
        cp = topo.groups.pop("cp")
        perturbed["gradients not summed over the context group"] = _errors(reference,
                                                                           _run(split, data, _padded, topo))
        topo.groups["cp"] = cp
        result["perturbed"] = perturbed
    else:
        result["greedy"] = 0
    with open(os.path.join(out_dir, f"rank{topo.rank}.json"), "w") as f:
        json.dump(result, f)
    collectives.barrier()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    sys.path[:0] = [ROOT]
    _worker(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

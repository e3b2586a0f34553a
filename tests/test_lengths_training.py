"""Real lengths in the training passes, against the fixed-row padded path and one process:
- micro-batches by a token budget (max_tokens_per_micro_batch),
- packed micro-batches, one row of real tokens (use_remove_padding),
- prompt groups balanced by tokens over 2 data-parallel processes (balance_batch).

This file is also the worker the 2-process test launches (`--worker SPEC`).
"""
import functools
import json
import logging
import os
import sys

import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.algorithms import Objective
from paddle_rl.batch import StepBatch, object_column
from paddle_rl.config import load_config
from paddle_rl.layouts import BatchGroup, build_layout
from paddle_rl.layouts.base import balance_groups
from paddle_rl.models import CausalLM, ModelConfig

TOL = 1e-5
KEYS = ["old_logp", "advantages", "ref_logp"]
KINDS = {"qwen2": {}, "qwen3_moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True)}


def make_model(kind="qwen2"):
    paddle.seed(0)
    model = CausalLM(ModelConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, model_type=kind, extra=KINDS[kind]))
    model.init_weights(0.2)
    return model


def long_tail_batch(groups=4, n=4, seed=0, cap=64):
    """groups x n rows: prompts of 2-19 tokens, response lengths log-normal (median 12, 1 .. cap), in one batch."""
    rng = np.random.default_rng(seed)
    rows = groups * n
    prompts, ids, mask = [], np.zeros((rows, cap), np.int64), np.zeros((rows, cap), np.float32)
    lengths = np.clip(np.round(12 * np.exp(rng.normal(size=rows))), 1, cap).astype(np.int64)
    lengths[rng.integers(rows)] = cap
    for g in range(groups):
        prompt = rng.integers(1, 211, size=int(rng.integers(2, 20))).tolist()
        for i in range(g * n, (g + 1) * n):
            prompts.append(prompt)
            ids[i, :lengths[i]] = rng.integers(1, 211, size=lengths[i])
            mask[i, :lengths[i]] = 1.0
    batch = StepBatch({"prompt_ids": object_column(prompts), "response_ids": ids, "response_mask": mask,
                       "lengths": lengths, "group": np.repeat(np.arange(groups), n),
                       "sample": np.tile(np.arange(n), groups)}).with_prompt_layout(0)
    batch["old_logp"] = (-rng.random(mask.shape) * mask).astype(np.float32)
    batch["ref_logp"] = ((batch["old_logp"] - 0.05 * rng.random(mask.shape)) * mask).astype(np.float32)
    batch["advantages"] = (rng.normal(size=(rows, 1)) * mask).astype(np.float32)
    return batch


def objective():
    return Objective(load_config(None, ["actor_model_name_or_path=x", "kl_loss_coeff=0.05", "entropy_coeff=0.01"]),
                     reduce=None)


def run(layout, model, batch, micro=4):
    """(log-probs, entropy, loss, {parameter: gradient}, the input shape of every model forward, the [prompt |
    response] layout of each update micro-batch) of the update (as the trainer's: mini-batch normalizers, MoE
    load-balancing loss) and the no-grad log-prob pass."""
    obj = objective()
    num_tokens, num_seqs = (float(v) for v in obj.loss_normalizers(batch["response_mask"]))

    layouts = []

    def loss_fn(part, logp, entropy):
        layouts.append(list(part["input_ids"].shape))
        out = obj.loss(logp, part["old_logp"], part["ref_logp"], part["advantages"], part["response_mask"], entropy,
                       num_tokens, num_seqs)
        aux = model.aux_loss()
        if aux is not None:
            out.loss = out.loss + 0.1 * float((part["response_mask"].numpy().sum(-1) > 0).sum()) / num_seqs * aux
        return out

    shapes = []
    hook = model.embed_tokens.register_forward_pre_hook(lambda layer, args: shapes.append(list(args[0].shape)))
    model.train()
    outs = layout.forward_backward(model, batch, KEYS, micro, 0.7, loss_fn)
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    model.clear_gradients()
    logp, entropy = layout.logprobs(model, batch, 0.7, micro, with_entropy=True)
    hook.remove()
    return {"logp": logp, "entropy": entropy, "loss": sum(float(o.loss) for o in outs), "grads": grads,
            "shapes": shapes, "layouts": layouts}


def assert_same(got, ref):
    # log-probs near -10 carry ~1e-6 of float32 rounding; the packed kernel's own exp and sum order add a few ulps
    np.testing.assert_allclose(got["logp"], ref["logp"], atol=TOL, rtol=TOL / 5)
    np.testing.assert_allclose(got["entropy"], ref["entropy"], atol=TOL, rtol=0)
    assert abs(got["loss"] - ref["loss"]) <= TOL * max(1.0, abs(ref["loss"])), (got["loss"], ref["loss"])
    for name, g in ref["grads"].items():
        scale = max(float(np.abs(g).max()), 1e-6)
        np.testing.assert_allclose(got["grads"][name] / scale, g / scale, atol=TOL, rtol=0, err_msg=name)


# --------------------------------------------------------------------------------------------- token budget

def test_token_budget_micro_batches_equal_the_row_split(caplog):
    """Micro-batches formed by tokens (each padded to its own longest, rows x width <= the budget) give the
    fixed-row split's log-probs (in the batch's row order), loss and every gradient."""
    model, batch = make_model(), long_tail_batch()
    budget = 256
    fixed = run(build_layout(), model, batch)
    tokens = run(build_layout(max_tokens=budget), model, batch)
    assert_same(tokens, fixed)
    assert all(rows * width <= budget for rows, width in tokens["layouts"]), tokens["layouts"]
    assert len({rows for rows, _ in tokens["layouts"]}) > 1                 # split by tokens, not by rows
    assert any(rows * width > budget for rows, width in fixed["layouts"])   # the row split breaks the budget
    assert sum(r * w for r, w in tokens["layouts"]) < sum(r * w for r, w in fixed["layouts"])
    # the log-prob pass forms the same micro-batches (shared prompts: a prompt pass and a response pass each)
    assert tokens["shapes"][:len(tokens["shapes"]) // 2] == tokens["shapes"][len(tokens["shapes"]) // 2:]

    # a row longer than the budget runs alone, said once
    small = 40
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        alone = run(build_layout(max_tokens=small), model, batch)
    assert_same(alone, fixed)
    over = [r * w for r, w in alone["layouts"] if r * w > small]
    assert over and all(r == 1 for r, w in alone["layouts"] if r * w > small)
    told = [r for r in caplog.records if "runs as a micro-batch of its own" in r.getMessage()]
    assert len(told) == 1 and len(over) > 2


def test_token_budget_keeps_prompt_groups_together_when_packed():
    """Packed, a micro-batch costs each distinct prompt once: the plan keeps a group's rows together."""
    batch = long_tail_batch()
    layout = build_layout(max_tokens=200, remove_padding=True)
    plan = layout.micro.plan(batch, 4)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(batch)))
    for rows in plan:
        assert layout.micro.tokens(batch.micro(rows)) <= 200 or len(rows) == 1
        groups = batch["group"][rows]
        assert (np.diff(groups) >= 0).all()  # group by group
    assert sum(len(np.unique(batch["group"][r])) for r in plan) < len(plan) + 4


# --------------------------------------------------------------------------------------------- packed rows

def packed_tokens(batch, rows, share=True):
    """Real tokens of a packed micro-batch: each distinct prompt once (or per row), every response but its
    last column of the micro-batch."""
    part = batch.micro(rows)
    width = part["response_ids"].shape[1]
    lengths = part["response_mask"].sum(1).astype(np.int64)
    groups = part["group"] if share else np.arange(part.size)
    _, first = np.unique(groups, return_index=True)
    return sum(len(part["prompt_ids"][i]) for i in first) + int(np.minimum(lengths, width - 1).sum())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("share", [True, False])
def test_packed_micro_batches_equal_the_padded_path(kind, share):
    """use_remove_padding: each micro-batch runs as one row of real tokens (no pad token) with per-sequence
    positions and attention per segment block; log-probs, loss (with the MoE load-balancing loss) and every
    gradient equal the padded pass."""
    model, batch = make_model(kind), long_tail_batch()
    padded = run(build_layout(share_prompts=share), model, batch)
    packed = run(build_layout(share_prompts=share, remove_padding=True), model, batch)
    assert_same(packed, padded)
    expected = [packed_tokens(batch, np.arange(s, min(s + 4, len(batch))), share) for s in range(0, len(batch), 4)]
    assert packed["shapes"] == [[1, n] for n in expected * 2]  # update, then the log-prob pass
    assert sum(expected) < 0.7 * sum(r * w for r, w in padded["layouts"])


def test_packed_with_token_budget_recompute_and_reference_ops():
    """Packing under a token budget, with layer recompute (one pass: no prompt cache to hand over) and with the
    pure-Paddle ops, still equals the fixed-row padded path."""
    model, batch = make_model(), long_tail_batch(seed=1)
    layout = build_layout(max_tokens=160, remove_padding=True)
    previous = ops.mode()
    ops.configure("off")
    try:
        fixed = run(build_layout(), model, batch)
        model.recompute = "full"
        assert_same(run(layout, model, batch), fixed)
    finally:
        ops.configure(previous)
        model.recompute = None
    fixed = run(build_layout(), model, batch)
    got = run(layout, model, batch)
    assert_same(got, fixed)
    assert all(rows == 1 and width <= 160 for rows, width in got["shapes"]) and len(got["shapes"]) > 4


@pytest.mark.parametrize("granularity", ["core_attn", "core_attn_mlp"])
@pytest.mark.parametrize("remove_padding,kernels", [(True, "on"), (True, "off"), (False, "on")])
def test_core_attention_recompute_equals_the_kept_pass(remove_padding, kernels, granularity, monkeypatch, request):
    """recompute_granularity core_attn: the attention core (the packing's blocks, or the padded pass with the
    shared prompt prefix, whose keys and values are made outside the recomputed part) runs again in the backward,
    and the update equals the pass that keeps its probabilities; core_attn_mlp (the MLP blocks with their norms
    recomputed too) equals it as well. The packed kernel (kernels on) keeps no probabilities and recomputes them in
    its own backward: its core does not run twice."""
    from paddle_rl.models.decoder import Attention
    from paddle_rl.models.packing import Packing
    request.addfinalizer(functools.partial(ops.configure, ops.mode()))
    ops.configure(kernels)
    model, batch = make_model(), long_tail_batch(seed=2)
    layout = build_layout(share_prompts=True, remove_padding=remove_padding)
    kept = run(layout, model, batch)
    core = (Packing, "attend") if remove_padding else (Attention, "_core")
    calls = []
    original = getattr(*core)

    def counted(self, *args):
        calls.append(paddle.is_grad_enabled())
        return original(self, *args)
    monkeypatch.setattr(*core, counted)
    model.recompute = granularity
    try:
        recomputed = run(layout, model, batch)
    finally:
        model.recompute = None
    assert_same(recomputed, kept)
    monkeypatch.setattr(*core, original)
    plain = []
    monkeypatch.setattr(*core, lambda self, *args: plain.append(1) or original(self, *args))
    run(layout, model, batch)
    if remove_padding and kernels == "on":
        assert len(calls) == len(plain)  # the packed kernel: its backward recomputes the probabilities itself
    else:
        assert len(calls) > len(plain)   # the recomputed cores ran again in the backward


def test_packed_refuses_the_pipeline():
    """(A gap in the loss mask is packed: test_tokens_out_of_the_loss_mask_stay_in_the_sequence.)"""
    from paddle_rl.config import ConfigError
    with pytest.raises(ConfigError, match="use_remove_padding: .*pipeline_parallel_degree 2"):
        load_config(None, ["actor_model_name_or_path=x", "use_remove_padding=true", "pipeline_parallel_degree=2"])
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch: must be >= 0"):
        load_config(None, ["actor_model_name_or_path=x", "max_tokens_per_micro_batch=-1"])


# --------------------------------------------------------------------------------------------- balance_batch

def test_balance_groups_largest_first():
    tokens = [90, 10, 50, 45, 5, 40]
    owner = balance_groups(tokens, 2)
    loads = np.bincount(owner, weights=tokens, minlength=2)
    assert owner.tolist() == [0, 1, 1, 1, 1, 0] and loads.tolist() == [130.0, 110.0]  # 90 | 50 45; 40 | 10 5
    assert sorted(np.bincount(balance_groups([3, 3, 3, 3], 2)).tolist()) == [2, 2]


def test_balance_batch_does_nothing_in_one_process():
    from paddle_rl.parallel.topology import single_process
    batch = long_tail_batch()
    placed, metrics = BatchGroup(single_process()).place(batch, 2, balance=True)
    assert placed is batch and metrics == {"perf/token_imbalance": 1.0}
    assert placed["mini_batch"].tolist() == [0] * 8 + [1] * 8


VARIED_PROMPTS = 16


def varied_prompts(micro, path):
    """Training prompts of very different lengths (a KK puzzle cut to 4 .. 160 characters), so that the prompt
    groups of a mini-batch differ in tokens."""
    with open(micro["train"], encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    cuts = [4, 160, 12, 120, 8, 20, 150, 30, 6, 90, 140, 10, 60, 16, 100, 24]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(VARIED_PROMPTS):
            r = records[i]
            f.write(json.dumps({"src": r["src"][:cuts[i]], "tgt": r["tgt"]}) + "\n")
    return str(path)


def two_process_runs(micro, tmp_path, runs):
    """The single-process run (plain padded fixed rows) and `runs` {name: overrides} on 2 processes, one launch;
    returns {name: output folder} with "single"."""
    from test_parallel import PLUGIN, launch, run_overrides
    plugin = tmp_path / "parity_reward.py"
    plugin.write_text(PLUGIN)
    data = varied_prompts(micro, tmp_path / "varied.jsonl")

    def overrides(name, **extra):
        out = str(tmp_path / name)
        os.makedirs(out, exist_ok=True)
        values = dict(train_datasets=data, global_batch_size=8, global_mini_batch_size=4, rollout_n=2,
                      per_device_train_batch_size=2, dataloader_shuffle=True, **extra)
        return run_overrides(micro, out, str(plugin), **values)

    from paddle_rl.trainer import RLTrainer
    RLTrainer(load_config(None, overrides("single", balance_batch=True))).train()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([overrides(name, **extra) for name, extra in runs.items()]))
    launch([os.path.abspath(__file__), "--worker", str(spec)], str(tmp_path / "log"))
    return {name: str(tmp_path / name) for name in ["single", *runs]}


def test_balance_batch_two_processes_equal_one_process(micro, tmp_path):
    """data_parallel_degree 2, balance_batch: each mini-batch's groups are spread by tokens (ranks may hold
    different numbers of groups), the run equals one process within 1e-5, and the token imbalance is lower
    than with the contiguous split. The balanced run also packs its micro-batches under a token budget: the
    trainer with every key of this file still equals the plain single-process run."""
    from test_parallel import assert_parity
    out = two_process_runs(micro, tmp_path, {
        "dp-balanced": dict(data_parallel_degree=2, balance_batch=True, use_remove_padding=True,
                            max_tokens_per_micro_batch=160),
        "dp-contiguous": dict(data_parallel_degree=2, balance_batch=False)})
    assert_parity(out["single"], out["dp-balanced"])
    assert_parity(out["single"], out["dp-contiguous"])
    imbalance = {name: [r["perf/token_imbalance"] for r in json_rows(folder)] for name, folder in out.items()}
    print(f"token imbalance per step: {imbalance}")
    assert imbalance["single"] == [1.0] * 3
    assert sum(imbalance["dp-balanced"]) < sum(imbalance["dp-contiguous"])
    assert all(b <= c for b, c in zip(imbalance["dp-balanced"], imbalance["dp-contiguous"]))


@pytest.mark.parametrize("name,extra", [
    ("tp-packed", dict(tensor_parallel_degree=2, use_remove_padding=True, max_tokens_per_micro_batch=160)),
    ("pp-budget", dict(pipeline_parallel_degree=2, max_tokens_per_micro_batch=160))])
def test_token_budget_and_packing_under_model_parallelism(micro, tmp_path, name, extra):
    """tensor_parallel_degree 2 with packed micro-batches under a token budget, and the pipeline (1F1B over
    micro-batches of different shapes) under a token budget, equal one process."""
    from test_parallel import assert_parity
    out = two_process_runs(micro, tmp_path, {name: extra})
    assert_parity(out["single"], out[name])


def json_rows(out_dir):
    from paddle_rl.monitor import read_metrics
    return read_metrics(os.path.join(out_dir, "metrics.jsonl"))


# --------------------------------------------------------------------------------------------- worker

def _worker(spec_path):
    """Every run of the spec, one after the other, on one process grid."""
    from paddle_rl.env import configure_threads
    configure_threads()
    from paddle_rl.parallel.topology import topology_from_config
    from paddle_rl.trainer import RLTrainer
    with open(spec_path) as f:
        runs = json.load(f)
    configs = [load_config(None, args) for args in runs]
    topology = topology_from_config(configs[0])
    for config in configs:
        RLTrainer(config, topology).train()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the ranks passed RLTrainer.train's final barrier (see run_rl.py)


@pytest.mark.parametrize("layout", [dict(), dict(remove_padding=True), dict(max_tokens=200)],
                         ids=["padded", "packed", "token-budget"])
def test_tokens_out_of_the_loss_mask_stay_in_the_sequence(layout):
    """A token the loss mask leaves out inside a response (a token rejected by rollout_rs, an environment's
    observation) is still attended to: the log-probs of every other token are unchanged (before, the pass dropped
    it from attention and the tokens after it were scored on another sequence)."""
    model = make_model()
    batch = long_tail_batch()
    full = build_layout(**layout).logprobs(model, batch, 1.0, 4)
    holes = batch.select(np.arange(batch.size))
    mask = holes["response_mask"].copy()
    lengths = holes["lengths"]
    for r in range(holes.size):
        if lengths[r] > 2:
            mask[r, 1:lengths[r] - 1:3] = 0.0   # gaps inside the response
    holes["response_mask"] = mask
    got = build_layout(**layout).logprobs(model, holes, 1.0, 4)
    assert (mask < batch["response_mask"]).sum() > 20
    assert np.abs(got - full * mask).max() <= 1e-5


def _kept_mb(model, ids, mask):
    """MB of tensors a training forward leaves alive for the backward (Paddle's CPU allocator, live bytes)."""
    from paddle_rl.models.logprobs import token_logprobs
    core = paddle.base.core
    before = core.host_memory_stat_current_value("Allocated", 0)
    logp = token_logprobs(model, ids, mask, 4, ids[:, 4:], 1.0)[0]
    kept = (core.host_memory_stat_current_value("Allocated", 0) - before) / 2**20
    logp.sum().backward()
    model.clear_gradients()
    return kept


@pytest.mark.parametrize("granularity", ["core_attn_mlp", "full_attn"])
@pytest.mark.parametrize("remove_padding,kind", [(True, "qwen2"), (False, "qwen2"), (True, "qwen3_moe")])
def test_bf16_recomputes_attention_from_its_bfloat16_operand(remove_padding, kind, granularity, monkeypatch):
    """bf16: the attention block reads its input only through the q/k/v product's bfloat16 operand, so
    core_attn_mlp and full_attn recompute the whole block from that rounding (decoder.recompute_from_bf16, the
    one tensor kept): the update equals the pass that keeps everything bit for bit, the blocks run again in the
    backward, and a forward keeps less than when each block keeps its own (the feature off)."""
    from paddle_rl.models.decoder import Attention
    from paddle_rl.models.layers import ColumnLinear
    model, batch = make_model(kind), long_tail_batch(seed=2)
    model.set_bf16(True, True)
    layout = build_layout(share_prompts=remove_padding, remove_padding=remove_padding)
    kept = run(layout, model, batch)
    calls = []
    original = Attention.forward
    monkeypatch.setattr(Attention, "forward",
                        lambda self, *args: calls.append(paddle.is_grad_enabled()) or original(self, *args))
    model.recompute = granularity
    try:
        recomputed = run(layout, model, batch)
    finally:
        model.recompute = None
    assert recomputed["loss"] == kept["loss"]
    np.testing.assert_array_equal(recomputed["logp"], kept["logp"])
    for name, g in kept["grads"].items():
        np.testing.assert_array_equal(recomputed["grads"][name], g, err_msg=name)
    layers = model.config.num_hidden_layers
    assert calls.count(True) == layers * len(recomputed["layouts"])  # every block once more in the backward
    monkeypatch.setattr(Attention, "forward", original)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(1, 211, (8, 96)))
    mask = paddle.ones([8, 96], "int64")
    model.train()
    model.recompute = granularity
    try:
        on = _kept_mb(model, ids, mask)
        monkeypatch.setattr(ColumnLinear, "reads_input_rounded", property(lambda self: False))
        off = _kept_mb(model, ids, mask)
    finally:
        model.recompute = None
    # bytes per token and layer: under core_attn_mlp the block kept its input's rounding (64 bfloat16, for the q/k/v
    # weight gradient), q, k, v (4 + 2 + 2 heads x 16 float32, the recomputed core's inputs) and o_proj's operand
    # (64 bfloat16); under full_attn its input h (64 float32); now h's rounding alone
    per_token = {"core_attn_mlp": 64 * 2 + 128 * 4 + 64 * 2, "full_attn": 64 * 4}[granularity] - 64 * 2
    saved = 8 * 96 * layers * per_token / 2**20
    if kind == "qwen2":   # (qwen3's q/k norms keep their inputs too)
        assert 0.98 * saved <= off - on <= 1.02 * saved, (on, off, saved)
    assert off - on >= 0.8 * saved, (on, off, saved)

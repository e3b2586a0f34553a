"""The rollout engine's decode path (preallocated KV cache, DecodeRunner, fused or reference ops) against the
model's full forward, and the rollout log-probs that may stand in for the old-log-prob pass."""
import importlib

import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.models import CausalLM, LayerCache, ModelConfig
from paddle_rl.models.decoder import MLP
from paddle_rl.rollout import EngineSettings, RolloutEngine, SamplingParams, sample_key
from paddle_rl.batch import StepBatch, object_column
from paddle_rl.layouts import build_layout
from paddle_rl.trainer.logprobs import reuses_rollout_logprobs


def batched_logprobs(model, batch, temperature, micro_batch_size, with_entropy=False, share_prompts=True):
    """The one-process layout's no-grad log-prob pass."""
    return build_layout(share_prompts=share_prompts).logprobs(model, batch, temperature, micro_batch_size,
                                                              with_entropy)


def step_batch(prompt_ids, prompt_mask, response_ids, response_mask, groups):
    """A StepBatch in the [left-padded prompt | right-padded response] layout the log-prob passes read."""
    prompts = [row[m > 0].tolist() for row, m in zip(prompt_ids, prompt_mask)]
    batch = StepBatch({"prompt_ids": object_column(prompts), "response_ids": response_ids,
                       "response_mask": response_mask, "group": groups})
    batch["prompt_tokens"], batch["prompt_mask"] = prompt_ids, prompt_mask
    batch.meta["prompt_width"] = prompt_ids.shape[1]
    return batch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
KINDS = {"qwen2": dict(model_type="qwen2"), "qwen3_tied": dict(model_type="qwen3", tie_word_embeddings=True),
         "llama": dict(model_type="llama"),
         # llama3 rope scaling on a context of 8: the decode step's fused rotary must use the scaled frequencies too
         "llama3": dict(model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                              high_freq_factor=4.0,
                                                              original_max_position_embeddings=8)),
         "qwen2_moe": dict(model_type="qwen2_moe", extra=dict(num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32,
                                                              shared_expert_intermediate_size=48)),
         "qwen3_moe": dict(model_type="qwen3_moe", extra=dict(num_local_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32, norm_topk_prob=True,
                                                              mlp_only_layers=[1]))}


def make_model(kind, vocab=211, hidden=64, layers=2, std=0.2, seed=0):
    paddle.seed(seed)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, **KINDS[kind])
    model = CausalLM(cfg)
    model.init_weights(std)
    model.eval()
    return model


@pytest.fixture(params=["on", "off"])
def op_mode(request):
    previous = ops.mode()
    ops.configure(request.param)
    yield request.param
    ops.configure(previous)


def full_logprobs(model, seq, temperature):
    logits = model(paddle.to_tensor([seq]))[0].numpy().astype(np.float64) / temperature
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_decode_matches_full_forward(kind, op_mode):
    model = make_model(kind)
    params = SamplingParams(max_dec_len=10, temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    keys = [sample_key(3, 1, i // 2, i % 2) for i in range(6)]
    out = RolloutEngine(model, 0, [1]).generate(PROMPTS, 2, params, keys)
    for r in range(6):
        n = int(out.lengths[r])
        seq = list(out.prompt_ids[r]) + out.response_ids[r, :n].tolist()
        logp = full_logprobs(model, seq, 0.9)
        p = len(out.prompt_ids[r])
        expected = [logp[p - 1 + t, seq[p + t]] for t in range(n)]
        np.testing.assert_allclose(out.rollout_logp[r, :n], expected, atol=1e-4)
    greedy = RolloutEngine(model, 0, []).generate(PROMPTS[:1], 1, SamplingParams(max_dec_len=6, temperature=0))
    seq = list(PROMPTS[0])
    for _ in range(6):
        seq.append(int(model(paddle.to_tensor([seq]))[0, -1].argmax()))
    assert greedy.response_ids[0].tolist() == seq[len(PROMPTS[0]):]


def test_fused_and_reference_rollouts_agree():
    model = make_model("qwen2", vocab=300, std=0.3)
    keys = [sample_key(7, 2, i // 4, i % 4) for i in range(12)]
    outs = {}
    for mode in ("on", "off"):
        ops.configure(mode)
        for name, params in {
            "filters": SamplingParams(max_dec_len=12, min_dec_len=4, temperature=0.8, top_k=40, top_p=0.9,
                                      repetition_penalty=1.2),
            "plain": SamplingParams(max_dec_len=12, temperature=1.0),
        }.items():
            outs[mode, name] = RolloutEngine(model, 0, [1, 2, 3]).generate(PROMPTS, 4, params, keys)
    ops.configure("auto")
    for name in ("filters", "plain"):
        a, b = outs["on", name], outs["off", name]
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        np.testing.assert_array_equal(a.truncated, b.truncated)
        np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, rtol=1e-5, atol=2e-5)
    filters = outs["on", "filters"]
    assert (filters.lengths >= 4).all()
    assert not np.isin(filters.response_ids[:, :3], [1, 2, 3]).any()


# (kind, rollout_dtype, quant_type, kv_cache_dtype): a dense layer of each family the fused layer takes, each
# packed weight format, a 16-bit cache
@pytest.mark.parametrize("kind,rollout_dtype,quant,cache", [
    ("qwen2", "float32", "", None), ("qwen3_tied", "float32", "", "bfloat16"), ("llama3", "float32", "", None),
    ("qwen2", "bfloat16", "", None), ("llama", "float32", "weight_only_int8", "float16"),
    ("qwen3_tied", "float32", "weight_only_int4", None), ("qwen3_moe", "float32", "", None)])
def test_fused_decode_layer_is_the_layers_bit_for_bit(monkeypatch, kind, rollout_dtype, quant, cache):
    """A rollout whose dense layers each decode in one kernel call (ops.decode_layer) samples the same tokens with
    the same log-probs, bit for bit, as the layers' own modules (PADDLE_RL_FUSED_DECODE_LAYER=0), in every packed
    format; the kernel ran once per dense layer and decode step (an MoE layer keeps its modules)."""
    model = make_model(kind, vocab=300, std=0.3)
    ops.configure("on")
    calls = []
    fused = ops.decode_layer_fused
    module = importlib.import_module("paddle_rl.ops.decode_layer")   # (ops.decode_layer is the function)
    monkeypatch.setattr(module, "decode_layer_fused", lambda *a: calls.append(1) or fused(*a))
    settings = EngineSettings(0, (1,), kv_cache_dtype=cache, rollout_dtype=rollout_dtype, quant_type=quant)
    params = SamplingParams(max_dec_len=12, min_dec_len=12, temperature=1.0)
    keys = [sample_key(7, 2, i // 3, i % 3) for i in range(9)]
    outs = {}
    try:
        for switch in ("1", "0"):
            monkeypatch.setenv("PADDLE_RL_FUSED_DECODE_LAYER", switch)
            outs[switch] = RolloutEngine(model, settings=settings).generate(PROMPTS, 3, params, keys)
    finally:
        ops.configure("auto")
    np.testing.assert_array_equal(outs["1"].response_ids, outs["0"].response_ids)
    np.testing.assert_array_equal(outs["1"].rollout_logp, outs["0"].rollout_logp)
    dense = sum(isinstance(layer.mlp, MLP) for layer in model.layers)
    assert len(calls) == dense * 11    # 12 tokens: the first from the prefill's logits, then 11 decode steps


@pytest.mark.parametrize("kind,rollout_dtype,quant", [("qwen2", "float32", ""), ("llama", "float32", "weight_only_int8"),
                                                     ("qwen2", "bfloat16", "")])
def test_prefill_q_k_v_kernel_is_the_composed_ops_bit_for_bit(monkeypatch, kind, rollout_dtype, quant):
    """The prefill's q/k/v through prl_qkv_rotary (from the packed copies' product) samples the same tokens with the
    same log-probs, bit for bit, as the linear layer and the composed ops (PADDLE_RL_FUSED_QKV=0); the kernel ran in
    every layer of every prefill pass (one per distinct prompt length)."""
    model = make_model(kind, vocab=300, std=0.3)
    ops.configure("on")
    calls = []
    module = importlib.import_module("paddle_rl.ops.rope")
    fused = module.qkv_rotary_fused
    monkeypatch.setattr(module, "qkv_rotary_fused", lambda *a: calls.append(1) or fused(*a))
    settings = EngineSettings(0, (1,), rollout_dtype=rollout_dtype, quant_type=quant)
    params = SamplingParams(max_dec_len=8, temperature=1.0)
    keys = [sample_key(3, 1, i // 3, i % 3) for i in range(9)]
    outs = {}
    try:
        for switch in ("0", "1"):
            monkeypatch.setenv("PADDLE_RL_FUSED_QKV", switch)
            outs[switch] = RolloutEngine(model, settings=settings).generate(PROMPTS, 3, params, keys)
            assert len(calls) == (0 if switch == "0" else len(model.layers) * len({len(p) for p in PROMPTS}))
    finally:
        ops.configure("auto")
    np.testing.assert_array_equal(outs["1"].response_ids, outs["0"].response_ids)
    np.testing.assert_array_equal(outs["1"].rollout_logp, outs["0"].rollout_logp)


def test_single_row_and_single_token_prompt(op_mode):
    model = make_model("qwen2")
    params = SamplingParams(max_dec_len=5, temperature=0.7)
    out = RolloutEngine(model, 0, [1]).generate([[9]], 1, params, [sample_key(1, 1, 0, 0)])
    assert out.response_ids.shape[0] == 1 and 1 <= out.lengths[0] <= 5
    seq = [9] + out.response_ids[0, :out.lengths[0]].tolist()
    logp = full_logprobs(model, seq, 0.7)
    np.testing.assert_allclose(out.rollout_logp[0, :out.lengths[0]],
                               [logp[t, seq[t + 1]] for t in range(out.lengths[0])], atol=1e-4)


def test_layer_cache_writes_in_place():
    k = paddle.arange(2 * 1 * 3 * 2, dtype="float32").reshape([2, 1, 3, 2])
    cache = LayerCache(capacity=8)
    keys, _ = cache.update(k, k * 2)
    buffer = cache.k
    assert buffer.shape == [2, 1, 8, 2] and keys.shape == [2, 1, 3, 2] and cache.length == 3
    keys, values = cache.update(k[:, :, :1], k[:, :, :1])
    assert cache.k is buffer and keys.shape == [2, 1, 4, 2]
    np.testing.assert_array_equal(keys.numpy()[:, :, :3], k.numpy())
    np.testing.assert_array_equal(values.numpy()[:, :, 3], k.numpy()[:, :, 0])
    growing = LayerCache()
    for _ in range(5):
        growing.update(k, k)
    assert growing.length == 15 and growing.k.shape[2] >= 15
    np.testing.assert_array_equal(growing.keys.numpy()[:, :, 12:], k.numpy())


def test_rollout_logprobs_equal_old_logprob_pass():
    """The old-policy log-probs recomputed by a full forward equal the rollout's own within 1e-4
    (the tolerance behind reuse_rollout_logprobs)."""
    model = make_model("qwen2", vocab=1024, hidden=128, std=0.05)
    prompts = [list(np.random.default_rng(i).integers(2, 1024, size=8 + 3 * i)) for i in range(4)]
    keys = [sample_key(5, 1, i // 4, i % 4) for i in range(16)]
    out = RolloutEngine(model, 0, [1]).generate(prompts, 4, SamplingParams(max_dec_len=24, temperature=0.8), keys)
    out["group"] = np.repeat(np.arange(4), 4)
    batch = out.with_prompt_layout(0)
    recomputed = batched_logprobs(model, batch, 0.8, micro_batch_size=16)
    assert np.abs(recomputed - out.rollout_logp).max() <= 1e-4


def test_reuse_decision():
    class Cfg:
        update_iters = 1
        reuse_rollout_logprobs = "auto"
    cfg = Cfg()
    assert reuses_rollout_logprobs(cfg, 1)
    assert not reuses_rollout_logprobs(cfg, 2)
    cfg.update_iters = 2
    assert not reuses_rollout_logprobs(cfg, 1)
    cfg.reuse_rollout_logprobs = "on"
    assert reuses_rollout_logprobs(cfg, 4)
    cfg.reuse_rollout_logprobs = "off"
    cfg.update_iters = 1
    assert not reuses_rollout_logprobs(cfg, 1)
    # a 16-bit KV cache makes the rollout's log-probs differ from the trainer's: auto recomputes them, on still reuses
    cfg.reuse_rollout_logprobs, cfg.kv_cache_dtype = "auto", "bfloat16"
    assert not reuses_rollout_logprobs(cfg, 1)
    cfg.kv_cache_dtype = "float32"
    assert reuses_rollout_logprobs(cfg, 1)
    cfg.reuse_rollout_logprobs, cfg.kv_cache_dtype = "on", "float16"
    assert reuses_rollout_logprobs(cfg, 1)


def grouped_batch(vocab, groups=3, n=4, response_len=10, seed=0):
    """Left-padded prompts of different lengths, each repeated n times, with ragged right-padded responses."""
    rng = np.random.default_rng(seed)
    width = 9
    prompt_ids, prompt_mask = np.zeros((groups, width), np.int64), np.zeros((groups, width), np.int64)
    for g in range(groups):
        length = 1 + g * 4
        prompt_ids[g, width - length:] = rng.integers(2, vocab, size=length)
        prompt_mask[g, width - length:] = 1
    response_ids = rng.integers(2, vocab, size=(groups * n, response_len))
    response_mask = np.ones((groups * n, response_len), np.float32)
    for i in range(groups * n):
        cut = rng.integers(1, response_len + 1)
        response_ids[i, cut:], response_mask[i, cut:] = 0, 0.0
    return step_batch(np.repeat(prompt_ids, n, 0), np.repeat(prompt_mask, n, 0), response_ids, response_mask,
                      np.repeat(np.arange(groups), n))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("micro", [12, 5])
def test_shared_prompt_pass_equals_full_pass(kind, micro, op_mode):
    """Running each distinct prompt once gives the full pass's log-probs, entropies and gradients, including
    micro-batches that cut groups apart (micro 5 of groups of 4) and responses of one token."""
    from paddle_rl.models.logprobs import token_logprobs
    model = make_model(kind)
    batch = grouped_batch(211)
    shared = batched_logprobs(model, batch, 0.7, micro, with_entropy=True, share_prompts=True)
    full = batched_logprobs(model, batch, 0.7, micro, with_entropy=True, share_prompts=False)
    np.testing.assert_allclose(shared[0], full[0], atol=2e-5)
    np.testing.assert_allclose(shared[1], full[1], atol=2e-5)
    assert batch.shared_prompts(slice(0, 5))[0].numpy().tolist() == [0, 4]
    assert batch.shared_prompts(slice(0, 5))[1].numpy().tolist() == [0, 0, 0, 0, 1]

    model.train()

    def gradients(rows, share):
        part = batch.tensors(rows)
        logp, entropy = token_logprobs(model, part["input_ids"], part["attention_mask"], batch.prompt_width,
                                       part["response_ids"], 0.7, True,
                                       batch.shared_prompts(rows) if share else None)
        loss = ((logp + 0.1 * entropy) * part["response_mask"]).sum()
        aux = model.aux_loss()  # MoE: the load-balancing loss counts each prompt once per row in both passes
        (loss if aux is None else loss + aux).backward()
        grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        model.clear_gradients()
        return grads

    rows = slice(2, 2 + micro)
    g_shared, g_full = gradients(rows, True), gradients(rows, False)
    for name in g_full:
        scale = np.abs(g_full[name]).max() + 1e-6
        np.testing.assert_allclose(g_shared[name] / scale, g_full[name] / scale, atol=1e-5, err_msg=name)

    one = step_batch(batch["prompt_tokens"], batch["prompt_mask"], batch["response_ids"][:, :1],
                     batch["response_mask"][:, :1], batch["group"])
    np.testing.assert_allclose(batched_logprobs(model, one, 0.7, 12, share_prompts=True),
                               batched_logprobs(model, one, 0.7, 12, share_prompts=False), atol=2e-5)


def test_recompute_in_training_takes_the_full_pass(monkeypatch):
    """Layer (or attention-block) recompute cannot share a prompt's keys/values across passes, so training with it
    runs the full pass, while evaluation, and training that recomputes only the attention core, keep the shared
    prompt prefix."""
    from paddle_rl.models.logprobs import token_logprobs
    model = make_model("qwen2")
    batch = grouped_batch(211)
    part = batch.tensors()
    calls = []
    original = CausalLM.shared_prompt_hidden_states
    monkeypatch.setattr(CausalLM, "shared_prompt_hidden_states",
                        lambda self, *a: calls.append(self.training) or original(self, *a))
    args = (model, part["input_ids"], part["attention_mask"], batch.prompt_width, part["response_ids"], 1.0)
    model.train()
    for granularity, shared in (("full", False), ("full_attn", False), ("core_attn", True), ("core_attn_mlp", True)):
        calls.clear()
        model.recompute = granularity
        token_logprobs(*args, shared_prompts=batch.shared_prompts())[0].sum().backward()
        assert calls == ([True] if shared else []), granularity   # core_attn keeps the shared prompt
    model.eval()
    calls.clear()
    with paddle.no_grad():
        token_logprobs(*args, shared_prompts=batch.shared_prompts())
    assert calls == [False]
    model.recompute = None

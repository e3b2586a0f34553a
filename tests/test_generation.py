"""KV-cached generation against full recomputation, and sampling that depends only on keys."""
import numpy as np
import paddle
import pytest

from paddle_rl.batch import StepBatch
from paddle_rl.models import CausalLM, ModelConfig
from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


@pytest.fixture(scope="module")
def model():
    paddle.seed(0)
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = CausalLM(cfg)
    m.init_weights(0.2)
    m.eval()
    return m


def full_logits(model, seq):
    return model(paddle.to_tensor([seq]))[0]


def test_greedy_matches_uncached_decoding(model):
    out = RolloutEngine(model, pad_id=0, eos_ids=[1]).generate(PROMPTS, 2, SamplingParams(max_dec_len=8, temperature=0))
    assert out.response_ids.shape == (6, 8)
    for r, prompt in enumerate(out.prompt_ids):
        seq = list(prompt)
        for _ in range(out.lengths[r]):
            seq.append(int(full_logits(model, seq)[-1].argmax()))
        assert seq[len(prompt):] == out.response_ids[r, :out.lengths[r]].tolist()
    # both samples of a prompt are identical under greedy decoding
    assert np.array_equal(out.response_ids[0], out.response_ids[1])


def record_batch_shapes(monkeypatch):
    """Records the token shapes the model's prefill (hidden_states) and decode steps (decode_step) receive."""
    shapes = {"prefill": [], "decode": []}
    prefill, decode = CausalLM.hidden_states, CausalLM.decode_step

    def recording_prefill(self, inputs, *args, **kwargs):
        shapes["prefill"].append(tuple(inputs.shape))
        return prefill(self, inputs, *args, **kwargs)

    def recording_decode(self, tokens, *args, **kwargs):
        shapes["decode"].append(tokens.shape[0])
        return decode(self, tokens, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "hidden_states", recording_prefill)
    monkeypatch.setattr(CausalLM, "decode_step", recording_decode)
    return shapes


def test_sampling_logprobs_match_full_forward_and_layout(model, monkeypatch):
    keys = [sample_key(1, 0, i // 4, i % 4) for i in range(12)]
    params = SamplingParams(max_dec_len=16, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)
    shapes = record_batch_shapes(monkeypatch)
    a = RolloutEngine(model, 0, [1]).generate(PROMPTS, 4, params, keys)
    # each prompt is prefilled once, unpadded (prompts of one length together); a row leaves the decode batch as
    # soon as it finishes, so every decode step runs only live rows: a row of L tokens is in L - 1 steps (its
    # last token needs none)
    assert shapes["prefill"] == [(1, 2), (1, 3), (1, 5)], shapes
    assert shapes["decode"][0] == 12 and shapes["decode"] == sorted(shapes["decode"], reverse=True), shapes
    assert sum(shapes["decode"]) == int((a.lengths - 1).sum()) == int(a.decode_steps.sum())
    assert len(set(a.lengths.tolist())) > 1  # rows do finish at different steps here
    # max_num_seqs caps the rows decoded together: 4 -> one prompt (x 4 samples) at a time, 8 -> two, the third
    # joining as soon as four rows have left (continuous batching)
    for max_num_seqs, prefills in ((4, [(1, 5), (1, 2), (1, 3)]), (8, [(1, 2), (1, 5), (1, 3)])):
        shapes["prefill"].clear()
        shapes["decode"].clear()
        b = RolloutEngine(model, 0, [1], max_num_seqs=max_num_seqs).generate(PROMPTS, 4, params, keys)
        assert shapes["prefill"] == prefills, (max_num_seqs, shapes)
        assert max(shapes["decode"]) == max_num_seqs, (max_num_seqs, shapes)
        assert sum(shapes["decode"]) == int((b.lengths - 1).sum())
        # the layout changes neither the tokens nor their log-probs, bit for bit (keys, not positions, decide):
        # every kernel of the decode is batch-invariant, the linear layers included (they multiply by packed
        # weights, each row summed in order; MKL's sgemm rounds a row differently with the number of rows)
        assert np.array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(b.rollout_logp, a.rollout_logp)
    assert len({tuple(r) for r in a.response_ids.tolist()}) > 3  # samples differ
    for r in range(12):
        seq = list(a.prompt_ids[r]) + a.response_ids[r, :a.lengths[r]].tolist()
        logp = paddle.nn.functional.log_softmax(full_logits(model, seq) / 0.8, -1).numpy()
        p = len(a.prompt_ids[r])
        expected = [logp[p - 1 + t, seq[p + t]] for t in range(a.lengths[r])]
        np.testing.assert_allclose(a.rollout_logp[r, :a.lengths[r]], expected, atol=1e-4)
    # a prompt sampled alone draws the same tokens as inside the batch (keys, not positions, decide)
    alone = RolloutEngine(model, 0, [1]).generate(PROMPTS[1:2], 4, params, keys[4:8])
    assert np.array_equal(alone.response_ids[:, :alone.response_ids.shape[1]],
                          a.response_ids[4:8, :alone.response_ids.shape[1]])


def rounded_cache_logprobs(model, seq, dtype, temperature):
    """log softmax(logits / T) of a full forward whose attention reads keys and values through a `dtype` cache."""
    from paddle_rl.models import attention_bias_from_mask
    ids = paddle.to_tensor([seq])
    positions = paddle.arange(len(seq), dtype="int64").unsqueeze(0)
    bias = attention_bias_from_mask(paddle.ones_like(ids), len(seq), causal=True)
    hidden = model.hidden_states(ids, positions, bias, model.new_cache(len(seq), dtype))
    return paddle.nn.functional.log_softmax(model.logits(hidden)[0] / temperature, -1).numpy()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_kv_cache(model, dtype):
    """kv_cache_dtype: keys and values are stored in 16 bits (half the cache's bytes). The rollout's log-probs equal
    a full forward that reads the same rounded keys and values (to 5e-4 for float16, 1e-3 for bfloat16), differ
    from the float32 cache's by the rounding, and the layout changes no token."""
    keys = [sample_key(1, 0, i // 4, i % 4) for i in range(12)]
    params = SamplingParams(max_dec_len=24, temperature=0.8)
    runs = {}
    for name, kw in {"float32": {}, dtype: dict(kv_cache_dtype=dtype),
                     "max_num_seqs=4": dict(kv_cache_dtype=dtype, max_num_seqs=4)}.items():
        engine = RolloutEngine(model, 0, [1], **kw)
        runs[name] = engine.generate(PROMPTS, 4, params, keys), engine.stats
    (half, stats), (full, full_stats) = runs[dtype], runs["float32"]
    # a full forward computes k and v in one GEMM over the sequence, the decode one row at a time: their ~1e-6
    # difference can tip a key across a rounding boundary (one 16-bit step: 2^-8 relative for bfloat16, 2^-11
    # for float16), so the agreement is bounded by that step (a float16 key one step off moved a log-prob by 2.5e-4)
    tol = 1e-3 if dtype == "bfloat16" else 5e-4
    cfg = model.config
    slot_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    assert stats["peak_kv_bytes"] == stats["peak_slots"] * slot_bytes * 2
    assert full_stats["peak_kv_bytes"] == full_stats["peak_slots"] * slot_bytes * 4
    for r in range(12):
        n = int(half.lengths[r])
        seq = list(half.prompt_ids[r]) + half.response_ids[r, :n].tolist()
        logp = rounded_cache_logprobs(model, seq, dtype, 0.8)
        p = len(half.prompt_ids[r])
        np.testing.assert_allclose(half.rollout_logp[r, :n], [logp[p - 1 + t, seq[p + t]] for t in range(n)],
                                   atol=tol)
    same = np.cumprod(half.response_ids == full.response_ids, axis=1).astype(bool)   # the tokens so far agree
    gap = np.abs(half.rollout_logp - full.rollout_logp)[same & (half.response_mask > 0)]
    print(dtype, "max log-prob gap to the float32 cache", gap.max())
    assert 1e-6 < gap.max() < 5e-2, gap.max()
    # the layout changes nothing, bit for bit (the decode is batch-invariant, see above)
    layout = runs["max_num_seqs=4"][0]
    assert np.array_equal(layout.response_ids, half.response_ids)
    np.testing.assert_array_equal(layout.rollout_logp, half.rollout_logp)


def test_stop_token_min_len_and_truncation(model):
    greedy = RolloutEngine(model, 0, []).generate(PROMPTS, 1, SamplingParams(max_dec_len=6, temperature=0))
    first = int(greedy.response_ids[0, 0])
    # the first greedy token is a stop token: the response ends there, not truncated
    out = RolloutEngine(model, 0, [first]).generate(PROMPTS[:1], 1, SamplingParams(max_dec_len=6, temperature=0))
    assert out.lengths[0] == 1 and not out.truncated[0] and out.response_mask[0].tolist() == [1.0]
    # banned until min_dec_len: the response runs on
    out = RolloutEngine(model, 0, [first]).generate(
        PROMPTS[:1], 1, SamplingParams(max_dec_len=6, min_dec_len=3, temperature=0))
    assert out.lengths[0] >= 3 and first not in out.response_ids[0, :3].tolist()
    assert greedy.truncated.all() and (greedy.lengths == 6).all()


def test_top_k_one_equals_greedy(model):
    keys = [sample_key(5, 1, i, 0) for i in range(3)]
    sampled = RolloutEngine(model, 0, [1]).generate(PROMPTS, 1, SamplingParams(max_dec_len=8, temperature=1.0,
                                                                               top_k=1), keys)
    greedy = RolloutEngine(model, 0, [1]).generate(PROMPTS, 1, SamplingParams(max_dec_len=8, temperature=0))
    assert np.array_equal(sampled.response_ids, greedy.response_ids)


def test_continuous_batching_is_layout_invariant(model):
    """Rows of very different lengths (an EOS schedule up to 200 tokens, past the cache's growth step): every
    layout of the rollout (rows decoded at once, KV budget, prompts split as over two ranks) gives the same tokens
    and log-probs; rows leave as they finish and waiting prompts join within the limits."""
    from paddle_rl.bench import ForcedLengths, keyed_schedule, long_tail_lengths

    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23], [30], [40, 41, 42, 43, 44, 45]]
    n = 4
    keys = [sample_key(3, 1, i // n, i % n) for i in range(len(prompts) * n)]
    expected = keyed_schedule(long_tail_lengths(len(keys), median=20, sigma=1.2, cap=200))(keys)
    by_key = {tuple(k.tolist()): int(length) for k, length in zip(keys, expected)}
    params = SamplingParams(max_dec_len=200, temperature=1.0)

    def run(prompt_rows=slice(None), **limits):
        engine = RolloutEngine(model, 0, [1], stages=[ForcedLengths(lambda ks: [by_key[tuple(k.tolist())] for k in ks])],
                               **limits)
        rows = range(len(prompts))[prompt_rows]
        out = engine.generate([prompts[i] for i in rows], n, params, [keys[i * n + j] for i in rows for j in range(n)])
        return out, engine.stats

    whole, stats = run()
    assert whole.lengths.tolist() == expected.tolist() and expected.max() == 200 and not whole.truncated.any()
    assert whole.decode_steps.tolist() == (whole.lengths - 1).tolist()   # a row is decoded only while it lives
    assert stats["peak_rows"] == len(keys) and stats["relayouts"] > 10
    layouts = {"max_num_seqs=4": dict(max_num_seqs=4), "max_num_seqs=16": dict(max_num_seqs=16),
               "kv budget": dict(max_cache_tokens=8 * (6 + 200))}
    for name, limits in layouts.items():
        out, s = run(**limits)
        assert s["peak_rows"] <= (limits.get("max_num_seqs") or 8) and s["prefills"] > 1, (name, s)
        assert np.array_equal(out.response_ids, whole.response_ids), name
        np.testing.assert_array_equal(out.rollout_logp, whole.rollout_logp, err_msg=name)
    halves = [run(slice(0, 3))[0], run(slice(3, 6))[0]]   # the prompts of two data-parallel ranks
    joined = StepBatch.concat(halves)
    assert np.array_equal(joined.response_ids, whole.response_ids)
    np.testing.assert_array_equal(joined.rollout_logp, whole.rollout_logp)
    # the longest row (past a cache regrowth and many compactions) against a full forward; the schedule bans the
    # stop token (id 1) before the row's length and allows only it at the end (log-prob 0)
    r = int(np.argmax(whole.lengths))
    seq = list(whole.prompt_ids[r]) + whole.response_ids[r].tolist()
    p = len(whole.prompt_ids[r])
    logits = full_logits(model, seq).numpy()
    logits[:, 1] = -np.inf
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(whole.rollout_logp[r], [logp[p - 1 + t, seq[p + t]] for t in range(199)] + [0.0],
                               atol=1e-4)


def test_scheduler_limits_are_checked(model):
    params = SamplingParams(max_dec_len=8, temperature=0)
    with pytest.raises(ValueError, match="rollout_kv_cache_tokens"):
        RolloutEngine(model, 0, [1], max_cache_tokens=10).generate(PROMPTS, 2, params)
    with pytest.raises(ValueError, match="rollout_max_num_seqs"):
        RolloutEngine(model, 0, [1], max_num_seqs=2).generate(PROMPTS, 4, params)


def _small_model(seed=3):
    paddle.seed(seed)
    m = CausalLM(ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    m.init_weights(0.2)
    m.eval()
    return m


def test_packed_rollout_weights():
    """The rollout's linear layers and tied head multiply by packed copies of their weights (ops.pack_weight):
    the forward equals the unpacked one to float rounding and reads the copies (not the weights), which exist
    only while packed_weights is on, and repack() makes them follow weights changed in between."""
    model = _small_model()
    ids = paddle.to_tensor([[5, 6, 7, 8, 9, 10]])
    plain = model(ids).numpy()
    down = model.layers[0].mlp.down_proj
    with model.packed_weights() as repack:
        assert down.packed is not None and model._packed_head is not None
        packed = model(ids).numpy()
        np.testing.assert_allclose(packed, plain, atol=1e-5)
        down.weight.set_value(down.weight * 1.5)
        np.testing.assert_array_equal(model(ids).numpy(), packed)   # the copy, not the weight, is multiplied by
        repack()
        changed = model(ids).numpy()
    assert down.packed is None and model._packed_head is None
    assert np.abs(changed - plain).max() > 1e-3
    np.testing.assert_allclose(changed, model(ids).numpy(), atol=1e-5)


def test_engine_repacks_weights_loaded_mid_generation():
    """Partial rollouts load new weights between decode steps (and bump `version`): the packed copies the next
    steps multiply by are the new weights'."""
    model = _small_model()
    down = model.layers[1].mlp.down_proj
    calls = []

    class Switch:   # a stage between decode steps, as the worker's partial rollout
        tags_versions = True

        def between_steps(self):
            calls.append(down.packed.numpy().copy())
            if len(calls) == 3:
                down.weight.set_value(down.weight * 2.0)
                engine.version += 1
                return True
            return False
    engine = RolloutEngine(model, 0, [1], stages=[Switch()])
    params = SamplingParams(max_dec_len=6, min_dec_len=6, temperature=1.0)
    engine.generate(PROMPTS[:1], 2, params, [sample_key(1, 0, 0, j) for j in range(2)])
    assert len(calls) >= 4
    np.testing.assert_array_equal(calls[3], calls[2] * 2.0)
    np.testing.assert_array_equal(calls[1], calls[2])


# measured max gaps on this model (its weights ~N(0, 0.2), so its logits are large): bfloat16 0.072, int8 0.195,
# both 0.204, int4 0.570
@pytest.mark.parametrize("rollout_dtype,quant,bounds", [("bfloat16", "", (0.02, 0.2)),
                                                        ("float32", "weight_only_int8", (0.05, 0.5)),
                                                        ("bfloat16", "weight_only_int8", (0.05, 0.5)),
                                                        ("float32", "weight_only_int4", (0.2, 2.0))])
def test_low_precision_rollout(model, rollout_dtype, quant, bounds):
    """rollout_dtype bfloat16 / rollout_quant_type: the rollout multiplies by rounded or quantized weights, so its
    log-probs leave float32's by a bounded amount (max gap over the tokens both runs share, in `bounds`), and they
    are the log-probs of that low-precision model: a full forward inside packed_weights(rollout_dtype, quant)
    gives them to 2e-3 (the full forward's float32 attention rounds differently from the decode's before the
    next layer rounds its activations to bfloat16). The layout changes no bit."""
    keys = [sample_key(1, 0, i // 4, i % 4) for i in range(12)]
    params = SamplingParams(max_dec_len=24, temperature=0.8)
    full = RolloutEngine(model, 0, [1]).generate(PROMPTS, 4, params, keys)
    engine = RolloutEngine(model, 0, [1], rollout_dtype=rollout_dtype, quant_type=quant)
    low = engine.generate(PROMPTS, 4, params, keys)
    same = np.cumprod(low.response_ids == full.response_ids, axis=1).astype(bool)
    gap = np.abs(low.rollout_logp - full.rollout_logp)[same & (low.response_mask > 0)]
    print(rollout_dtype, quant, "max log-prob gap to float32", gap.max(), "mean", gap.mean())
    assert bounds[0] < gap.max() < bounds[1], gap.max()
    with model.packed_weights(rollout_dtype, quant):
        for r in range(0, 12, 3):
            n = int(low.lengths[r])
            seq = list(low.prompt_ids[r]) + low.response_ids[r, :n].tolist()
            logp = paddle.nn.functional.log_softmax(full_logits(model, seq) / 0.8, -1).numpy()
            p = len(low.prompt_ids[r])
            np.testing.assert_allclose(low.rollout_logp[r, :n], [logp[p - 1 + t, seq[p + t]] for t in range(n)],
                                       atol=2e-3)
    layout = RolloutEngine(model, 0, [1], max_num_seqs=4, rollout_dtype=rollout_dtype,
                           quant_type=quant).generate(PROMPTS, 4, params, keys)
    np.testing.assert_array_equal(layout.rollout_logp, low.rollout_logp)


def test_rollout_precision_is_checked(model):
    with pytest.raises(ValueError, match="rollout_quant_type: must be '' .off., weight_only_int8 or weight_only_int4, "
                                         "got 'int8'"):
        RolloutEngine(model, 0, [1], quant_type="int8")
    with pytest.raises(ValueError, match="rollout_dtype: must be one of float32, bfloat16, got 'float16'"):
        RolloutEngine(model, 0, [1], rollout_dtype="float16")

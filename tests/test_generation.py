"""KV-cached generation against full recomputation, and sampling that depends only on keys."""
import numpy as np
import paddle
import pytest

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
    # one prefill of the 3 prompts (left-padded to 5), every decode step on all 12 samples
    assert shapes["prefill"] == [(3, 5)] and set(shapes["decode"]) == {12}, shapes
    # max_num_seqs caps the samples decoded together: 4 -> one prompt (x 4 samples) a chunk, 8 -> two
    for max_num_seqs, prefills in ((4, [(1, 5), (1, 2), (1, 3)]), (8, [(2, 5), (1, 3)])):
        shapes["prefill"].clear()
        shapes["decode"].clear()
        b = RolloutEngine(model, 0, [1], max_num_seqs=max_num_seqs).generate(PROMPTS, 4, params, keys)
        assert shapes["prefill"] == prefills, (max_num_seqs, shapes)
        assert shapes["decode"] and set(shapes["decode"]) == {4 * rows for rows, _ in prefills}, (max_num_seqs, shapes)
        # chunking changes neither the tokens nor their log-probs (keys, not positions, decide)
        assert np.array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(b.rollout_logp, a.rollout_logp, atol=1e-5)
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

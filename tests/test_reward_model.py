"""The neural reward model: sequence-classification checkpoints written by transformers score like transformers
(1e-4), through the reward model's own chat template (or src + response), combined with rule rewards."""
import json
import os
import shutil

import numpy as np
import pytest

from extras import extra
from paddle_rl.config import ConfigError, RLConfig, load_config
from paddle_rl.rewards import RewardSample, build_local_reward, check_reward_config
from paddle_rl.rewards.reward_model import NeuralReward

torch = extra("torch")
transformers = extra("transformers")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def reward_folder(request, micro, tmp_path_factory):
    """A tiny random *ForSequenceClassification (num_labels 1) saved by transformers, with the micro tokenizer."""
    tok = micro["tokenizer"]
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)}[request.param]
    torch.manual_seed(0)
    config = cls[0](vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id,
                    tie_word_embeddings=False)
    model = cls[1](config).eval()
    folder = tmp_path_factory.mktemp(f"rm_{request.param}")
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(micro["model"], name), folder / name)
    return str(folder), model, tok


def _hf_scores(model, tok, texts):
    ids = [tok.encode(t) for t in texts]
    width = max(map(len, ids))
    batch = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    for r, row in enumerate(ids):
        batch[r, :len(row)] = torch.tensor(row)
    with torch.no_grad():
        return model(input_ids=batch, attention_mask=(batch != tok.pad_token_id).long()).logits[:, 0].numpy()


def test_scores_equal_transformers_through_the_chat_template(reward_folder):
    folder, model, tok = reward_folder
    reward = NeuralReward(folder, batch_size=2)  # 5 samples: three batches, each padded to its own longest
    chat = [{"role": "user", "content": "Who is a knight?"}]
    samples = [RewardSample("ignored", " Zoey is a knight.", {"messages": chat}),
               RewardSample("ignored", " no idea", {"messages": chat + [{"role": "assistant", "content": "x"}]}),
               RewardSample("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "hello there",
                            {"src": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}),
               RewardSample("p", "a much longer response that goes on and on", {"prompt": chat}),
               RewardSample("q ", "short", {"src": "q "})]
    texts = [reward.text(s) for s in samples]
    # chat records: the reward model's own template with the response as the assistant turn (the record's own
    # trailing answer dropped); PaddleNLP src strings: src + response as they stand
    expected_chat = tok.apply_chat_template(chat + [{"role": "assistant", "content": " Zoey is a knight."}],
                                            add_generation_prompt=False)
    assert texts[0] == expected_chat and "no idea" in texts[1] and "\nx<" not in texts[1]
    assert texts[2] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there" and texts[4] == "q short"
    scores, correct = reward(samples)
    np.testing.assert_allclose(scores, _hf_scores(model, tok, texts), atol=1e-4)
    assert correct is None and len(set(np.round(scores, 5))) == 5
    # read at the last real token: the same text alone (no padding) scores the same
    np.testing.assert_allclose(reward([samples[4]])[0], scores[4:], atol=1e-5)


def test_combined_with_rules_by_weight(reward_folder):
    folder, model, tok = reward_folder
    config = RLConfig(reward_funcs=["reward_model", "format"], reward_weights=[2.0, 1.0],
                      reward_model_name_or_path=folder)
    check_reward_config(config)
    reward = build_local_reward(config)
    responses = ["<think>a</think>\n<answer>b</answer>", "no format"]
    samples = [RewardSample("q ", r, {"src": "q "}) for r in responses]
    result = reward(samples)
    rm = _hf_scores(model, tok, ["q " + r for r in responses])
    np.testing.assert_allclose(result.per_function["reward_model"], rm, atol=1e-4)
    np.testing.assert_allclose(result.scores, 2.0 * rm + np.array([1.0, 0.0]), atol=2e-4)


# the config requires an actor; never loaded here
ACTOR = {"actor_model_name_or_path": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "data", "tiny_arith", "model")}


def test_the_path_alone_scores_with_the_model(reward_folder):
    """PaddleNLP's switch: use_rm_server false + reward_model_name_or_path, no reward_funcs (default: a rule)."""
    folder, model, tok = reward_folder
    config = load_config(None, {**ACTOR, "use_rm_server": False, "reward_model_name_or_path": folder})
    assert config.reward_funcs == ["reward_model"] and config.reward_weights == []
    check_reward_config(config)
    responses = ["<think>a</think>\n<answer>b</answer>", "no format"]
    result = build_local_reward(config)([RewardSample("q ", r, {"src": "q "}) for r in responses])
    np.testing.assert_allclose(result.scores, _hf_scores(model, tok, ["q " + r for r in responses]), atol=1e-4)
    # an empty reward_funcs given: the model alone too
    assert load_config(None, {**ACTOR, "reward_funcs": [], "reward_model_name_or_path": folder}).reward_funcs == ["reward_model"]


def test_the_path_with_reward_funcs_adds_the_model_with_weight_1(reward_folder):
    folder, model, tok = reward_folder
    config = load_config(None, [f"actor_model_name_or_path={ACTOR['actor_model_name_or_path']}", "reward_funcs=[format]",
                                "reward_weights=[0.5]", f"reward_model_name_or_path={folder}"])
    assert config.reward_funcs == ["format", "reward_model"] and config.reward_weights == [0.5, 1.0]
    responses = ["<think>a</think>\n<answer>b</answer>", "no format"]
    result = build_local_reward(config)([RewardSample("q ", r, {"src": "q "}) for r in responses])
    rm = _hf_scores(model, tok, ["q " + r for r in responses])
    np.testing.assert_allclose(result.scores, rm + np.array([0.5, 0.0]), atol=2e-4)
    # listed with a weight of its own: kept as written
    listed = load_config(None, {**ACTOR, "reward_funcs": ["reward_model", "format"], "reward_weights": [2.0, 1.0],
                                "reward_model_name_or_path": folder})
    assert listed.reward_funcs == ["reward_model", "format"] and listed.reward_weights == [2.0, 1.0]
    # without weights every function weighs 1
    plain = load_config(None, {**ACTOR, "reward_funcs": ["format"], "reward_model_name_or_path": folder})
    assert plain.reward_funcs == ["format", "reward_model"] and plain.reward_weights == []


def test_bf16_scores_with_bf16_products(reward_folder):
    """`bf16: true` reaches the reward model: its decoder and score head take bfloat16 products (the head float32
    with use_fp32_compute), so its scores move from the float32 ones by bf16 rounding."""
    folder, model, tok = reward_folder
    responses = ["<think>a</think>\n<answer>b</answer>", "no format", "a longer answer of several words"]
    samples = [RewardSample("q ", r, {"src": "q "}) for r in responses]
    fp32 = _hf_scores(model, tok, ["q " + r for r in responses])
    gaps = {}
    for extra in ([], ["use_fp32_compute=true"]):
        config = load_config(None, [f"actor_model_name_or_path={ACTOR['actor_model_name_or_path']}", "bf16=true",
                                    f"reward_model_name_or_path={folder}", *extra])
        scores = build_local_reward(config)(samples).scores
        gaps[bool(extra)] = np.abs(scores - fp32).max() / np.abs(fp32).max()
    print("bf16 reward model: relative gap to float32", gaps)
    assert 1e-4 < gaps[False] < 5e-2 and 1e-4 < gaps[True] < 5e-2   # bf16 rounding, in the body either way
    reward = NeuralReward(folder, bf16=True, fp32_head=True)
    assert reward.model.bf16 == (True, False) and not reward.model.score.bf16
    assert NeuralReward(folder).model.bf16 == (False, False)


def test_errors_name_the_key_and_the_file(reward_folder, micro, tmp_path):
    folder, _, _ = reward_folder
    with pytest.raises(ConfigError, match="reward_model_name_or_path: set, but 'reward_model'"):
        check_reward_config(RLConfig(reward_funcs=["format"], reward_model_name_or_path=folder))
    with pytest.raises(ConfigError, match="'reward_model' needs reward_model_name_or_path"):
        check_reward_config(RLConfig(reward_funcs=["reward_model"]))
    with pytest.raises(ValueError, match="config.json is not a sequence classifier"):
        NeuralReward(micro["model"])
    two = tmp_path / "two_labels"
    shutil.copytree(folder, two)
    data = json.loads((two / "config.json").read_text())
    data["id2label"] = {"0": "A", "1": "B"}
    (two / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="2 labels"):
        NeuralReward(str(two))


def test_reward_server_hosts_it(reward_folder):
    """`paddle-rl reward-server --reward-model PATH`: the same scores through /v1/score as in process."""
    from test_reward_server import Server, post
    folder, model, tok = reward_folder
    server = Server("--reward-model", folder, "--workers", "1")
    try:
        server.wait()
        responses = ["hello there", "a longer answer here"]
        expected = _hf_scores(model, tok, ["q " + r for r in responses])
        r = post(server.url + "/v1/score", {"samples": [{"response": x, "prompt": "q "} for x in responses]})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["score"], expected, atol=1e-4)
        # the PaddleNLP protocol: src is already chat-formatted, the model reads src + response at its last token
        r = post(server.url + "/", {"src": ["q "] * 2, "tgt": ["", ""], "response": responses})
        assert r.status_code == 200 and r.json()["error_code"] == 0, r.text
        np.testing.assert_allclose(r.json()["score"], expected, atol=1e-4)
    finally:
        server.stop()

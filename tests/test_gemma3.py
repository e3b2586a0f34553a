"""Gemma 3 (`gemma3_text`) against transformers on a tiny random Gemma3ForCausalLM it saved: sliding-window layers
(window 5) among global ones, sequences longer than the window, left padding, separate rotary bases, norms stored
as offsets from 1 (random, so that 1 + w and w differ), the sandwich norms, q/k norms, GeLU-tanh MLP, scaled
embeddings, query_pre_attn_scalar and a final logit soft cap. Then greedy generation through our rollout engine
(its KV cache path honours the window), one RL step, and one with LoRA."""
import json
import os
import shutil

import numpy as np
import paddle
import pytest

from extras import extra

torch = extra("torch")
transformers = extra("transformers")

from micro_model import micro_overrides  # noqa: E402
from test_parallel import PLUGIN  # noqa: E402
from paddle_rl.config import load_config  # noqa: E402
from paddle_rl.models import ModelConfig, load_model, save_model  # noqa: E402
from paddle_rl.monitor import read_metrics  # noqa: E402
from paddle_rl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from paddle_rl.trainer import RLTrainer  # noqa: E402

WINDOW = 5
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma3(vocab_size=97, hidden=64, softcap=3.0, seed=0, pad=0, eos=1, bos=2):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=128, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=32, final_logit_softcapping=softcap,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        pad_token_id=pad, eos_token_id=eos, bos_token_id=bos)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (an offset from 1): random ones, so that every norm counts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _inputs(length=20):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 97, size=(3, length))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _hf_logits(model, ids, mask):
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.double().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    hf = gemma3()
    hf.save_pretrained(root / "hf")
    return root, hf


def test_logits_match_transformers(saved):
    root, hf = saved
    ids, mask = _inputs()
    valid = mask.astype(bool)
    expected32 = _hf_logits(hf, ids, mask)
    exact = gemma3().double()  # transformers in float64 on the same weights: the exact function
    exact.load_state_dict(hf.state_dict())
    expected64 = _hf_logits(exact, ids, mask)
    ours = load_model(str(root / "hf"))
    ours.eval()
    assert [layer.self_attn.window for layer in ours.layers] == [WINDOW, WINDOW, None, WINDOW]
    got = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy().astype(np.float64)
    ours_gap = np.abs(got[valid] - expected64[valid]).max()
    their_gap = np.abs(expected32[valid] - expected64[valid]).max()
    print(f"max |ours fp32 - transformers fp64| {ours_gap:.3g}; transformers fp32 - fp64 {their_gap:.3g}; "
          f"ours - transformers fp32 {np.abs(got[valid] - expected32[valid]).max():.3g}")
    # measured: ours 3.9e-7 from fp64, transformers' fp32 2.7e-7 (logits up to 1.5 under the soft cap 3)
    assert ours_gap < 2e-6
    assert np.abs(got[valid] - expected32[valid]).max() < 2e-6


def test_saved_folder_loads_in_transformers_and_older_config_layout(saved, tmp_path):
    root, hf = saved
    ids, mask = _inputs()
    valid = mask.astype(bool)
    expected = _hf_logits(hf, ids, mask)
    ours = load_model(str(root / "hf"))
    save_model(ours, str(tmp_path / "resaved"))
    back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "resaved").eval()
    assert back.config.layer_types == LAYER_TYPES and back.config.sliding_window == WINDOW
    assert np.abs(_hf_logits(back, ids, mask)[valid] - expected[valid]).max() < 1e-6
    # the Hub's older config.json: rope_theta and rope_local_base_freq at the top, sliding_window_pattern (every
    # 3rd layer global here: sliding, sliding, global, sliding, as LAYER_TYPES), no layer_types
    shutil.copytree(root / "hf", tmp_path / "old")
    data = json.loads((tmp_path / "old" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        data.pop(key)
    data.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window_pattern=3)
    (tmp_path / "old" / "config.json").write_text(json.dumps(data))
    old = load_model(str(tmp_path / "old"))
    old.eval()
    assert [layer.self_attn.window for layer in old.layers] == [WINDOW, WINDOW, None, WINDOW]
    got = old(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(got[valid] - expected[valid]).max() < 2e-6


@pytest.mark.parametrize("data,message", [
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 is not supported"),
    (dict(layer_types=["sliding_attention"]), "layer_types must list"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "rope_parameters.sliding_attention.rope_type 'linear'"),
])
def test_unsupported_settings_are_named(data, message):
    base = dict(model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**base, **data})


def test_greedy_tokens_through_the_rollout_engine(saved):
    """Prompts longer than the window and 16 new tokens: the engine's prefill and its decode steps (KV cache,
    window applied by each row's start slot) give transformers' greedy tokens."""
    root, hf = saved
    ours = load_model(str(root / "hf"))
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 97, size=n)) for n in (3, 9, 9, 14)]
    out = RolloutEngine(ours, pad_id=0, eos_ids=[]).generate(prompts, 1, SamplingParams(max_dec_len=16,
                                                                                          temperature=0))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert out["response_ids"][row][:16].tolist() == theirs, row


@pytest.fixture(scope="module")
def gemma_micro(micro, tmp_path_factory):
    """The micro KK data and tokenizer with a tiny Gemma 3 in place of the micro Qwen2 model."""
    folder = tmp_path_factory.mktemp("gemma_micro") / "model"
    tok = micro["tokenizer"]
    hf = gemma3(vocab_size=tok.vocab_size, softcap=None, pad=tok.pad_token_id, eos=tok.eos_token_id,
                bos=tok.eos_token_id)
    hf.save_pretrained(folder)
    for name in os.listdir(micro["model"]):
        if name.startswith("tokenizer") or name == "chat_template.jinja":
            shutil.copy(os.path.join(micro["model"], name), folder / name)
    return dict(micro, model=str(folder))


@pytest.mark.parametrize("lora", [False, True])
def test_one_rl_step(gemma_micro, tmp_path, lora):
    extra_keys = dict(lora_rank=4, lora_alpha=8) if lora else {}
    plugin = tmp_path / "reward.py"
    plugin.write_text(PLUGIN)  # rewards that differ within a group (a random model's KK answers all score 0)
    trainer = RLTrainer(load_config(None, micro_overrides(gemma_micro, str(tmp_path / "run"), do_eval=False,
                                                          max_steps=1, save_steps=5, learning_rate=1e-2,
                                                          reward_plugins=str(plugin), reward_funcs="length_parity",
                                                          **extra_keys)))
    assert trainer.actor.config.model_type == "gemma3_text"
    before = {n: p.numpy().copy() for n, p in trainer.actor.named_parameters()}
    trainer.train()
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert len(rows) == 1 and np.isfinite(rows[0]["actor/pg_loss"]) and rows[0]["actor/pg_loss"] != 0
    moved = {n for n, p in trainer.actor.named_parameters() if not np.array_equal(before[n], p.numpy())}
    if lora:
        assert moved and all("lora" in n for n in moved)
    else:  # every norm (offsets included) and the tied embedding take gradients
        assert any("pre_feedforward_layernorm" in n for n in moved) and any("embed_tokens" in n for n in moved)


def test_packing_with_sliding_windows_is_named_before_the_model_loads(gemma_micro, tmp_path):
    """use_remove_padding cannot pack sliding-window layers: the run names it with its other prerequisites, before
    any model loads (not at the first packed pass)."""
    from paddle_rl.config import ConfigError
    from paddle_rl.trainer.preflight import preflight
    config = load_config(None, micro_overrides(gemma_micro, str(tmp_path / "run"), use_remove_padding=True))
    with pytest.raises(ConfigError, match=r"use_remove_padding: packed micro-batches do not implement sliding-window "
                                          r"attention \(this model has layers with sliding_window \d+\)"):
        preflight(config)
    config.use_remove_padding = False
    preflight(config)

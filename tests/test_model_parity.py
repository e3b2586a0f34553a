"""Logits of our decoder equal Hugging Face transformers' on tiny random checkpoints it saved."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paddle_rl.models import load_model, save_model  # noqa: E402
import paddle  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)


def _hf_model(kind, tie):
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=tie)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=tie)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=tie)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=tie)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random (non-trivial) norms and biases too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 97, size=(3, 11))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen2", True), ("qwen3", False), ("llama", False),
                                      ("llama", True), ("mistral", False)])
def test_logits_match_transformers(tmp_path, kind, tie):
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids, mask = _inputs()
    with torch.no_grad():
        pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.numpy()
    ours = load_model(str(tmp_path / "hf"))
    ours.eval()
    out = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    valid = mask.astype(bool)
    assert np.abs(out[valid] - ref[valid]).max() <= 1e-4

    save_model(ours, str(tmp_path / "resaved"))
    back = type(hf).from_pretrained(tmp_path / "resaved").eval()
    with torch.no_grad():
        again = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.numpy()
    assert np.abs(again[valid] - ref[valid]).max() <= 1e-5


def test_rope_parameters_as_transformers_5_writes_them(tmp_path):
    """transformers 5 writes `rope_parameters: {rope_theta, rope_type}` instead of a top-level rope_theta; a theta
    other than the default must be read from there (it was silently replaced by 10000 before)."""
    cfg = transformers.LlamaConfig(**dict(COMMON, rope_theta=100000.0))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids, mask = _inputs()
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.numpy()
    ours = load_model(str(tmp_path / "hf"))
    assert ours.config.rope_theta == 100000.0
    out = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(out[mask.astype(bool)] - ref[mask.astype(bool)]).max() <= 1e-4


def test_sharded_checkpoint_roundtrip(tmp_path):
    hf = _hf_model("qwen2", False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_model(str(tmp_path / "hf"))
    ids, mask = _inputs()
    ref = load_model(str(tmp_path / "hf"))
    save_model(ours, str(tmp_path / "ours"), max_shard_bytes=50_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    again = load_model(str(tmp_path / "ours"))
    a = ref(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    b = again(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.array_equal(a, b)


def test_bf16_checkpoint_loads(tmp_path):
    hf = _hf_model("qwen2", False).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_model(str(tmp_path / "hf"))
    expected = hf.model.embed_tokens.weight.detach().float().numpy()
    assert np.array_equal(ours.embed_tokens.weight.numpy(), expected)


def test_missing_checkpoint_file_is_named(tmp_path):
    hf = _hf_model("qwen2", False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path / "hf"))

"""Logits of our decoder equal Hugging Face transformers' on tiny random checkpoints it saved."""
import numpy as np
import pytest

from extras import extra  # noqa: E402

torch = extra("torch")
transformers = extra("transformers")

from paddle_rl.models import ModelConfig, load_model, load_weights, save_model, unfilled  # noqa: E402
from paddle_rl.models.decoder import CausalLM  # noqa: E402
from paddle_rl.models.lora import LoraSettings, add_adapters  # noqa: E402
import paddle  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
# llama3 scaling on a context of 16: positions up to 40 reach past it, and every frequency band is exercised
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True)
LONG = ("llama3", "llama_linear")  # kinds run on 40-token sequences


def _hf_model(kind, tie):
    no_theta = {k: v for k, v in COMMON.items() if k != "rope_theta"}
    if kind == "qwen2_moe":  # layers 1 and 3 sparse (decoder_sparse_step 2), a shared expert, top-k not renormalized
        cfg = transformers.Qwen2MoeConfig(**dict(COMMON, num_hidden_layers=4), **MOE, decoder_sparse_step=2,
                                          shared_expert_intermediate_size=48, norm_topk_prob=False,
                                          tie_word_embeddings=tie)
        cls = transformers.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":  # layers 0 and 2 sparse (mlp_only_layers [1]), q/k norm, top-k renormalized
        cfg = transformers.Qwen3MoeConfig(**dict(COMMON, num_hidden_layers=3), **MOE, head_dim=24, mlp_only_layers=[1],
                                          norm_topk_prob=True, tie_word_embeddings=tie)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**no_theta, rope_parameters=dict(LLAMA3), tie_word_embeddings=tie)
        cls = transformers.LlamaForCausalLM
    elif kind == "llama_linear":
        cfg = transformers.LlamaConfig(**no_theta, rope_parameters=dict(rope_type="linear", factor=2.5,
                                                                         rope_theta=10000.0), tie_word_embeddings=tie)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
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
            elif name.endswith("mlp.gate.weight"):  # routers far from uniform: no near-ties in the top-k
                p.normal_(0.0, 0.5)
    return model


def _inputs(length=11):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 97, size=(3, length))
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("qwen2", True), ("qwen3", False), ("llama", False),
                                      ("llama", True), ("mistral", False), ("llama3", False), ("llama_linear", True),
                                      ("qwen2_moe", False), ("qwen3_moe", True)])
def test_logits_match_transformers(tmp_path, kind, tie):
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids, mask = _inputs(40 if kind in LONG else 11)
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


@pytest.mark.parametrize("tie", [False, True])
def test_models_are_built_unfilled_and_loaded_to_the_same_bits(tmp_path, tie):
    """load_model builds the model unfilled (no initializer runs, no memory until a value is set): every parameter
    then holds the checkpoint's bits, as in a model built with its initializers and loaded over them. A load that
    leaves a parameter of an unfilled model without a value stops, naming it (here: a LoRA adapter, which holds the
    adapters only, loaded onto an unfilled base)."""
    hf = _hf_model("qwen2", tie)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    folder = str(tmp_path / "hf")
    config = ModelConfig.from_pretrained(folder)
    empty = unfilled(config)
    assert [p._is_initialized() for p in empty.parameters()] == [False] * len(empty.parameters())
    filled = CausalLM(config)
    assert all(p._is_initialized() for p in filled.parameters())
    load_weights(filled, folder)
    ours = load_model(folder)
    names = [n for n, _ in filled.named_parameters()]
    assert names == [n for n, _ in ours.named_parameters()] and len(names) == (16 if tie else 17)
    for (name, a), b in zip(filled.named_parameters(), ours.parameters()):
        assert np.array_equal(a.numpy(), b.numpy()), name
    ids, mask = _inputs()
    assert np.array_equal(ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy(),
                          filled(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy())
    lora = LoraSettings(rank=2, alpha=4.0, target_modules=("q_proj",))
    save_model(load_model(folder, lora=lora), str(tmp_path / "adapter"))
    base = unfilled(config)
    add_adapters(base, lora)
    with pytest.raises(ValueError, match=r"adapter.*: parameters left without a value: embed_tokens.weight, "):
        load_weights(base, str(tmp_path / "adapter"))


def test_missing_checkpoint_file_is_named(tmp_path):
    hf = _hf_model("qwen2", False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path / "hf"))


# --------------------------------------------------------------------------------------------- rope scaling

def _config(**extra):
    return ModelConfig.from_dict(dict(COMMON, model_type="llama", **extra))


@pytest.mark.parametrize("extra,message", [
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), r"rope_parameters\.rope_type 'yarn'"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), r"rope_parameters\.rope_type 'dynamic'"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), r"rope_scaling\.type 'dynamic'"),
    (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), r"rope_scaling\.rope_type 'longrope'"),
    (dict(rope_parameters=dict(LLAMA3, low_freq_factor=None)), r"needs rope_parameters\.low_freq_factor"),
    (dict(rope_scaling=dict(rope_type="linear")), r"needs rope_scaling\.factor"),
    (dict(rope_parameters=dict(LLAMA3), rope_scaling=dict(rope_type="linear", factor=2.0)), "contradicts"),
])
def test_unsupported_rope_scaling_is_an_error(extra, message):
    """A rope type the decoder does not implement (or lacking its settings) is an error naming the key, never the
    plain rotary embedding in its place."""
    with pytest.raises(ValueError, match=message):
        _config(**extra)


def test_rope_scaling_read_from_either_key():
    new = _config(rope_parameters=dict(LLAMA3)).rope
    legacy = _config(rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"}).rope
    assert new == legacy == dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16.0)
    assert _config(rope_scaling=dict(type="linear", factor=2.0)).rope == dict(rope_type="linear", factor=2.0)
    assert _config(rope_parameters=dict(rope_type="default", rope_theta=1e4)).rope is None
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers
    no_context = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert _config(rope_parameters=no_context).rope["original_max_position_embeddings"] == 128.0


def test_llama3_rope_scaling_as_older_configs_write_it(tmp_path):
    """Llama 3.1 checkpoints carry `rope_scaling` and a top-level rope_theta (no rope_parameters): same logits;
    and the scaling matters at these lengths (the plain rotary embedding is far off)."""
    import json
    hf = _hf_model("llama3", False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = rope
    path.write_text(json.dumps(data))
    ids, mask = _inputs(40)
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.numpy()
    ours = load_model(str(tmp_path / "hf"))
    valid = mask.astype(bool)
    out = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(out[valid] - ref[valid]).max() <= 1e-4
    plain = ours.config
    plain.rope_scaling = None
    unscaled = load_model(str(tmp_path / "hf"), config=plain)(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(unscaled[valid] - ref[valid]).max() > 1e-3  # 10x the tolerance above


# --------------------------------------------------------------------------------------------- Mixture of Experts

def _per_expert(name, tensor):
    """transformers' fused expert tensors under the per-expert names it writes to checkpoints."""
    prefix, kind = name.rsplit(".", 1)
    out = {}
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = np.split(tensor[e], 2, axis=0)
            out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
    return out


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_moe_aux_loss_and_gradients_match_transformers(tmp_path, kind):
    """The load-balancing loss (transformers' aux_loss, padding excluded) and the gradients of logits + aux loss
    through routers, experts, the shared expert and its gate."""
    hf = _hf_model(kind, False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids, mask = _inputs()
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    weights = np.random.default_rng(1).normal(size=(3, 11, 97)).astype(np.float32) * mask[..., None]
    hf.train()  # dropout is 0; gradients on
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    ((out.logits * torch.tensor(weights)).sum() + out.aux_loss).backward()
    expected = {}
    for name, p in hf.named_parameters():
        grad = p.grad.numpy()
        expected.update(_per_expert(name, grad) if grad.ndim == 3 else {f"{name}": grad})

    ours = load_model(str(tmp_path / "hf"))
    ours.train()
    logits = ours(paddle.to_tensor(ids), paddle.to_tensor(mask))
    aux = ours.aux_loss()
    assert abs(float(aux) - out.aux_loss.item()) <= 1e-5, (float(aux), out.aux_loss.item())
    assert ours.router_aux_loss_coef == 0.001  # output_router_logits: in the training loss (trainer/loop.py)
    ((logits * paddle.to_tensor(weights)).sum() + aux).backward()
    got = {}
    for _, param in ours.named_parameters():
        grad = np.zeros(param.shape, np.float32) if param.grad is None else param.grad.numpy()  # an idle expert
        got.update(param.spec.to_hf(grad))
    assert set(got) == set(expected)
    assert any(".experts.3." in k for k in got)
    assert any("shared_expert_gate" in k for k in got) == (kind == "qwen2_moe")
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-6
        assert np.abs(got[name] - expected[name]).max() / scale <= 1e-4, name


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_moe_fused_expert_layout_loads(tmp_path, kind):
    """transformers also loads experts stored as fused 3-D tensors (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I]); so does load_model, to the same model."""
    import shutil
    from paddle_rl.model_files.safetensors_io import load_state, save_state
    hf = _hf_model(kind, False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    state = load_state(str(tmp_path / "hf"))
    fused = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in state:
            continue  # a dense layer
        fused[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([state[f"{prefix}.{e}.gate_proj.weight"],
                                                                    state[f"{prefix}.{e}.up_proj.weight"]])
                                                    for e in range(4)])
        fused[f"{prefix}.down_proj"] = np.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in range(4)])
    (tmp_path / "fused").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "fused" / "config.json")
    save_state(str(tmp_path / "fused"), fused)
    ids, mask = _inputs()
    a = load_model(str(tmp_path / "hf"))(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    b = load_model(str(tmp_path / "fused"))(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.array_equal(a, b)
    back = type(hf).from_pretrained(tmp_path / "fused").eval()  # the layout is one transformers reads too
    with torch.no_grad():
        assert torch.equal(back(input_ids=torch.tensor(ids)).logits, hf.eval()(input_ids=torch.tensor(ids)).logits)

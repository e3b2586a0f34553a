"""bf16: true: the linear layers' three products from bfloat16-rounded operands with float32 sums (ops.bf16_linear),
float32 master weights, the LM head's precision under use_fp32_compute, the rollout following, and checkpoints
written in save_dtype that resume exactly."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from micro_model import config_file, micro_overrides, train_process
from paddle_rl import ops
from paddle_rl.config import load_config
from paddle_rl.models import CausalLM, load_model
from paddle_rl.models.config import ModelConfig
from paddle_rl.models.critic import head_values
from paddle_rl.models.decoder import attention_bias_from_mask
from paddle_rl.models.lora import LoraSettings, add_adapters
from paddle_rl.model_files.safetensors_io import load_state
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
from paddle_rl.trainer import RLTrainer
from paddle_rl.trainer.state_files import read_state
from paddle_rl.trainer.precision import FP32_UNDER_BF16, AmpBf16, EmulatedBf16, Float32, precision_for


def bf16_round(a: np.ndarray) -> np.ndarray:
    """REFERENCE.md: round to nearest even on the float's bits, back to float32 (bits << 16)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("path", ["kernel", "emulated"])
def test_bf16_linear_products_are_bf16_operands_with_fp32_sums(path, monkeypatch):
    """y = x W, dx = dy W^T, dW = x^T dy equal NumPy's products of bf16-rounded operands summed in float64 (within
    float32 summation-order rounding), and differ from float32's by a bounded, nonzero amount: through the bf16
    matmul kernel this CPU has (the emulation where it has none) and through the emulation forced."""
    if path == "emulated":
        monkeypatch.setenv("PADDLE_RL_BF16_EMULATE", "1")
    rng = np.random.default_rng(0)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ([3, 5, 64], [64, 48], [3, 5, 48]))
    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    print("bf16 kernel:", ops.bf16_kernel(xt, wt))
    assert (ops.bf16_kernel(xt, wt) == "emulated") == (path == "emulated" or not ops.bf16_kernels())
    y = ops.bf16_linear(xt, wt)
    y.backward(paddle.to_tensor(dy))
    xr, wr, dyr = bf16_round(x).astype(np.float64), bf16_round(w).astype(np.float64), bf16_round(dy).astype(np.float64)
    expected = {"y": xr @ wr, "dx": dyr @ wr.T, "dw": xr.reshape(-1, 64).T @ dyr.reshape(-1, 48)}
    fp32 = {"y": x @ w, "dx": dy @ w.T, "dw": x.reshape(-1, 64).T @ dy.reshape(-1, 48)}
    got = {"y": y.numpy(), "dx": xt.grad.numpy(), "dw": wt.grad.numpy()}
    for name in got:
        assert got[name].shape == expected[name].shape, name
        scale = np.abs(expected[name]).max()
        exact_gap = np.abs(got[name] - expected[name]).max() / scale
        fp32_gap = np.abs(got[name] - fp32[name]).max() / scale
        print(name, "gap to bf16 reference", exact_gap, "to float32", fp32_gap)
        assert exact_gap < 1e-6, name          # float32 sums of exact products: summation order only
        assert 1e-4 < fp32_gap < 3e-2, name     # bf16 operands: 8 significant bits, not float32's


@pytest.mark.parametrize("path", ["kernel", "emulated"])
def test_bf16_linear_keeps_its_input_for_the_backward_in_bfloat16(path, monkeypatch):
    """What bf16_linear keeps for the backward: x as its bfloat16 rounding (half float32's bytes) and the weight
    parameter itself, no float32 copy of either; nothing of x when W takes no gradient. The weight gradient is the
    product of the float32 x, bit for bit (the rounding the product makes anyway)."""
    if path == "emulated":
        monkeypatch.setenv("PADDLE_RL_BF16_EMULATE", "1")
    rng = np.random.default_rng(2)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ([3, 5, 64], [64, 48], [3, 5, 48]))
    saved = []

    def keep(t):
        saved.append(t)
        return t

    xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
    with paddle.autograd.saved_tensors_hooks(keep, lambda t: t):
        y = ops.bf16_linear(xt, wt)
    assert [(t.dtype, list(t.shape)) for t in saved] == [(paddle.bfloat16, [3, 5, 64]), (paddle.float32, [64, 48])]
    assert np.array_equal(saved[0].astype("float32").numpy(), bf16_round(x)) and saved[1] is wt
    y.backward(paddle.to_tensor(dy))
    expected = ops.bf16_matmul(paddle.to_tensor(x.reshape(-1, 64)), paddle.to_tensor(dy.reshape(-1, 48)),
                               trans_a=True)
    assert np.array_equal(wt.grad.numpy(), expected.numpy())
    saved.clear()
    frozen = paddle.to_tensor(w)
    xt = paddle.to_tensor(x, stop_gradient=False)
    with paddle.autograd.saved_tensors_hooks(keep, lambda t: t):
        y = ops.bf16_linear(xt, frozen)
    assert [t.dtype for t in saved] == [paddle.float32] and saved[0] is frozen  # the weight only
    y.backward(paddle.to_tensor(dy))
    assert list(xt.grad.shape) == [3, 5, 64]


def test_the_bf16_reference_keeps_its_linear_weights_in_bfloat16(micro, tmp_path):
    """bf16: the frozen reference stores its decoder linear layers' weights as their bfloat16 rounding (the
    embedding, an untied LM head, norms and biases stay float32) and gives the log-probs of the same model kept in
    float32, bit for bit (its products round the weights to bfloat16 anyway). The trained actor stays float32."""
    trainer = RLTrainer(load_config(None, _overrides(micro, tmp_path, bf16="true", kl_loss_coeff=0.04)))
    stored = {name: p.dtype for name, p in trainer.reference.named_parameters()}
    linears = {n for n in stored if n.endswith("proj.weight")}
    assert linears and all(stored[n] == paddle.bfloat16 for n in linears)
    assert all(dtype == paddle.float32 for n, dtype in stored.items() if n not in linears)
    assert all(p.dtype == paddle.float32 for p in trainer.actor.parameters())
    kept = load_model(micro["model"])  # the same weights in float32, computing in bf16
    kept.eval()
    kept.set_bf16(True, True)
    for name, p in kept.named_parameters():
        ref = dict(trainer.reference.named_parameters())[name]
        assert np.array_equal(ref.astype("float32").numpy(), bf16_round(p.numpy()) if name in linears else p.numpy())
    ids = paddle.to_tensor([[3, 7, 11, 2, 5, 9, 4, 1]])
    bias = attention_bias_from_mask(paddle.ones_like(ids), 8, causal=True)
    with paddle.no_grad():
        out = [m.head_logprobs(m.hidden_states(ids, paddle.arange(8).unsqueeze(0), bias), ids, 1.0)[0].numpy()
               for m in (trainer.reference, kept)]
    assert np.array_equal(out[0], out[1])


@pytest.mark.parametrize("kernel", list(ops.BF16_KERNELS) + ["emulated"])
def test_bf16_matmul_paths_equal_the_rounded_product(kernel, monkeypatch):
    """Each path of bf16_matmul (the AMX and AVX512-BF16 kernels where this CPU has them, the emulation forced by
    PADDLE_RL_BF16_EMULATE) gives op(A) op(B) of the bf16-rounded operands within float32 summation rounding
    (|error| <= K 2^-24 sum_k |a_k b_k|, per element), for all four transposes and sizes off the kernels' blocks;
    a kernel's product from B packed once (bf16_pack_b, bf16_matmul_packed) gives the same bits."""
    if kernel == "emulated":
        monkeypatch.setenv("PADDLE_RL_BF16_EMULATE", "1")
    elif kernel not in ops.bf16_kernels():
        pytest.skip(f"{kernel} is not usable here (usable: {ops.bf16_kernels() or 'none'})")
    rng = np.random.default_rng(3)
    for m, n, k in ((37, 45, 67), (70, 33, 301), (1, 16, 2)):
        for trans_a in (False, True):
            for trans_b in (False, True):
                a = rng.standard_normal([k, m] if trans_a else [m, k]).astype(np.float32)
                b = rng.standard_normal([n, k] if trans_b else [k, n]).astype(np.float32)
                at, bt = paddle.to_tensor(a), paddle.to_tensor(b)
                if kernel == "emulated":
                    assert ops.bf16_kernel(at, bt) == "emulated"
                    got = ops.bf16_matmul(at, bt, trans_a, trans_b).numpy()
                else:
                    got = ops.bf16_matmul_fused(at, bt, trans_a, trans_b, kernel=kernel).numpy()
                    # B packed once (the LM head's weight over its chunks): the same bits
                    packed = ops.bf16_pack_b(bt, trans_b)
                    np.testing.assert_array_equal(ops.bf16_matmul_packed(at, packed, trans_a, kernel=kernel).numpy(),
                                                  got)
                ar, br = bf16_round(a).astype(np.float64), bf16_round(b).astype(np.float64)
                ar, br = (ar.T if trans_a else ar), (br.T if trans_b else br)
                expected, magnitude = ar @ br, np.abs(ar) @ np.abs(br)
                assert got.shape == (m, n)
                excess = np.abs(got - expected) - k * 2.0 ** -24 * magnitude
                assert excess.max() <= 1e-30, (m, n, k, trans_a, trans_b, excess.max())
                fp32 = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
                assert np.abs(got - fp32).max() > 1e-3 * np.abs(fp32).max()   # bf16 operands, not float32's


@pytest.mark.parametrize("kernel", list(ops.BF16_KERNELS))
def test_bf16_matmul_accumulate_adds_the_product_in_place(kernel):
    """bf16_matmul_accumulate(c, a, b) makes c + op(a) op(b) in c's own memory (the LM head's weight gradient over
    its chunks), within float32 summation rounding of the rounded operands' product plus c, for the four transposes
    and sizes off the kernels' blocks (tiles staged at the edges start from c too); c = 0 gives bf16_matmul's bits."""
    if kernel not in ops.bf16_kernels():
        pytest.skip(f"{kernel} is not usable here (usable: {ops.bf16_kernels() or 'none'})")
    rng = np.random.default_rng(21)
    for m, n, k in ((37, 45, 67), (70, 33, 301), (64, 64, 32), (1, 16, 2)):
        for trans_a in (False, True):
            for trans_b in (False, True):
                a = rng.standard_normal([k, m] if trans_a else [m, k]).astype(np.float32)
                b = rng.standard_normal([n, k] if trans_b else [k, n]).astype(np.float32)
                c0 = rng.standard_normal([m, n]).astype(np.float32) * 4
                c = paddle.to_tensor(c0)
                address = c.data_ptr()
                out = ops.bf16_matmul_accumulate(c, paddle.to_tensor(a), paddle.to_tensor(b), trans_a, trans_b,
                                                 kernel=kernel)
                assert out is c and c.data_ptr() == address
                ar, br = bf16_round(a).astype(np.float64), bf16_round(b).astype(np.float64)
                ar, br = (ar.T if trans_a else ar), (br.T if trans_b else br)
                expected = c0.astype(np.float64) + ar @ br
                bound = (k + 1) * 2.0 ** -24 * (np.abs(c0) + np.abs(ar) @ np.abs(br))
                assert (np.abs(c.numpy() - expected) - bound).max() <= 1e-30, (m, n, k, trans_a, trans_b)
                zero = paddle.zeros([m, n], "float32")
                ops.bf16_matmul_accumulate(zero, paddle.to_tensor(a), paddle.to_tensor(b), trans_a, trans_b,
                                           kernel=kernel)
                np.testing.assert_array_equal(zero.numpy(), ops.bf16_matmul_fused(
                    paddle.to_tensor(a), paddle.to_tensor(b), trans_a, trans_b, kernel=kernel).numpy())


def test_lm_head_logprobs_bf16_matches_its_definition():
    """The chunked LM-head log-probs with bf16 (forward and both gradients) equal plain autograd over the
    bf16-rounded products, and differ from the float32 head."""
    rng = np.random.default_rng(1)
    h, w = rng.standard_normal([6, 32]).astype(np.float32), rng.standard_normal([40, 32]).astype(np.float32) * 0.3
    labels = paddle.to_tensor(rng.integers(0, 40, 6))
    out = {}
    for name, fn in (("chunked", lambda a, b, bf: ops.lm_head_logprobs(a, b, labels, 1.0, transpose_weight=True,
                                                                       chunk_rows=4, bf16=bf)),
                     ("reference", lambda a, b, bf: ops.lm_head_logprobs_reference(a, b, labels, 1.0,
                                                                                   transpose_weight=True, bf16=bf))):
        for bf in (True, False):
            a, b = paddle.to_tensor(h, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
            logp, _ = fn(a, b, bf)
            logp.sum().backward()
            out[name, bf] = (logp.numpy(), a.grad.numpy(), b.grad.numpy())
    for i in range(3):
        np.testing.assert_allclose(out["chunked", True][i], out["reference", True][i], rtol=1e-5, atol=1e-5)
        assert np.abs(out["chunked", True][i] - out["chunked", False][i]).max() > 1e-4


def test_use_fp32_compute_keeps_the_lm_head_in_float32(micro):
    """bf16 puts every linear layer on bf16 products; the LM head too unless use_fp32_compute, and the logits say
    so: with the head in bf16 they equal the product of the rounded operands, in float32 they do not."""
    model = load_model(micro["model"])
    ids = paddle.to_tensor([[3, 7, 11, 2, 5]])
    base = model(ids).numpy()
    for fp32_head in (False, True):
        strategy = precision_for(load_config(None, [f"actor_model_name_or_path={micro['model']}", "bf16=true",
                                                    f"use_fp32_compute={str(fp32_head).lower()}"]))
        assert isinstance(strategy, EmulatedBf16)
        strategy.prepare_model(model)
        assert model.bf16 == (True, not fp32_head)
        weight, transposed = model.head_weight
        hidden = model.hidden_states(ids, paddle.arange(5).unsqueeze(0),
                                     attention_bias_from_mask(paddle.ones_like(ids), 5, causal=True))
        w = weight.numpy().T if transposed else weight.numpy()
        logits = model.logits(hidden).numpy()
        head_bf16 = (bf16_round(hidden.numpy()).astype(np.float64) @ bf16_round(w).astype(np.float64))
        head_fp32 = hidden.numpy().astype(np.float64) @ w.astype(np.float64)
        gap_bf16, gap_fp32 = np.abs(logits - head_bf16).max(), np.abs(logits - head_fp32).max()
        print("use_fp32_compute", fp32_head, "gap to bf16 head", gap_bf16, "to fp32 head", gap_fp32)
        assert (gap_fp32 if fp32_head else gap_bf16) < 1e-5
        assert (gap_bf16 if fp32_head else gap_fp32) > 1e-4
        assert np.abs(logits - base).max() > 1e-4  # the decoder's linears are bf16 either way
    assert isinstance(precision_for(load_config(None, [f"actor_model_name_or_path={micro['model']}"])), Float32)


@pytest.mark.parametrize("custom_ops", ["off", "auto"])
def test_a_float32_rollout_of_a_bf16_model_decodes_in_float32(micro, custom_ops):
    """rollout_dtype float32 with bf16: inside packed_weights("float32") the model computes float32 products (packed
    copies where the kernel runs, plain matmuls where it does not), and bf16 again afterwards."""
    previous = ops.mode()
    ops.configure(custom_ops)
    try:
        model = load_model(micro["model"])
        ids = paddle.to_tensor([[3, 7, 11, 2, 5]])
        base = model(ids).numpy()
        model.set_bf16(True, True)
        bf16 = model(ids).numpy()
        with model.packed_weights("float32"):
            rollout = model(ids).numpy()
        assert model.bf16 == (True, True)
        assert np.abs(rollout - base).max() < 1e-5 < np.abs(bf16 - base).max()
    finally:
        ops.configure(previous)


def test_bf16_follows_into_rollout_dtype_and_save_dtype(micro):
    model = f"actor_model_name_or_path={micro['model']}"
    cfg = load_config(None, [model, "bf16=true"])
    assert (cfg.rollout_dtype, cfg.save_dtype) == ("bfloat16", "bfloat16")
    assert "bf16" not in cfg.unacted_keys
    cfg = load_config(None, [model, "bf16=true", "rollout_dtype=float32", "save_dtype=fp32"])
    assert (cfg.rollout_dtype, cfg.save_dtype) == ("float32", "float32")
    cfg = load_config(None, [model])
    assert (cfg.rollout_dtype, cfg.save_dtype) == ("float32", "float32")
    with pytest.raises(Exception, match="save_dtype: must be auto, float32 or bfloat16, got 'float16'"):
        load_config(None, [model, "save_dtype=float16"])


def _overrides(micro, out, **extra):
    """A run on the micro model; its random policy earns one reward for every sample (no advantage), so the entropy
    bonus gives the gradient."""
    return micro_overrides(micro, str(out), do_eval=False, entropy_coeff=0.01, **extra)


def _run(micro, out, **extra):
    trainer = RLTrainer(load_config(None, _overrides(micro, out, **extra)))
    trainer.train()
    return trainer


def _run_process(micro, out, **extra):
    """A run in a process of its own (parameter names, and so the optimizer state's keys, as a fresh run's)."""
    done = train_process(config_file(_overrides(micro, out, **extra), str(out) + ".yaml"))
    assert done.returncode == 0, done.stderr[-3000:]


def _rows(out):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
            for r in read_metrics(os.path.join(str(out), "metrics.jsonl"))]


def test_bf16_training_differs_from_float32_and_resumes_exactly(micro, tmp_path):
    """Two steps with bf16 true: float32 master weights (and float32 Adam moments) that differ from a float32 run's
    weights, the loss close; the checkpoint holds bfloat16 Hugging Face weights (config.json torch_dtype bfloat16)
    plus the float32 masters, and a run resumed from step 2 ends with the uninterrupted run's weights and metrics,
    bit for bit."""
    _run(micro, tmp_path / "fp32", max_steps=2, save_steps=2)
    _run_process(micro, tmp_path / "bf16", max_steps=4, save_steps=2, bf16="true")
    folder = tmp_path / "bf16" / "checkpoint-2"
    a, b = load_state(str(tmp_path / "fp32" / "checkpoint-2")), load_state(str(folder))
    masters = read_state(str(folder), "master_weights")
    moments = {k: v for k, v in read_state(str(folder), "optimizer").items() if "_moment" in str(k)}
    assert moments and all(np.asarray(v).dtype == np.float32 for v in moments.values())
    assert all(v.dtype == np.float32 for v in masters.values())
    gap = max(np.abs(a[k] - masters[k]).max() for k in a)
    print("max weight gap bf16 vs fp32 after 2 steps", gap)
    assert gap > 1e-5
    fp32_rows, bf16_rows = _rows(tmp_path / "fp32"), _rows(tmp_path / "bf16")
    for f, h in zip(fp32_rows[1:], bf16_rows[1:3]):  # the loss: -entropy_coeff * entropy
        print("entropy fp32", f["actor/entropy"], "bf16", h["actor/entropy"])
        assert f["actor/entropy"] == pytest.approx(h["actor/entropy"], rel=1e-3)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    header_len = int.from_bytes((folder / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((folder / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert all(np.array_equal(b[k], bf16_round(masters[k])) for k in b)  # the HF weights: the masters, rounded
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:  # the reader transformers uses
        for k in f.keys():
            t = f.get_tensor(k)
            assert t.dtype == torch.bfloat16 and np.array_equal(t.float().numpy(), b[k])
    assert any(not np.array_equal(b[k], masters[k]) for k in b)

    _run_process(micro, tmp_path / "resumed", max_steps=4, save_steps=2, bf16="true",
                 resume_from_checkpoint=str(folder))
    end_a = read_state(str(tmp_path / "bf16" / "checkpoint-4"), "master_weights")
    end_b = read_state(str(tmp_path / "resumed" / "checkpoint-4"), "master_weights")
    assert all(np.array_equal(end_a[k], end_b[k]) for k in end_a)
    assert _rows(tmp_path / "resumed")[-2:] == bf16_rows[-2:]


def test_save_dtype_float32_with_bf16(micro, tmp_path):
    """save_dtype float32 with bf16: float32 HF weights (they are the masters: no second copy); the rollout decodes in
    bfloat16 (rollout_dtype auto), and in float32 when rollout_dtype says so."""
    trainer = _run(micro, tmp_path, max_steps=1, save_steps=1, bf16="true", save_dtype="float32")
    assert trainer.engine.rollout_dtype == "bfloat16" and trainer.actor.bf16 == (True, True)
    folder = tmp_path / "checkpoint-1"
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
    assert not (folder / "master_weights.safetensors").exists()
    trainer = _run(micro, tmp_path / "fp32-rollout", max_steps=1, bf16="true", rollout_dtype="float32")
    assert trainer.engine.rollout_dtype == "float32" and trainer.actor.bf16 == (True, True)


# ---------------------------------------------------------------- every matmul of the model: LoRA, MoE, the critic
def _tiny(seed=0, **kind):
    paddle.seed(seed)
    model = CausalLM(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, **kind))
    model.init_weights(0.2)
    return model


def _mm(a, b):
    """The product of the bf16-rounded operands, exact (float64)."""
    return bf16_round(a).astype(np.float64) @ bf16_round(b).astype(np.float64)


def _lora_reference(x, w, a, b, scaling, parts, adapted, rank, g):
    """y and the gradients (x, A, B) of x W + per adapted part (x A_k s) B_k, every product from bf16-rounded
    operands (its incoming gradient rounded too), as ops.bf16_linear computes them."""
    h = (_mm(x, a) * scaling).astype(np.float32)
    y, dh, db, col, out = _mm(x, w), np.zeros_like(h), np.zeros_like(b), 0, 0
    for j, size in enumerate(parts):
        if j in adapted:
            k = adapted.index(j)
            hk, gj, bk = h[:, k * rank:(k + 1) * rank], g[:, out:out + size], b[:, col:col + size]
            y[:, out:out + size] += _mm(hk, bk)
            db[:, col:col + size] = _mm(hk.T, gj)
            dh[:, k * rank:(k + 1) * rank] = _mm(gj, bk.T)
            col += size
        out += size
    dh_pre = (dh * scaling).astype(np.float32)
    return y, _mm(g, w.T) + _mm(dh_pre, a.T), _mm(x.T, dh_pre), db


@pytest.mark.parametrize("module", ["qkv_proj", "o_proj"])
def test_lora_low_rank_products_are_bf16(module):
    """bf16 puts LoRA's x A and (x A) B on bfloat16 operands with float32 sums, forward and gradients: a fused
    column layer with adapters on q and v only (k's columns get none) and a row layer equal the NumPy products of
    the rounded operands, and differ from the float32 adapter by bf16 rounding."""
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"))
    rng = np.random.default_rng(3)
    out = {}
    for bf16 in (False, True):
        model = _tiny(model_type="qwen2")
        add_adapters(model, settings)
        layer = getattr(model.layers[0].self_attn, module)
        layer.lora.lora_B.set_value(paddle.to_tensor(rng.standard_normal(layer.lora.lora_B.shape).astype("float32")
                                                     * 0.3 if not out else out["B"]))
        out["B"] = layer.lora.lora_B.numpy()
        (EmulatedBf16(False) if bf16 else Float32()).prepare_model(model)
        assert layer.lora.bf16 == bf16 and model.bf16 == (bf16, bf16)
        x_np = out.setdefault("x", rng.standard_normal([6, layer.weight.shape[0]]).astype(np.float32))
        g_np = out.setdefault("g", rng.standard_normal([6, layer.weight.shape[1]]).astype(np.float32))
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = layer(x)
        (y * paddle.to_tensor(g_np)).sum().backward()
        out[bf16] = (y.numpy(), x.grad.numpy(), layer.lora.lora_A.grad.numpy(), layer.lora.lora_B.grad.numpy())
        assert layer.weight.grad is None   # the base stays frozen
    adapter = layer.lora
    parts, adapted = ([32, 16, 16], [0, 2]) if module == "qkv_proj" else ([32], [0])
    reference = _lora_reference(out["x"], layer.weight.numpy(), adapter.lora_A.numpy(), out["B"], settings.scaling,
                                parts, adapted, settings.rank, out["g"])
    for name, got, want, fp32 in zip(("y", "dx", "dA", "dB"), out[True], reference, out[False]):
        scale = np.abs(want).max()
        print(module, name, "gap to the bf16 reference", np.abs(got - want).max() / scale,
              "to float32", np.abs(fp32 - want).max() / scale)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
        assert np.abs(fp32 - want).max() > 2e-4 * scale   # float32's adapter is not this


def _moe_reference(moe, x):
    """A Qwen2-MoE block from bf16-rounded operands: router softmax (float32) top-k, SwiGLU experts, the
    sigmoid-gated shared expert."""
    def expert(e, v):
        gu = _mm(v, e.gate_up_proj.numpy())
        gate, up = np.split(gu, 2, axis=-1)
        return _mm((gate / (1 + np.exp(-gate)) * up).astype(np.float32), e.down_proj.numpy())
    logits = _mm(x, moe.gate.numpy())
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :moe.top_k]
    weights = np.take_along_axis(probs, top, -1)
    if moe.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    y = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for e, w in zip(top[n], weights[n]):
            y[n] += w * expert(moe.experts[e], x[n:n + 1])[0]
    gate = 1 / (1 + np.exp(-_mm(x, moe.shared_expert_gate.numpy())))
    return y + gate * expert(moe.shared_expert, x)


def test_moe_router_and_experts_are_bf16():
    """bf16 puts the MoE block's router, experts and shared expert (and its gate) on bfloat16 operands: the
    block's output equals the NumPy block over the rounded operands, differs from float32's, and the experts'
    gradients come from bf16 products too (they differ from float32's). The bfloat16 rollout keeps them bf16."""
    model = _tiny(model_type="qwen2_moe", extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40))
    moe = model.layers[0].mlp
    x_np = np.random.default_rng(5).standard_normal([1, 7, 32]).astype(np.float32)
    reference = _moe_reference(moe, x_np[0])
    out = {}
    for strategy in (Float32(), EmulatedBf16(False)):
        model.set_bf16(False, False)
        strategy.prepare_model(model)
        bf16 = isinstance(strategy, EmulatedBf16)
        assert all(m.bf16 == bf16 for m in [moe, moe.shared_expert, *moe.experts])
        x = paddle.to_tensor(x_np, stop_gradient=False)
        y = moe(x)
        y.sum().backward()
        out[bf16] = y.numpy()[0], [e.gate_up_proj.grad.numpy() for e in moe.experts if e.gate_up_proj.grad is not None]
        model.clear_gradients()
    scale = np.abs(reference).max()
    print("MoE gap to the bf16 reference", np.abs(out[True][0] - reference).max() / scale,
          "float32's", np.abs(out[False][0] - reference).max() / scale)
    np.testing.assert_allclose(out[True][0], reference, rtol=0, atol=2e-6 * scale)
    assert np.abs(out[False][0] - reference).max() > 2e-4 * scale
    assert len(out[True][1]) == len(out[False][1]) > 0
    assert max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(out[True][1], out[False][1])) > 2e-4
    for dtype, bf16 in (("bfloat16", True), ("float32", False)):
        with model.packed_weights(dtype):
            assert all(m.bf16 == bf16 for m in [moe, *moe.experts])
    assert model.bf16 == (True, True) and all(e.bf16 for e in moe.experts)   # training's precision is back


def test_a_quantized_rollout_says_the_moe_experts_are_not_quantized(caplog):
    """rollout_quant_type packs the dense layers alone: with MoE blocks the rollout says once that their router
    and experts are not quantized (and in which precision they multiply); a dense model says nothing."""
    moe_model = _tiny(model_type="qwen2_moe", extra=dict(num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=24, shared_expert_intermediate_size=40))
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        for _ in range(2):
            with moe_model.packed_weights("float32", "weight_only_int8"):
                pass
        with _tiny(model_type="qwen2").packed_weights("float32", "weight_only_int8"):
            pass
    said = [r.getMessage() for r in caplog.records if "not quantized" in r.getMessage()]
    assert said == ["rollout_quant_type weight_only_int8 quantizes the dense linear layers and the LM head only: "
                    "the MoE routers and experts (1 blocks) are not quantized and multiply in float32"]


@pytest.mark.parametrize("fp32_head", [False, True])
def test_critic_body_and_value_head_are_bf16(fp32_head):
    """A critic (a one-label sequence classifier) under bf16: its decoder's linears take bf16 products and its
    value head too, unless use_fp32_compute: the values equal the head's product over the rounded operands (or
    the float32 one)."""
    model = _tiny(model_type="qwen2", extra=dict(architectures=["Qwen2ForSequenceClassification"], num_labels=1))
    model.score.weight.set_value(paddle.to_tensor(np.random.default_rng(2).standard_normal([32, 1]).astype("float32")))
    ids = paddle.to_tensor([[3, 7, 11, 2, 5]])
    bias = attention_bias_from_mask(paddle.ones_like(ids), 5, causal=True)
    fp32_hidden = model.hidden_states(ids, paddle.arange(5).unsqueeze(0), bias).numpy()
    EmulatedBf16(fp32_head).prepare_model(model)
    assert model.bf16 == (True, not fp32_head) and model.score.bf16 == (not fp32_head)
    hidden = model.hidden_states(ids, paddle.arange(5).unsqueeze(0), bias)
    assert np.abs(hidden.numpy() - fp32_hidden).max() > 1e-4 * np.abs(fp32_hidden).max()  # the body is bf16
    values = head_values(model, hidden).numpy()
    w, h = model.score.weight.numpy(), hidden.numpy()
    head_bf16, head_fp32 = _mm(h, w)[..., 0], (h.astype(np.float64) @ w)[..., 0]
    gap_bf16, gap_fp32 = np.abs(values - head_bf16).max(), np.abs(values - head_fp32).max()
    print("use_fp32_compute", fp32_head, "value gap to bf16 head", gap_bf16, "to fp32 head", gap_fp32)
    assert (gap_fp32 if fp32_head else gap_bf16) < 1e-5
    assert (gap_bf16 if fp32_head else gap_fp32) > 1e-4


def test_amp_says_the_value_head_is_not_float32_under_use_fp32_compute(caplog):
    """Under AMP (the GPU strategy) use_fp32_compute keeps the LM head's log-probs float32 but not a value head:
    a warning says so for a sequence classifier, none for a causal LM."""
    critic = _tiny(model_type="qwen2", extra=dict(architectures=["Qwen2ForSequenceClassification"], num_labels=1))
    with caplog.at_level("INFO", logger="paddle_rl"):
        AmpBf16(True).prepare_model(_tiny(model_type="qwen2"))
        assert not [r for r in caplog.records if "value head" in r.getMessage()]
        AmpBf16(True).prepare_model(critic)
    assert [r for r in caplog.records if r.levelname == "WARNING" and "value head" in r.getMessage()]


def test_what_bf16_leaves_float32_is_said_at_start(micro, caplog):
    """The attention core is not on bf16 products: precision_for says so, once, at the warning level."""
    with caplog.at_level("INFO", logger="paddle_rl"):
        precision_for(load_config(None, [f"actor_model_name_or_path={micro['model']}", "bf16=true"]))
    warned = [r for r in caplog.records if r.levelname == "WARNING" and FP32_UNDER_BF16 in r.getMessage()]
    assert len(warned) == 1 and "attention core" in FP32_UNDER_BF16
    caplog.clear()
    with caplog.at_level("INFO", logger="paddle_rl"):
        precision_for(load_config(None, [f"actor_model_name_or_path={micro['model']}"]))
    assert not [r for r in caplog.records if FP32_UNDER_BF16 in r.getMessage()]


TP_WORKER = r"""
import json, sys
import numpy as np
import paddle
from paddle_rl.models import CausalLM, hf_state, load_weights
from paddle_rl.models.config import ModelConfig
from paddle_rl.models.lora import LoraSettings, add_adapters, adapters
from paddle_rl.parallel.topology import build_topology
from paddle_rl.trainer.precision import EmulatedBf16, Float32

topo = build_topology(tensor=2)
group, rank = topo.group("tp"), topo.group("tp").rank


def build(group=None):
    paddle.seed(0)
    model = CausalLM(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, model_type="qwen2_moe",
                                 extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                            shared_expert_intermediate_size=40)), group)
    model.init_weights(0.2)
    add_adapters(model, LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj")))
    return model


single = build()
rng = np.random.default_rng(0)
for _, a in adapters(single):
    a.lora_B.set_value(paddle.to_tensor(rng.standard_normal(a.lora_B.shape).astype("float32") * 0.3))
for p in single.parameters():
    p.stop_gradient = False
tp = build(group)
load_weights(tp, hf_state(single))
for p in tp.parameters():
    p.stop_gradient = False
x_np = rng.standard_normal([1, 6, 32]).astype("float32")


def run(model, path, x):
    layer = model.layers[0]
    for name in path.split("."):
        layer = getattr(layer, name)
    x = paddle.to_tensor(x, stop_gradient=False)
    y = layer(x)
    (y * y).sum().backward()
    grads = {n: p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None}
    out = y.numpy(), x.grad.numpy(), grads
    model.clear_gradients()
    return out


def shard(spec, full):
    return spec.shard(full, rank, 2)


result = {}
for strategy in (Float32(), EmulatedBf16(False)):
    name = "bf16" if isinstance(strategy, EmulatedBf16) else "fp32"
    strategy.prepare_model(single)
    strategy.prepare_model(tp)
    for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp"):
        row = path.endswith("o_proj")
        x_tp = x_np[..., rank * 16:(rank + 1) * 16] if row else x_np
        y1, dx1, g1 = run(single, path, x_np)
        y2, dx2, g2 = run(tp, path, x_tp)
        layer = tp.layers[0]
        for part in path.split("."):
            layer = getattr(layer, part)
        params = dict(layer.named_parameters())
        flat = lambda a: a.reshape([-1, a.shape[-1]])  # noqa: E731
        pairs = [(flat(y2), shard(layer.weight.spec, flat(y1)) if path.endswith("qkv_proj") else flat(y1)),
                 (dx2, dx1[..., rank * 16:(rank + 1) * 16] if row else dx1)]
        pairs += [(g2[n], shard(params[n].spec, g1[n]) if params[n].is_distributed else g1[n]) for n in g2]
        result[name, path] = dict(single=[a.tolist() for a in [y1, dx1] + [g1[n] for n in sorted(g1)]],
                                  tp=[float(np.abs(a - b).max() / np.abs(b).max()) for a, b in pairs],
                                  grads=sorted(g2))
json.dump({f"{k[0]} {k[1]}": v for k, v in result.items()}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


def test_tensor_parallel_layers_take_the_bf16_products(tmp_path):
    """Under tensor_parallel_degree 2 (two processes, gloo) the column layer with its LoRA adapter (q and v), the
    row layer with its adapter and a Qwen2-MoE block (router, split experts, shared expert) give, with bf16, the
    single-process bf16 layer's output, input gradient and parameter gradients on each rank's shard (the same
    bf16 products; float32 sums in another order), and with float32 the float32 layer's: the bf16 and float32
    layers differ by bf16 rounding, so the tensor-parallel path is on the bf16 products."""
    script = tmp_path / "worker.py"
    script.write_text(TP_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--devices", "", "--nproc_per_node",
                             "2", "--log_dir", str(tmp_path / "logs"), str(script), str(tmp_path)],
                            env=env, cwd=root, capture_output=True, text=True, timeout=300)
    outputs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*"))
                   if p.is_file())
    assert result.returncode == 0 and all(p.exists() for p in outputs), (
        f"launch exited {result.returncode}\n{result.stderr[-1500:]}{logs}")
    for path in outputs:
        ranks = json.loads(path.read_text())
        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp"):
            fp32, bf16 = ranks[f"fp32 {layer}"], ranks[f"bf16 {layer}"]
            assert bf16["grads"] == fp32["grads"] and len(bf16["grads"]) >= 2
            print(path.name, layer, "tensor-parallel gap bf16", max(bf16["tp"]), "fp32", max(fp32["tp"]))
            assert max(bf16["tp"]) < 2e-5 and max(fp32["tp"]) < 2e-5
            # single process: bf16 against float32, output and gradients alike
            gaps = [np.abs(np.array(a) - np.array(b)).max() / np.abs(np.array(b)).max()
                    for a, b in zip(bf16["single"], fp32["single"])]
            assert min(gaps) > 2e-4, (layer, gaps)


def _special_floats(rng, count: int) -> np.ndarray:
    """Normal values with NaNs (quiet, signalling, negative), infinities, subnormals, halfway ties (both parities),
    the largest float32 (rounds to infinity) and zeros of both signs mixed in."""
    x = rng.standard_normal(count).astype(np.float32)
    bits = x.view(np.uint32)
    specials = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                         0x807FFFFF, 0x00018000, 0x00008000, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0, 0x80000000],
                        np.uint32)
    at = rng.choice(count, size=(len(specials), min(40, count // len(specials))), replace=False)
    for value, where in zip(specials, at):
        bits[where] = value
    return x


def test_to_bf16_is_paddles_cast_bit_for_bit():
    """ops.to_bf16's kernel (vectorized, in parallel; what bf16_linear keeps for the backward) gives the bits of
    Paddle's astype("bfloat16"), NaN (0x7fff), infinities, subnormals and ties included, on a length that is no
    multiple of the vector (the scalar tail) and one long enough to be split over the threads."""
    if not ops.available():
        pytest.skip("the custom ops are not in use")
    rng = np.random.default_rng(11)
    for count in (37, 300_007):
        x = paddle.to_tensor(_special_floats(rng, count).reshape(-1, 1) if count == 37 else _special_floats(rng, count))
        got, expected = ops.to_bf16_fused(x), x.astype("bfloat16")
        assert got.dtype == paddle.bfloat16 and got.shape == x.shape
        assert np.array_equal(got.numpy().view(np.uint16), expected.numpy().view(np.uint16)), count


@pytest.mark.parametrize("kernel", list(ops.BF16_KERNELS))
def test_bf16_matmul_takes_bfloat16_operands(kernel):
    """bf16_matmul_fused / bf16_pack_b / bf16_matmul_packed with a or b a bfloat16 tensor (to_bf16's copy: what the
    weight gradient reads; a frozen layer's bfloat16 weight) give the float32 operands' bits, for both layouts of
    each (rows' pairs copied; pairs interleaved from two rows) and sizes off the kernels' blocks; bf16_linear with a
    bfloat16 weight and no gradient gives the float32 weight's bits."""
    if kernel not in ops.bf16_kernels():
        pytest.skip(f"{kernel} is not usable here (usable: {ops.bf16_kernels() or 'none'})")
    rng = np.random.default_rng(12)
    for m, n, k in ((37, 45, 67), (70, 33, 301), (130, 40, 96)):
        for trans_a, trans_b in ((False, False), (True, True), (False, True), (True, False)):
            a = paddle.to_tensor(rng.standard_normal([k, m] if trans_a else [m, k]).astype(np.float32))
            b = paddle.to_tensor(rng.standard_normal([n, k] if trans_b else [k, n]).astype(np.float32))
            ab, bb = ops.to_bf16(a), ops.to_bf16(b)
            expected = ops.bf16_matmul_fused(a, b, trans_a, trans_b, kernel=kernel).numpy()
            for x, y in ((ab, b), (a, bb), (ab, bb)):
                got = ops.bf16_matmul_fused(x, y, trans_a, trans_b, kernel=kernel)
                assert got.dtype == paddle.float32
                np.testing.assert_array_equal(got.numpy(), expected)
                packed = ops.bf16_pack_b(y, trans_b)
                np.testing.assert_array_equal(ops.bf16_matmul_packed(x, packed, trans_a, kernel=kernel).numpy(),
                                              expected)
    x = paddle.to_tensor(rng.standard_normal([2, 9, 64]).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal([64, 40]).astype(np.float32))
    with paddle.no_grad():
        np.testing.assert_array_equal(ops.bf16_linear(x, ops.to_bf16(w)).numpy(), ops.bf16_linear(x, w).numpy())


_THREAD_PRODUCTS = """
import sys
import numpy as np
import paddle
from paddle_rl import ops
rng = np.random.default_rng(13)
out = {}
# (m, k, n, trans_a, trans_b): B's part over L2 in panels (k 576), a long k in chunks of A's rows (k 3072), the
# rows split instead of the columns (n 40), the weight gradient's and the input gradient's transposes, edges
for i, (m, k, n, ta, tb) in enumerate(((96, 576, 3072, False, False), (100, 3072, 600, False, True),
                                       (300, 70, 40, False, False), (200, 600, 1000, True, False))):
    a = paddle.to_tensor(rng.standard_normal([k, m] if ta else [m, k]).astype(np.float32))
    b = paddle.to_tensor(rng.standard_normal([n, k] if tb else [k, n]).astype(np.float32))
    for kernel in ops.bf16_kernels():
        out[f"{i}_{kernel}"] = ops.bf16_matmul_fused(a, b, ta, tb, kernel=kernel).numpy()
        out[f"{i}_{kernel}_bf16a"] = ops.bf16_matmul_fused(ops.to_bf16(a), b, ta, tb, kernel=kernel).numpy()
np.savez(sys.argv[1], **out)
"""


def test_bf16_matmul_bits_do_not_depend_on_the_thread_count(tmp_path):
    """The kernels' products with 1, 2 and 3 threads (PADDLE_RL_OP_THREADS, each in a process of its own) are the
    same bits: each element's sum runs over k in one order whatever the split (so a data-parallel run with one
    thread a process gives one process's numbers), for each blocking the product picks."""
    if not ops.bf16_kernels():
        pytest.skip("no bf16 kernel is usable here")
    results = []
    for threads in (1, 2, 3):
        path = str(tmp_path / f"t{threads}.npz")
        env = dict(os.environ, PADDLE_RL_OP_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, "-c", _THREAD_PRODUCTS, path], env=env, check=True, capture_output=True)
        results.append(dict(np.load(path)))
    assert len(results[0]) == 4 * 2 * len(ops.bf16_kernels())
    for name, value in results[0].items():
        for other in results[1:]:
            assert np.array_equal(value, other[name]), name

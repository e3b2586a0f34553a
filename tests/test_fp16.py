"""fp16 (emulated on the CPU: float16-rounded operands, float32 sums), fp16_opt_level O1 / O2, amp_master_grad, the
amp_custom_*_lists, and the dynamic loss scaling that skips an overflowing update (trainer/precision.py)."""
import os

import numpy as np
import paddle
import pytest

from micro_model import micro_overrides
from paddle_rl import ops
from paddle_rl.config import ConfigError, load_config
from paddle_rl.models.layers import Bf16Products
from paddle_rl.model_files.safetensors_io import load_state
from paddle_rl.monitor import read_metrics
from paddle_rl.trainer import RLTrainer
from paddle_rl.trainer.precision import (EmulatedBf16, EmulatedFp16, Float32, LossScale, precision_for,
                                         cpu_float32_white_ops)


def _f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------- the products
def test_half_linear_is_a_float16_matmul_with_float32_sums():
    """y, dx and dW of ops.half_linear: products of float16-rounded operands (overflow to inf, subnormals kept) with
    float32 sums; under O2 (round_outputs) the three outputs are float16 values too. Float32 inputs chosen so that
    rounding to float16 changes them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 8)).astype(np.float32) * 1.001
    w = rng.normal(size=(8, 6)).astype(np.float32) * 0.01
    dy = rng.normal(size=(3, 5, 6)).astype(np.float32) * 1e-3
    for round_outputs in (False, True):
        xt, wt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(w, stop_gradient=False)
        y = ops.half_linear(xt, wt, "float16", round_outputs)
        y.backward(paddle.to_tensor(dy))
        out = _f16 if round_outputs else (lambda a: a)
        ref_y = out(_f16(x).reshape(-1, 8).astype(np.float64) @ _f16(w)).reshape(3, 5, 6)
        ref_dx = out(_f16(dy).reshape(-1, 6).astype(np.float64) @ _f16(w).T).reshape(3, 5, 8)
        ref_dw = out(_f16(x).reshape(-1, 8).T.astype(np.float64) @ _f16(dy).reshape(-1, 6))
        np.testing.assert_allclose(y.numpy(), ref_y, rtol=2e-6 if not round_outputs else 1e-3, atol=1e-7)
        np.testing.assert_allclose(xt.grad.numpy(), ref_dx, rtol=2e-6 if not round_outputs else 1e-3, atol=1e-9)
        np.testing.assert_allclose(wt.grad.numpy(), ref_dw, rtol=2e-6 if not round_outputs else 1e-3, atol=1e-9)
        if round_outputs:   # the outputs are float16 values
            assert np.array_equal(y.numpy(), _f16(y.numpy())) and np.array_equal(wt.grad.numpy(), _f16(wt.grad.numpy()))
        # against float32 the products differ (the operands were rounded)
        assert np.abs(y.numpy() - (x.reshape(-1, 8) @ w).reshape(3, 5, 6)).max() > 1e-6
    # IEEE half: above 65504 an operand is inf, and so is the product
    big = paddle.to_tensor(np.full((1, 2), 70000.0, np.float32))
    assert np.isinf(ops.half_linear(big, paddle.ones([2, 1]), "float16").numpy()).all()
    assert np.isfinite(ops.half_linear(big, paddle.ones([2, 1]), "bfloat16").numpy()).all()


# ---------------------------------------------------------------------------------------------- the loss scale
def test_loss_scale_follows_paddle_grad_scaler():
    """Backs off by decr_ratio after decr_every_n_nan_or_inf overflows (never below 1), grows by incr_ratio after
    incr_every_n_steps good updates in a row; static scaling never moves."""
    s = LossScale(8.0, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)
    s.update(True)
    assert s.value == 8.0
    s.update(True)
    assert s.value == 4.0
    for _ in range(3):
        s.update(False)
    assert s.value == 8.0
    s.update(True), s.update(False), s.update(True)   # a good update in between resets the count of overflows
    assert s.value == 8.0
    tiny = LossScale(1.5, decr_every_n_nan_or_inf=1)
    tiny.update(True)
    assert tiny.value == 1.0 and not tiny.cures
    static = LossScale(8.0, dynamic=False, decr_every_n_nan_or_inf=1)
    static.update(True)
    assert static.value == 8.0 and not static.cures


# ---------------------------------------------------------------------------------------------- the config keys
def _cfg(micro, tmp_path, **extra):
    return load_config(None, micro_overrides(micro, str(tmp_path), do_eval=False, entropy_coeff=0.01, **extra))


@pytest.mark.parametrize("extra,message", [
    (dict(fp16="true", bf16="true"), "fp16: true with bf16: true"),
    (dict(amp_master_grad="true", bf16="true"), "amp_master_grad: float32 master gradients are an O2 setting"),
    (dict(amp_master_grad="true"), "amp_master_grad: float32 master gradients are an O2 setting"),
    (dict(amp_custom_black_list="softmax"), "amp_custom_black_list: names ops for bf16 / fp16, and neither is on"),
    (dict(fp16="true", amp_custom_black_list="matmul_v2", amp_custom_white_list="matmul_v2"),
     "amp_custom_black_list: matmul_v2 also in amp_custom_white_list"),
    (dict(scale_loss=1024), "scale_loss: loss scaling is fp16's"),
    (dict(bf16="true", incr_every_n_steps=10), "incr_every_n_steps: loss scaling is fp16's"),
    (dict(fp16="true", scale_loss=0.5), "scale_loss: must be >= 1"),
    (dict(fp16="true", decr_ratio=1.5), "decr_ratio: must be in (0, 1)"),
    (dict(fp16="true", fp16_opt_level="O3"), "fp16_opt_level: must be O1 or O2, got 'O3'"),
    (dict(fp16="true", rollout_dtype="bfloat16"), "rollout_dtype: bfloat16 with fp16: true"),
])
def test_precision_keys_are_refused_by_name(micro, tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        _cfg(micro, tmp_path, **extra)
    assert message in str(err.value)


def test_a_white_listed_op_the_cpu_keeps_float32_is_named(micro, tmp_path, caplog):
    """On a CPU build the emulation runs only the matmuls in half: another white-listed op is named in one warning
    (it stays float32; PaddleNLP's own file lists such ops, and runs); a black-listed one is float32 already; on a
    GPU build AMP takes either list."""
    import logging
    cfg = _cfg(micro, tmp_path, fp16="true", amp_custom_white_list="matmul_v2,softmax",
               amp_custom_black_list="reduce_sum")
    assert cpu_float32_white_ops(cfg, on_gpu=False) == ["softmax"]
    assert cpu_float32_white_ops(cfg, on_gpu=True) == []
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        precision_for(cfg)
    assert any(r.getMessage().startswith("amp_custom_white_list: softmax: on a CPU build") for r in caplog.records)
    assert cpu_float32_white_ops(_cfg(micro, tmp_path, fp16="true", amp_custom_white_list="matmul_v2 linear"),
                                 on_gpu=False) == []


def test_the_strategies_set_the_products(micro, tmp_path):
    """fp16 O1: the body's products float16 (outputs float32), the LM head float32; O2: outputs rounded; a
    black-listed matmul: no half products; bf16 O1: bf16's own products (no HalfProducts), O2: rounded outputs."""
    from paddle_rl.models import load_model

    def products(**extra):
        strategy = precision_for(_cfg(micro, tmp_path, **extra))
        model = load_model(micro["model"])
        strategy.prepare_model(model)
        body = [m for m in model.sublayers() if isinstance(m, Bf16Products) and m is not getattr(model, "lm_head", None)]
        return strategy, model, {(m.bf16, repr(m.half)) for m in body}

    strategy, model, body = products(fp16="true")
    assert isinstance(strategy, EmulatedFp16) and strategy.loss_scale.value == 2.0 ** 15
    assert body == {(True, "HalfProducts(float16, round_outputs=False)")} and not model.head_bf16
    assert products(fp16="true", fp16_opt_level="O2")[2] == {(True, "HalfProducts(float16, round_outputs=True)")}
    assert products(fp16="true", amp_custom_black_list="matmul_v2")[2] == {(False, "None")}
    strategy, model, body = products(bf16="true")
    assert isinstance(strategy, EmulatedBf16) and strategy.loss_scale is None and body == {(True, "None")}
    assert products(bf16="true", fp16_opt_level="O2")[2] == {(True, "HalfProducts(bfloat16, round_outputs=True)")}
    assert isinstance(precision_for(_cfg(micro, tmp_path)), Float32)


# ---------------------------------------------------------------------------------------------- training
def _run(micro, out, **extra):
    trainer = RLTrainer(_cfg(micro, out, **extra))
    trainer.train()
    return trainer


def _weights(path):
    return load_state(str(path))


def test_an_overflowing_update_is_skipped_the_scale_backs_off_and_nothing_is_saved(micro, tmp_path):
    """A loss scale of 2^40 overflows float16 in the backward (dy x scale above 65504 rounds to inf): the update is
    not applied (the checkpoint after the step holds the initial weights), the scale backs off by decr_ratio, and the
    skip is counted in actor/overflow_skipped, not against max_nonfinite_skips. With dynamic loss scaling off the
    same scale stays where it is and the skip counts as non-finite."""
    initial = {k: v.copy() for k, v in _weights(micro["model"]).items()}
    out = tmp_path / "dyn"
    trainer = _run(micro, out, fp16="true", scale_loss=2.0 ** 40, decr_every_n_nan_or_inf=1, max_steps=1,
                   save_steps=1, global_mini_batch_size=4, max_nonfinite_skips=0)
    rec = read_metrics(os.path.join(str(out), "metrics.jsonl"))[-1]
    assert rec["actor/overflow_skipped"] == 1.0 and rec["actor/overflow_skipped_total"] == 1.0
    assert rec["actor/loss_scale"] == 2.0 ** 39 and trainer.precision.loss_scale.value == 2.0 ** 39
    assert rec["actor/nonfinite_skipped"] == 0.0
    saved = _weights(out / "checkpoint-1")
    assert saved.keys() == initial.keys()
    assert all(np.array_equal(saved[k], initial[k]) for k in initial)
    state_scale = trainer.loop.precision.loss_scale.state_dict()
    assert state_scale["overflows"] == 1

    static = tmp_path / "static"
    with pytest.raises(Exception, match="non-finite"):   # max_nonfinite_skips 0: the first one stops the run
        _run(micro, static, fp16="true", scale_loss=2.0 ** 40, use_dynamic_loss_scaling="false", max_steps=1,
             save_steps=1, global_mini_batch_size=4, max_nonfinite_skips=0)


def test_fp16_trains_and_its_weights_differ_from_float32(micro, tmp_path):
    """Two steps under fp16 O1 and O2 (the default loss scale 2^15 does not overflow here): updates applied, the loss
    scale reported, the weights moved and different from a float32 run's; O2's from O1's."""
    runs = {}
    for name, extra in (("fp32", {}), ("o1", dict(fp16="true")), ("o2", dict(fp16="true", fp16_opt_level="O2"))):
        out = tmp_path / name
        _run(micro, out, max_steps=2, save_steps=2, **extra)
        runs[name] = (_weights(out / "checkpoint-2"), read_metrics(os.path.join(str(out), "metrics.jsonl"))[-1])
    initial = _weights(micro["model"])
    for name in ("o1", "o2"):
        weights, rec = runs[name]
        assert rec["actor/loss_scale"] == 2.0 ** 15 and rec["actor/overflow_skipped_total"] == 0.0
        assert any(not np.array_equal(weights[k], initial[k]) for k in initial)
        assert max(np.abs(weights[k] - runs["fp32"][0][k]).max() for k in initial) > 0
    assert "actor/loss_scale" not in runs["fp32"][1]
    assert max(np.abs(runs["o1"][0][k] - runs["o2"][0][k]).max() for k in initial) > 0


def test_o2_keeps_gradients_in_float16_unless_amp_master_grad(micro):
    """O2: each parameter's gradient is a float16 value after the backward (finish_gradients) and after unscaling;
    with amp_master_grad the summed gradients stay float32 (some are not float16 values); O1 likewise float32."""
    from paddle_rl.models import load_model
    from paddle_rl.models.decoder import attention_bias_from_mask

    def grads(level, master):
        model = load_model(micro["model"])
        strategy = EmulatedFp16(LossScale(2.0 ** 10, half_grads="float16" if level == "O2" and not master else None),
                                level, master)
        strategy.prepare_model(model)
        strategy.prepare_training(model, None)
        for row in ([3, 7, 11, 2, 5, 9, 4, 1], [8, 6, 12, 3, 3, 10, 2, 7]):   # two micro-batches summed
            ids = paddle.to_tensor([row])
            bias = attention_bias_from_mask(paddle.ones_like(ids), 8, causal=True)
            logp = model.head_logprobs(model.hidden_states(ids, paddle.arange(8).unsqueeze(0), bias), ids, 1.0)[0]
            strategy.loss_scale.scale(-logp.mean()).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        strategy.finish_gradients(params)
        stored = [p.grad.numpy().copy() for p in params]
        strategy.loss_scale.unscale_(params)
        return stored, [p.grad.numpy() for p in params]

    def all_half(arrays):
        return all(np.array_equal(a, _f16(a)) for a in arrays)

    stored, unscaled = grads("O2", False)
    assert all_half(stored) and all_half(unscaled) and any(np.abs(a).max() > 0 for a in unscaled)
    assert not all_half(grads("O2", True)[1]) and not all_half(grads("O1", False)[1])


def test_fp16_with_a_critic_is_refused_before_any_model_loads(micro, tmp_path):
    with pytest.raises(ConfigError, match="fp16: not with a critic .* the critic's update has no loss scaling"):
        RLTrainer(_cfg(micro, tmp_path, fp16="true", rl_algorithm="ppo"))

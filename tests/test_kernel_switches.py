"""The fused-kernel switches (use_flash_attention, use_fused_rms_norm, use_fused_rope, use_fused_head_and_loss_fn,
use_fused_linear; paddle_rl/ops/switches.py) select real code paths of the training passes.

Each switch on gives the training step of the switch off (log-probs, loss and every parameter's gradient, then an SGD
step) within test_ops.py's tolerances (1e-5 on values, 1e-4 of the gradient scale), on the padded layout (with and
without the shared prompt prefix) and on a packed micro-batch; and the same step with the switched-on path perturbed
by 1e-3 fails that comparison, so each switch is shown to route through the path it names.
"""
import numpy as np
import paddle
import pytest

from paddle_rl import ops
from paddle_rl.config import ConfigError, load_config
from paddle_rl.ops import attention as attention_module, build, linear_bias, norm as norm_module, rope as rope_module

SEED = 7


@pytest.fixture(scope="module", autouse=True)
def kernels():
    previous = build.mode()
    ops.configure("on")
    yield
    ops.configure(previous)
    ops.select_kernels(attention=None, rms_norm=None, rope=None, head=None, linear=None)


def close(actual, expected, rel, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(actual - expected).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:g} x {scale:.3g}"


def t(array, grad=False):
    out = paddle.to_tensor(np.asarray(array).astype("float32"))
    out.stop_gradient = not grad
    return out


# ---------------------------------------------------------------------------------------- the blocked attention

@pytest.mark.parametrize("batch,kv,groups,length,keys,rows", [(3, 2, 2, 7, 11, 0), (3, 2, 2, 7, 11, 1),
                                                              (2, 1, 4, 9, 9, 4), (1, 3, 3, 33, 40, 5)])
def test_blocked_attention_equals_the_materialized_one(batch, kv, groups, length, keys, rows):
    """Output and the gradients of q, k and v, with rows whose keys are all masked (left padding) finite and equal,
    in one block or several."""
    from paddle_rl.models.decoder import attention_bias_from_mask
    rng = np.random.default_rng([SEED, length, rows])
    mask = np.ones((batch, keys), np.int64)
    mask[0, :min(5, keys - 1)] = 0
    bias = attention_bias_from_mask(paddle.to_tensor(mask), length, causal=True)
    d = 16
    q = t(rng.standard_normal((batch, kv, groups * length, d)) * 2, grad=True)
    k, v = t(rng.standard_normal((batch, kv, keys, d)), grad=True), t(rng.standard_normal((batch, kv, keys, d)), True)
    out = ops.blocked_attention(q, k, v, bias, d ** -0.5, rows=rows)
    ref = ops.blocked_attention_reference(q, k, v, bias, d ** -0.5)
    assert np.isfinite(out.numpy()).all()
    close(out.numpy(), ref.numpy(), 1e-5, "out")
    g = t(rng.standard_normal(out.shape))
    grads = paddle.grad((out * g).sum(), [q, k, v])
    ref_grads = paddle.grad((ref * g).sum(), [q, k, v])
    for name, a, b in zip("qkv", grads, ref_grads):
        close(a.numpy(), b.numpy(), 1e-5, f"d{name}")
    with paddle.no_grad():  # the forward alone keeps nothing
        close(ops.blocked_attention(q, k, v, bias, d ** -0.5, rows=rows).numpy(), ref.numpy(), 1e-5, "no-grad out")


def test_blocked_attention_saves_no_probabilities():
    """What the backward keeps: q, k, v, the bias, the output and two numbers per query row; nothing of the
    [B, KV, G * L, K] probabilities' size."""
    batch, kv, groups, length, keys, d = 2, 2, 2, 64, 64, 16
    q = t(np.ones((batch, kv, groups * length, d)), grad=True)
    k, v = t(np.ones((batch, kv, keys, d)), grad=True), t(np.ones((batch, kv, keys, d)), grad=True)
    bias = paddle.zeros([batch, 1, length, keys])
    saved = []
    original = attention_module._BlockedAttention.forward

    def spy(ctx, *args):
        out = original(ctx, *args)
        saved.extend(ctx.saved_tensor())
        return out
    attention_module._BlockedAttention.forward = staticmethod(spy)
    try:
        ops.blocked_attention(q, k, v, bias, 0.25, rows=8).sum().backward()
    finally:
        attention_module._BlockedAttention.forward = staticmethod(original)
    sizes = sorted(int(np.prod(s.shape)) for s in saved)
    probabilities = batch * kv * groups * length * keys
    assert len(saved) == 7 and max(sizes) < probabilities, sizes
    assert sizes[:2] == [batch * kv * groups * length] * 2   # each row's maximum and sum


# ---------------------------------------------------------------------------------------- a training step

def _model():
    """A qwen2-shaped decoder (q/k/v bias; head_dim 16: the packed kernel's case) at random init, training mode."""
    from paddle_rl.models import CausalLM, ModelConfig
    paddle.seed(SEED)
    model = CausalLM(ModelConfig(model_type="qwen2", vocab_size=120, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model.init_weights(0.2)
    for name, p in model.named_parameters():  # nonzero biases, so that the bias add counts
        if name.endswith("bias"):
            p.set_value(paddle.full_like(p, 0.05))
    model.train()
    return model


PROMPT, RESPONSE = 5, 6


def _batch():
    rng = np.random.default_rng(SEED)
    ids = rng.integers(1, 120, (4, PROMPT + RESPONSE))
    mask = np.ones_like(ids)
    mask[1, :2] = 0                   # a left-padded prompt
    mask[2, PROMPT + 3:] = 0          # a short response
    ids = np.where(mask == 1, ids, 0)
    return ids, mask


def _step(model, layout: str):
    """One training step's numbers: (log-probs, loss, gradients by name, parameters after an SGD step)."""
    from paddle_rl.models.logprobs import packed_token_logprobs, token_logprobs
    from paddle_rl.models.packing import Packing
    ids, mask = _batch()
    state = {n: p.numpy().copy() for n, p in model.named_parameters()}
    if layout == "packed":
        rows = [0, 0, 1, 1]
        prompts = [list(ids[0, :PROMPT]), list(ids[2, :PROMPT])]
        lengths = mask[:, PROMPT:].sum(axis=1)
        packing = Packing(prompts, rows, ids[:, PROMPT:], lengths)
        logp, entropy = packed_token_logprobs(model, packing, 0.9, with_entropy=True)
        valid = paddle.to_tensor((np.arange(RESPONSE)[None] < lengths[:, None]).astype("float32"))
    else:
        shared = None
        if layout == "shared":
            ids[1], mask[1] = ids[0], mask[0]   # rows 0 and 1 share a prompt
            ids[1, PROMPT:] = (ids[1, PROMPT:] + 1) % 120
            shared = (paddle.to_tensor([0, 2, 3]), paddle.to_tensor([0, 0, 1, 2]))
        response = paddle.to_tensor(ids[:, PROMPT:])
        logp, entropy = token_logprobs(model, paddle.to_tensor(ids), paddle.to_tensor(mask), PROMPT, response, 0.9,
                                       with_entropy=True, shared_prompts=shared)
        valid = paddle.to_tensor(mask[:, PROMPT:].astype("float32"))
    weights = paddle.to_tensor(np.linspace(-1, 1, RESPONSE, dtype=np.float32))
    loss = -((logp * weights + 0.1 * entropy) * valid).sum() / valid.sum()
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    opt.step()
    after = {n: p.numpy().copy() for n, p in model.named_parameters()}
    model.clear_gradients()
    for n, p in model.named_parameters():
        p.set_value(state[n])
    return (logp * valid).numpy(), float(loss), grads, after


def _same(a, b, what):
    close(a[0], b[0], 1e-5, f"{what} logp")
    close(a[1], b[1], 1e-5, f"{what} loss")
    for name in b[2]:
        close(a[2][name], b[2][name], 1e-4, f"{what} grad {name}")
        close(a[3][name], b[3][name], 1e-4, f"{what} step {name}")


def _perturbed(monkeypatch, target, name):
    """target.name's output (its first, for a tuple) scaled by 1.001."""
    fn = getattr(target, name)

    def perturbed(*a, **k):
        out = fn(*a, **k)
        return (out[0] * 1.001, *out[1:]) if isinstance(out, tuple) else out * 1.001
    monkeypatch.setattr(target, name, perturbed)


# the switch, the layouts where it selects a path, and what its fused path calls (to perturb)
CASES = [
    ("attention", ("padded", "shared"), (ops, "blocked_attention")),
    ("attention", ("packed",), (ops, "packed_attention_fused")),
    ("rms_norm", ("padded", "packed"), (norm_module, "rms_norm_fused")),
    ("rope", ("padded", "shared", "packed"), (rope_module, "qkv_rotary_fused")),
    ("head", ("padded", "packed"), (ops, "lm_head_logprobs")),
    ("linear", ("padded",), (linear_bias, "affine_fused")),
]


@pytest.mark.parametrize("switch,layouts,fused", CASES, ids=[f"{c[0]}-{c[1][0]}" for c in CASES])
def test_a_training_step_with_the_switch_on_equals_it_off(monkeypatch, switch, layouts, fused):
    model = _model()
    for layout in layouts:
        with ops.kernels_selected(**{switch: False}):
            off = _step(model, layout)
        with ops.kernels_selected(**{switch: True}):
            on = _step(model, layout)
        _same(on, off, f"{switch} {layout}")
        with monkeypatch.context() as m, ops.kernels_selected(**{switch: True}):
            _perturbed(m, *fused)
            broken = _step(model, layout)
        with pytest.raises(AssertionError):
            _same(broken, off, f"{switch} {layout} perturbed")
        # the off path does not go through the fused one: perturbing it changes nothing there
        with monkeypatch.context() as m, ops.kernels_selected(**{switch: False}):
            _perturbed(m, *fused)
            _same(_step(model, layout), off, f"{switch} {layout} off, fused perturbed")


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_the_fused_qkv_kernel_is_the_composed_ops_bit_for_bit(monkeypatch, layout):
    """Bias + split + rotary + head-major q/k/v in one kernel (ops.qkv_rotary; a packed row as rows of one token, so
    token-major): log-probs, loss, every gradient and the step are the bits of the composed ops
    (PADDLE_RL_FUSED_QKV=0), and the kernel ran once per layer and pass (two passes with the shared prompt prefix)."""
    model = _model()
    calls = []
    fused = rope_module.qkv_rotary_fused
    monkeypatch.setattr(rope_module, "qkv_rotary_fused", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setenv("PADDLE_RL_FUSED_QKV", "0")
    off = _step(model, layout)
    assert not calls
    monkeypatch.setenv("PADDLE_RL_FUSED_QKV", "1")
    on = _step(model, layout)
    assert len(calls) == len(model.layers) * (2 if layout == "shared" else 1)
    np.testing.assert_array_equal(on[0], off[0])
    assert on[1] == off[1]
    for name in off[2]:
        np.testing.assert_array_equal(on[2][name], off[2][name], err_msg=f"grad {name}")
        np.testing.assert_array_equal(on[3][name], off[3][name], err_msg=f"step {name}")


def test_unset_switches_take_the_paths_of_earlier_builds(monkeypatch):
    """Unset: the kernels where they run (RMSNorm, rotary: the q/k/v kernel on padded and packed batches), the
    chunked head, Paddle's linear op, the packed kernel for packed rows and the materialized
    softmax for padded ones."""
    calls = {}

    def count(target, name):
        fn = getattr(target, name)

        def counted(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        monkeypatch.setattr(target, name, counted)
    for target, name in ((norm_module, "rms_norm_fused"), (rope_module, "rotary_fused"), (ops, "lm_head_logprobs"),
                         (ops, "blocked_attention"), (ops, "masked_softmax"), (ops, "packed_attention_fused"),
                         (linear_bias, "affine_fused"), (linear_bias, "affine_reference"),
                         (rope_module, "qkv_rotary_fused")):
        count(target, name)
    model = _model()
    _step(model, "padded")
    padded = dict(calls)
    calls.clear()
    _step(model, "packed")
    assert padded["rms_norm_fused"] and padded["qkv_rotary_fused"] and padded["lm_head_logprobs"] == 1
    assert "rotary_fused" not in padded and "rotary_fused" not in calls and calls["qkv_rotary_fused"]
    assert padded["masked_softmax"] and padded["affine_fused"], padded
    assert "blocked_attention" not in padded and "affine_reference" not in padded, padded
    assert calls["packed_attention_fused"] and "masked_softmax" not in calls, calls


def test_recompute_core_attn_does_not_rerun_the_blocked_core(monkeypatch):
    """With use_flash_attention the core keeps no probabilities, so core_attn recompute does not run it twice; off,
    it does (the materialized probabilities are what it saves)."""
    from paddle_rl.models.decoder import Attention
    runs = []
    core = Attention._core
    monkeypatch.setattr(Attention, "_core", lambda self, *a: runs.append(1) or core(self, *a))
    model = _model()
    model.recompute = "core_attn"
    for flash, expected in ((True, 2), (False, 4)):
        runs.clear()
        with ops.kernels_selected(attention=flash):
            _step(model, "padded")
        assert len(runs) == expected, (flash, runs)


# ---------------------------------------------------------------------------------------- the keys

def _config(tmp_path, **keys):
    path = tmp_path / "c.yaml"
    path.write_text("actor_model_name_or_path: m\n" + "".join(f"{k}: {v}\n" for k, v in keys.items()))
    return str(path)


def test_the_keys_set_the_switches(tmp_path):
    cfg = load_config(_config(tmp_path, use_flash_attention="true", use_fused_rms_norm="false",
                              use_fused_head_and_loss_fn="false", fused_linear="false"))
    assert cfg.kernel_switches == {"attention": True, "rms_norm": False, "rope": None, "head": False, "linear": False}
    assert load_config(_config(tmp_path)).kernel_switches == dict.fromkeys(cfg.kernel_switches)


@pytest.mark.parametrize("keys,message", [
    ({"use_fused_rms_norm": "true", "use_custom_ops": "off"}, "use_fused_rms_norm: true runs the fused kernel"),
    ({"use_fused_rope": "true", "use_custom_ops": "off"}, "use_fused_rope: true runs the fused kernel"),
    ({"use_fused_linear": "true", "fused_linear": "false"}, "fused_linear: False contradicts use_fused_linear"),
])
def test_contradictions_are_refused_by_name(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, **keys))


def test_a_switch_that_cannot_run_is_refused_by_name(monkeypatch):
    try:
        ops.configure("off")
        with pytest.raises(ops.SwitchError, match="use_fused_rope: true needs the fused kernels"):
            ops.select_kernels(rope=True)
    finally:
        ops.configure("on")
    with ops.kernels_selected(rms_norm=True):   # a tensor the kernel does not take
        with pytest.raises(ops.SwitchError, match="use_fused_rms_norm: true, but the fused kernel cannot run"):
            ops.rms_norm(paddle.ones([2, 8], "float64"), paddle.ones([8], "float64"), 1e-6)
    model = _model()
    model.tp_group = object()   # a tensor-parallel head reads each rank's logits slice whole
    assert model.unchunked_head.startswith("use_fused_head_and_loss_fn: true, but under tensor parallelism")

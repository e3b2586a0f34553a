"""Policy losses, KL losses and loss aggregation: hand-computed values, finite-difference gradients,
and the micro-batch invariance of every aggregation mode."""
import numpy as np
import paddle
import pytest

from paddle_rl.algorithms import KL_ESTIMATORS, aggregate_loss, kl_penalty, loss_normalizers, policy_loss
from paddle_rl.config import load_config
from paddle_rl.algorithms import Objective


def t64(x, grad=False):
    return paddle.to_tensor(np.asarray(x, np.float64), stop_gradient=not grad)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# --- values by hand ---------------------------------------------------------------------------

RATIOS = np.array([[1.5, 0.5, 1.1, 4.0, 0.9]])
ADV = np.array([[1.0, -1.0, 1.0, -1.0, 1.0]])
OLD = np.array([[-1.0, -2.0, -0.5, -3.0, -1.5]])
LOGP = OLD + np.log(RATIOS)
MASK = np.ones((1, 5))


def test_ppo_asymmetric_clip_by_hand():
    # clip range [0.8, 1.28]: max(-A r, -A clip(r))
    loss, m = policy_loss("ppo", t64(LOGP), t64(OLD), t64(ADV), MASK, clip_range_ratio_low=0.2,
                          clip_range_ratio_high=0.28)
    np.testing.assert_allclose(loss.numpy(), [[-1.28, 0.8, -1.1, 4.0, -0.9]], rtol=1e-12)
    assert m["clipfrac_low"] == pytest.approx(1 / 5)     # r = 0.5 with A < 0
    assert m["clipfrac_high"] == pytest.approx(1 / 5)    # r = 1.5 with A > 0
    assert m["clipfrac_dual"] == 0.0
    expected_kl = np.mean(0.5 * np.log(RATIOS) ** 2)
    assert m["approx_kl"] == pytest.approx(expected_kl, rel=1e-9)
    assert all(isinstance(v, float) for v in m.values())


def test_ppo_dual_clip_by_hand():
    # r = 4 with A = -1: max(4, 1.28) = 4, bounded by -A c = 3
    loss, m = policy_loss("ppo", t64(LOGP), t64(OLD), t64(ADV), MASK, clip_range_ratio_low=0.2,
                          clip_range_ratio_high=0.28, clip_ratio_c=3.0)
    np.testing.assert_allclose(loss.numpy(), [[-1.28, 0.8, -1.1, 3.0, -0.9]], rtol=1e-12)
    assert m["clipfrac_dual"] == pytest.approx(1 / 5)


def test_ratio_log_is_clamped():
    loss, _ = policy_loss("ppo", t64([[50.0]]), t64([[0.0]]), t64([[-1.0]]), [[1.0]])
    np.testing.assert_allclose(loss.numpy(), [[np.exp(20.0)]], rtol=1e-12)


def test_gspo_sequence_ratio_by_hand():
    # row 0: token log-ratios [log 1.5, 0] -> s = exp(log(1.5) / 2) = sqrt(1.5) > 1.2 -> clipped at 1.2
    # row 1: one token, ratio 0.9 with A = -1 -> max(0.9, 0.9)
    old = np.array([[-1.0, -1.0], [-2.0, -2.0]])
    logp = old + np.log([[1.5, 1.0], [0.9, 1.0]])
    mask = np.array([[1.0, 1.0], [1.0, 0.0]])
    adv = np.array([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = policy_loss("gspo", t64(logp), t64(old), t64(adv), mask)
    np.testing.assert_allclose(loss.numpy()[mask > 0], [-1.2, -1.2, 0.9], rtol=1e-12)
    assert m["clipfrac_high"] == pytest.approx(2 / 3)


def test_cispo_by_hand():
    old = np.array([[-0.2, -1.0, -0.5]]) - np.log([[1.5, 0.5, 1.1]])
    logp = np.array([[-0.2, -1.0, -0.5]])
    adv = np.array([[1.0, -1.0, 2.0]])
    x = t64(logp, grad=True)
    loss, m = policy_loss("cispo", x, t64(old), t64(adv), np.ones((1, 3)))
    # weights sg[clip(r, 0.8, 1.2)] = [1.2, 0.8, 1.1]; loss = -w A logp
    np.testing.assert_allclose(loss.numpy(), [[0.24, -0.8, 1.1]], rtol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[-1.2, 0.8, -2.2]], rtol=1e-12)
    assert m["clipfrac_low"] == pytest.approx(1 / 3) and m["clipfrac_high"] == pytest.approx(1 / 3)


def test_sapo_by_hand():
    old = np.array([[-1.0, -1.0]])
    logp = old + np.log([[1.5, 0.5]])
    adv = np.array([[1.0, -2.0]])
    loss, _ = policy_loss("sapo", t64(logp), t64(old), t64(adv), np.ones((1, 2)), tau_pos=1.0, tau_neg=1.05)
    gate_pos = sigmoid(1.0 * (1.5 - 1.0)) * 4 / 1.0
    gate_neg = sigmoid(1.05 * (0.5 - 1.0)) * 4 / 1.05
    np.testing.assert_allclose(loss.numpy(), [[-gate_pos * 1.0, gate_neg * 2.0]], rtol=1e-12)


def test_unknown_policy_loss():
    with pytest.raises(ValueError, match="unknown policy_loss"):
        policy_loss("trpo", LOGP, OLD, ADV, MASK)


# --- aggregation by hand ----------------------------------------------------------------------

AGG_LOSS = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])   # the third sequence is empty


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 4) / 3),
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ("seq-mean-token-sum-norm", (1 + 2 + 4) / (2 * 4)),
])
def test_aggregation_by_hand(mode, expected):
    out = aggregate_loss(t64(AGG_LOSS), AGG_MASK, mode, loss_scale_factor=4)
    assert float(out) == pytest.approx(expected, rel=1e-12)


def test_aggregation_global_normalizers():
    assert loss_normalizers(AGG_MASK) == (3.0, 2.0)
    assert float(aggregate_loss(t64(AGG_LOSS), AGG_MASK, "token-mean", num_tokens=7, num_seqs=5)) == pytest.approx(1.0)
    assert float(aggregate_loss(t64(AGG_LOSS), AGG_MASK, "seq-mean-token-sum", num_tokens=7, num_seqs=7)) == \
        pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate_loss(t64(AGG_LOSS), AGG_MASK, "sum")


# --- finite-difference gradients --------------------------------------------------------------

FD_OLD = np.array([[-1.2, -0.7, -2.0], [-0.4, -1.5, -0.9]])
# log-ratios kept away from the clip edges (ratios ~1.35, 0.93, 1.05 | 0.7, 1.1, -)
FD_LOGP = FD_OLD + np.array([[0.3, -0.07, 0.05], [-0.36, 0.1, 0.0]])
FD_ADV = np.array([[1.5, 1.5, 1.5], [-0.5, -0.5, -0.5]])
FD_MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
FD_REF = np.array([[-1.0, -0.9, -1.7], [-0.6, -1.2, -0.3]])


def numeric_grad(f, x0, h=1e-6):
    grad = np.zeros_like(x0)
    for idx in np.ndindex(x0.shape):
        up, down = x0.copy(), x0.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad


def autograd(f_tensor, x0):
    x = t64(x0, grad=True)
    f_tensor(x).backward()
    return x.grad.numpy()


@pytest.mark.parametrize("name, options", [
    ("ppo", {"clip_range_ratio_low": 0.2, "clip_range_ratio_high": 0.28}),
    # the dual clip caps token (1, 1)
    ("ppo", {"clip_range_ratio_low": 0.2, "clip_range_ratio_high": 0.2, "clip_ratio_c": 1.05}),
    ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}),
])
def test_policy_loss_finite_differences(name, options):
    def f_tensor(x):
        loss, _ = policy_loss(name, x, t64(FD_OLD), t64(FD_ADV * np.array([[1.0], [3.0]])), FD_MASK, **options)
        return aggregate_loss(loss, FD_MASK, "token-mean")

    expected = numeric_grad(lambda x: float(f_tensor(t64(x))), FD_LOGP)
    np.testing.assert_allclose(autograd(f_tensor, FD_LOGP), expected, rtol=1e-6, atol=1e-8)
    assert np.abs(expected).max() > 0.01
    if "clip_ratio_c" in options:
        assert expected[1, 1] == pytest.approx(0.0, abs=1e-9) and expected[1, 0] == pytest.approx(0.0, abs=1e-9)


def test_gspo_gradient_is_the_sequence_objective():
    # GSPO's token form with seq-mean-token-mean has the gradient of
    #   mean_i max(-A_i s_i, -A_i clip(s_i)),  s_i = exp(mean_t(logp - old))
    def sequence_objective(x):
        lengths = FD_MASK.sum(-1)
        s = np.exp(((x - FD_OLD) * FD_MASK).sum(-1) / lengths)
        a = FD_ADV[:, 0]
        return np.mean(np.maximum(-a * s, -a * np.clip(s, 0.8, 1.2)))

    # the first sequence's ratio exp(0.28 / 3) = 1.098 and the second's exp(-0.26 / 2) = 0.878 are unclipped
    def f_tensor(x):
        loss, _ = policy_loss("gspo", x, t64(FD_OLD), t64(FD_ADV), FD_MASK, clip_range_ratio_low=0.2,
                              clip_range_ratio_high=0.2)
        return aggregate_loss(loss, FD_MASK, "seq-mean-token-mean")

    np.testing.assert_allclose(float(f_tensor(t64(FD_LOGP))), sequence_objective(FD_LOGP), rtol=1e-12)
    np.testing.assert_allclose(autograd(f_tensor, FD_LOGP), numeric_grad(sequence_objective, FD_LOGP),
                               rtol=1e-6, atol=1e-8)


def test_cispo_gradient_is_reinforce_with_frozen_weights():
    weights = np.clip(np.exp(FD_LOGP - FD_OLD), 0.8, 1.2)      # frozen at the evaluation point

    def surrogate(x):
        return (-weights * FD_ADV * x * FD_MASK).sum() / FD_MASK.sum()

    def f_tensor(x):
        loss, _ = policy_loss("cispo", x, t64(FD_OLD), t64(FD_ADV), FD_MASK)
        return aggregate_loss(loss, FD_MASK, "token-mean")

    np.testing.assert_allclose(autograd(f_tensor, FD_LOGP), numeric_grad(surrogate, FD_LOGP), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS))
def test_kl_loss_finite_differences(kind):
    def f_tensor(x):
        return aggregate_loss(kl_penalty(x, t64(FD_REF), kind), FD_MASK, "token-mean")

    expected = numeric_grad(lambda x: float(f_tensor(t64(x))), FD_LOGP)
    np.testing.assert_allclose(autograd(f_tensor, FD_LOGP), expected, rtol=1e-6, atol=1e-8)
    assert np.abs(expected).max() > 0.01


@pytest.mark.parametrize("loss_name", ["ppo", "sapo"])
def test_objective_total_loss_finite_differences(loss_name):
    cfg = load_config(None, ["actor_model_name_or_path=x", f"policy_loss={loss_name}", "kl_loss_coeff=0.3",
                             "entropy_coeff=0.01", "pg_loss_coeff=0.7", "loss_agg_mode=seq-mean-token-sum"])
    objective = Objective(cfg, reduce=None)
    entropy = np.full_like(FD_LOGP, 0.5)

    def f_tensor(x):
        return objective.loss(x, FD_OLD, FD_REF, FD_ADV, FD_MASK, entropy, num_tokens=5, num_seqs=2).loss

    expected = numeric_grad(lambda x: float(f_tensor(t64(x))), FD_LOGP)
    np.testing.assert_allclose(autograd(f_tensor, FD_LOGP), expected, rtol=1e-6, atol=1e-8)
    # the entropy bonus enters with weight -entropy_coeff / num_seqs per token
    ent = t64(entropy, grad=True)
    objective.loss(t64(FD_LOGP), FD_OLD, FD_REF, FD_ADV, FD_MASK, ent, num_tokens=5, num_seqs=2).loss.backward()
    np.testing.assert_allclose(ent.grad.numpy(), -0.01 / 2 * FD_MASK, rtol=1e-12)


# --- micro-batch / rank invariance ------------------------------------------------------------

def _invariance_problem(seed=0, batch=8, length=6, vocab=5):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, length, vocab))
    labels = rng.integers(0, vocab, size=(batch, length))
    lengths = np.array([6, 1, 4, 0, 3, 6, 2, 5])          # one sequence with no tokens (overlong filter)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    base = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), labels[..., None], -1)[..., 0]
    old = base + rng.normal(scale=0.15, size=base.shape)
    ref = base + rng.normal(scale=0.3, size=base.shape)
    adv = np.repeat(rng.normal(size=(batch, 1)), length, axis=1) * mask
    return logits, labels, mask, old, ref, adv


def _grad_for_split(objective, problem, splits):
    logits_np, labels, mask, old, ref, adv = problem
    logits = t64(logits_np, grad=True)
    num_tokens, num_seqs = objective.loss_normalizers(mask)
    for part in np.array_split(np.arange(len(mask)), splits):
        log_probs = paddle.nn.functional.log_softmax(logits[part.tolist()], axis=-1)
        logp = paddle.take_along_axis(log_probs, paddle.to_tensor(labels[part][..., None]), axis=-1).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        out = objective.loss(logp, old[part], ref[part], adv[part], mask[part], entropy, num_tokens, num_seqs)
        out.loss.backward()
    return logits.grad.numpy()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo", "sapo"])
def test_micro_batch_invariance(mode, loss_name):
    cfg = load_config(None, ["actor_model_name_or_path=x", f"loss_agg_mode={mode}", f"policy_loss={loss_name}",
                             "kl_loss_coeff=0.1", "entropy_coeff=0.01", "max_dec_len=16", "min_dec_len=1"])
    objective = Objective(cfg, reduce=None)
    problem = _invariance_problem()
    whole = _grad_for_split(objective, problem, 1)
    assert np.abs(whole).max() > 1e-3
    for splits in (2, 4):
        np.testing.assert_allclose(_grad_for_split(objective, problem, splits), whole, rtol=1e-6, atol=1e-12)


def test_clipped_value_loss_by_hand():
    from paddle_rl.algorithms.value import clipped_value_loss
    # V_old = 0, eps = 0.5, R = 1: V = 2 -> clipped 0.5: max((2-1)^2, (0.5-1)^2) = 1 -> 0.5 (plain term);
    # V = -1 -> clipped -0.5: max(4, 2.25) = 4 -> 2 (plain); V = 0.2 -> inside: 0.5 * 0.64 = 0.32;
    # R = -1, V = 2 -> clipped 0.5: max(9, 2.25) -> 4.5; R = 3, V = 2.0 (old 0) -> clipped 0.5: max(1, 6.25) -> 3.125
    values = paddle.to_tensor([[2.0, -1.0, 0.2, 2.0, 2.0]])
    old = np.zeros((1, 5))
    returns = np.array([[1.0, 1.0, 1.0, -1.0, 3.0]])
    mask = np.array([[1, 1, 1, 1, 1]], np.float32)
    loss, metrics = clipped_value_loss(values, old, returns, mask, 0.5)
    np.testing.assert_allclose(loss.numpy(), [[0.5, 2.0, 0.32, 4.5, 3.125]], rtol=1e-6)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.2)   # only the last token's loss is the clipped term
    assert float(metrics["vpred_mean"]) == pytest.approx(1.04)
    assert float(metrics["vf_loss"]) == pytest.approx((0.5 + 2 + 0.32 + 4.5 + 3.125) / 5, rel=1e-6)

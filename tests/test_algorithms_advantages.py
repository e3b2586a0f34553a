"""Advantage estimators, whitening and KL estimators against numbers worked out by hand."""
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from paddle_rl.algorithms import compute_advantages, kl_penalty, masked_whiten
from paddle_rl.algorithms.advantages import discounted_returns, reinforce_returns
from paddle_rl.algorithms.stats import masked_moments

EPS = 1e-6

# group "a": [1, 0, 0, 1] (mean 0.5, unbiased std sqrt(1/3)); "b": [3, 3] (std 0); "c": [5] (a group of one)
SCORES = np.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 5.0])
GROUPS = np.array(["a", "a", "a", "a", "b", "b", "c"])
MASK = np.array([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]], dtype=np.float32)


def rows(per_sample, mask=MASK):
    """Per-sample values broadcast over the response tokens (zero on padding)."""
    return np.asarray(per_sample, dtype=np.float64)[:, None] * mask


def adv(name, scores=SCORES, mask=MASK, groups=GROUPS, **options):
    return compute_advantages(name, scores, mask, groups, **options).numpy()


def test_grpo_group_std():
    a = 0.5 / (np.sqrt(1 / 3) + EPS)
    expected = rows([a, -a, -a, a, 0.0, 0.0, 5.0 / (1.0 + EPS)])
    out = adv("grpo", grpo_eps=EPS)
    assert out.dtype == np.float32 and out.shape == (7, 2)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_grpo_eps_option_and_tensor_inputs():
    a = 0.5 / (np.sqrt(1 / 3) + 1e-4)
    out = compute_advantages("grpo", paddle.to_tensor(SCORES[:4]), paddle.to_tensor(MASK[:4]),
                             np.array([7, 7, 7, 7]), grpo_eps=1e-4).numpy()
    np.testing.assert_allclose(out, rows([a, -a, -a, a], MASK[:4]), rtol=1e-6)


def test_grpo_scale_rewards_batch_and_none():
    # batch std of [1, 0, 0, 1, 3, 3, 5]: mean 13/7, sum of squared deviations 1022/49, unbiased var 1022/294
    batch_std = np.sqrt(1022 / 294)
    centered = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 5.0]   # a group of one keeps mean 0
    np.testing.assert_allclose(adv("grpo", grpo_eps=EPS, scale_rewards="batch"),
                               rows(np.array(centered) / (batch_std + EPS)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(adv("grpo", scale_rewards="none"), rows(centered), atol=1e-7)
    np.testing.assert_allclose(adv("grpo", norm_adv_by_std=False), rows(centered), atol=1e-7)
    with pytest.raises(ValueError, match="scale_rewards"):
        adv("grpo", scale_rewards="global")


def test_dr_grpo_no_std_division():
    np.testing.assert_allclose(adv("dr_grpo"), rows([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 5.0]), atol=1e-7)


def test_rloo_leave_one_out():
    # 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3 ; a group of one keeps its score
    two_thirds = 2 / 3
    expected = rows([two_thirds, -two_thirds, -two_thirds, two_thirds, 0.0, 0.0, 5.0])
    np.testing.assert_allclose(adv("rloo"), expected, rtol=1e-6, atol=1e-7)


def test_reward_kl_lowers_outcome_scores():
    # k1 per token = old - ref: row 0 [0.5, 0.5] (sum 1), row 1 [0, 2] (sum 2); kl_coeff 0.1
    old = np.array([[-1.0, -2.0], [-1.0, -1.0]])
    ref = np.array([[-1.5, -2.5], [-1.0, -3.0]])
    scores, mask, groups = np.array([1.0, 1.0]), np.ones((2, 2), np.float32), np.array([0, 0])
    # shaped scores 0.9 and 0.8: mean 0.85, unbiased std sqrt(2 * 0.05**2) = 0.05 * sqrt(2)
    out = compute_advantages("dr_grpo", scores, mask, groups, old_logp=old, ref_logp=ref, kl_coeff=0.1).numpy()
    np.testing.assert_allclose(out, [[0.05, 0.05], [-0.05, -0.05]], rtol=1e-5)
    # grpo divides by the group's std where the scores differ: 1.2 and 1.0 become 1.1 and 0.8, std 0.3 / sqrt(2)
    out = compute_advantages("grpo", np.array([1.2, 1.0]), mask, groups, old_logp=old, ref_logp=ref, kl_coeff=0.1,
                             grpo_eps=EPS).numpy()
    a = 0.15 / (0.3 / np.sqrt(2) + EPS)
    np.testing.assert_allclose(out, [[a, a], [-a, -a]], rtol=1e-5)
    # ... and not where they are equal (the next test): the penalty centered, as dr_grpo gives it
    out = compute_advantages("grpo", scores, mask, groups, old_logp=old, ref_logp=ref, kl_coeff=0.1,
                             grpo_eps=EPS).numpy()
    np.testing.assert_allclose(out, [[0.05, 0.05], [-0.05, -0.05]], rtol=1e-5)
    with pytest.raises(ValueError, match="old_logp and ref_logp"):
        compute_advantages("grpo", scores, mask, groups, kl_coeff=0.1)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_equal_score_group_keeps_reward_kl_noise_at_its_size(scale_rewards):
    """A group whose scores are all equal, with a reward KL of rounding size (old and reference log-probs of the
    same weights, as at step 1): the advantages are the centered penalty, about kl_coeff * 1e-7, not the noise
    divided by its own std (which made them of unit size and unrelated between two roundings of the same pass)."""
    rng = np.random.default_rng(0)
    mask = np.ones((8, 6), np.float32)
    old = rng.normal(-1.0, 0.3, (8, 6))
    ref = old + rng.normal(0.0, 1e-7, (8, 6))                     # fp32 rounding-sized gap
    scores = np.array([1.0] * 4 + [0.0, 1.0, 0.0, 1.0])           # group 0 equal, group 1 with a signal
    groups = np.array([0] * 4 + [1] * 4)
    options = dict(old_logp=old, ref_logp=ref, kl_coeff=0.05, grpo_eps=EPS, scale_rewards=scale_rewards)
    out = compute_advantages("grpo", scores, mask, groups, **options).numpy()
    penalty = 0.05 * (old - ref).sum(-1)
    np.testing.assert_allclose(out[:4], rows(penalty[:4].mean() - penalty[:4], mask[:4]), rtol=1e-5, atol=1e-14)
    assert np.abs(out[:4]).max() < 1e-7
    # a second rounding of the same pass moves the equal group's advantages by no more than its own size
    again = compute_advantages("grpo", scores, mask, groups, **dict(options, ref_logp=ref + rng.normal(
        0.0, 1e-7, ref.shape))).numpy()
    assert np.abs(again[:4] - out[:4]).max() < 1e-7
    # the group with a signal: +-0.5 / std (or no division with none), the KL noise a rounding of it
    size = {"group": 0.5 / np.sqrt(1 / 3), "none": 0.5,
            "batch": 0.5 / np.std([1.0] * 5 + [0.0, 0.0, 1.0], ddof=1)}[scale_rewards]
    np.testing.assert_allclose(out[4:, 0], size * np.array([-1, 1, -1, 1]), rtol=1e-5)
    # without the KL an equal group's advantages are exactly 0
    plain = compute_advantages("grpo", scores, mask, groups, grpo_eps=EPS, scale_rewards=scale_rewards).numpy()
    assert not plain[:4].any()


def test_gdpo_per_function_group_then_batch_zscore():
    groups = np.array([0, 0, 1, 1])
    functions = {"acc": np.array([1.0, 0.0, 1.0, 1.0]), "fmt": np.array([1.0, 1.0, 0.0, 1.0])}
    mask = np.ones((4, 3), np.float32)
    a = 0.5 / (np.sqrt(0.5) + EPS)                      # a pair {1, 0}: mean 0.5, unbiased std sqrt(0.5)
    total = np.array([a, -a, -0.5 * a, 0.5 * a])        # acc (weight 1) + fmt (weight 0.5); equal pairs give 0
    std = np.sqrt((2 * a * a + 2 * 0.25 * a * a) / 3)   # batch mean is 0
    out = compute_advantages("gdpo", np.zeros(4), mask, groups, per_function_scores=functions,
                             reward_weights={"acc": 1.0, "fmt": 0.5}, grpo_eps=EPS).numpy()
    np.testing.assert_allclose(out, rows(total / (std + EPS), mask), rtol=1e-6)


def test_discounted_returns_and_reset_outside_mask():
    rewards = np.array([[-0.1, 1.0, 0.0], [0.0, -0.2, -2.0]])
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    np.testing.assert_allclose(discounted_returns(rewards, mask, 1.0), [[0.9, 1.0, 0.0], [-2.2, -2.2, -2.0]])
    # gamma 0.5: row 0: t1 = 1, t0 = -0.1 + 0.5; row 1: t2 = -2, t1 = -0.2 - 1, t0 = 0.5 * -1.2
    np.testing.assert_allclose(discounted_returns(rewards, mask, 0.5), [[0.4, 1.0, 0.0], [-0.6, -1.2, -2.0]])
    # a hole in the mask stops the return from flowing back across it
    np.testing.assert_allclose(discounted_returns([[1.0, 0.0, 2.0]], [[1, 0, 1]], 1.0), [[1.0, 0.0, 2.0]])


RPP_MASK = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
RPP_OLD = np.array([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
RPP_REF = np.array([[-2.0, -1.0, 0.0], [-1.0, -3.0, -1.0]])   # k1 = [[1, 0, 0], [0, 2, 0]]


def test_reinforce_plus_plus_by_hand():
    # token rewards: -0.1 * k1, plus the score on the last response token:
    #   row 0: [-0.1, 1, 0] -> returns [0.9, 1];  row 1: [0, -0.2, -2] -> returns [-2.2, -2.2, -2]
    returns = reinforce_returns([1.0, -2.0], RPP_MASK, RPP_OLD, RPP_REF, kl_coeff=0.1)
    np.testing.assert_allclose(returns, [[0.9, 1.0, 0.0], [-2.2, -2.2, -2.0]], atol=1e-12)
    # whitening over the 5 valid tokens: mean -0.9, squared deviations sum 11.44, unbiased var 2.86
    expected = (np.array([[0.9, 1.0, 0.0], [-2.2, -2.2, -2.0]]) + 0.9) / np.sqrt(2.86 + 1e-8) * RPP_MASK
    out = compute_advantages("reinforce_plus_plus", [1.0, -2.0], RPP_MASK, None, old_logp=RPP_OLD,
                             ref_logp=RPP_REF, kl_coeff=0.1).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_clips_scores():
    returns = reinforce_returns([20.0], [[1, 1]], clip_range_score=10.0)
    np.testing.assert_allclose(returns, [[10.0, 10.0]])


def test_reinforce_plus_plus_baseline_by_hand():
    # one group [1, 3]: mean 2 -> [-1, 1]; returns row 0 [-1, -1], row 1 [1, pad]
    # valid [-1, -1, 1]: mean -1/3, squared deviations 4/9 + 4/9 + 16/9, unbiased var (24/9)/2 = 4/3
    mask = np.array([[1, 1], [1, 0]], np.float32)
    out = compute_advantages("reinforce_plus_plus_baseline", [1.0, 3.0], mask, [0, 0]).numpy()
    low, high = (-2 / 3) / np.sqrt(4 / 3 + 1e-8), (4 / 3) / np.sqrt(4 / 3 + 1e-8)
    np.testing.assert_allclose(out, [[low, low], [high, 0.0]], rtol=1e-6)


def test_masked_whiten_by_hand_and_across_ranks():
    values = np.array([[1.0, 2.0], [3.0, 9.0]])
    mask = np.array([[1, 1], [1, 0]], np.float32)
    # valid [1, 2, 3]: mean 2, unbiased var 1
    whole = masked_whiten(values, mask)
    np.testing.assert_allclose(whole, [[-1.0, 0.0], [1.0, 0.0]] / np.sqrt(1 + 1e-8))
    # two "ranks", each holding one row: the hook adds the other rank's [count, sum, sumsq]
    rank0 = masked_whiten(values[:1], mask[:1], reduce=lambda v: v + masked_moments(values[1:], mask[1:]))
    rank1 = masked_whiten(values[1:], mask[1:], reduce=lambda v: v + masked_moments(values[:1], mask[:1]))
    np.testing.assert_allclose(np.concatenate([rank0, rank1]), whole)
    # tensors in, float32 tensors out
    out = masked_whiten(paddle.to_tensor(values), paddle.to_tensor(mask))
    assert isinstance(out, paddle.Tensor) and out.dtype == paddle.float32


def test_reinforce_plus_plus_statistics_are_global():
    scores = [1.0, -2.0]
    hook0 = lambda v: v + masked_moments(reinforce_returns(scores[1:], RPP_MASK[1:], RPP_OLD[1:], RPP_REF[1:], 0.1),
                                         RPP_MASK[1:])
    part = compute_advantages("reinforce_plus_plus", scores[:1], RPP_MASK[:1], None, old_logp=RPP_OLD[:1],
                              ref_logp=RPP_REF[:1], kl_coeff=0.1, reduce=hook0).numpy()
    # row 0 of the whole-batch result: returns [0.9, 1.0], mean -0.9, var 2.86
    np.testing.assert_allclose(part, [[1.8, 1.9, 0.0]] / np.sqrt(2.86 + 1e-8), rtol=1e-5)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo_gae", SCORES, MASK, GROUPS)


# --- KL estimators ----------------------------------------------------------------------------

LOGP = np.array([[-1.0, -2.0, -0.5]])
REF = np.array([[-1.5, -1.0, -0.5]])          # d = logp - ref = [0.5, -1, 0]


@pytest.mark.parametrize("kind, expected", [
    ("kl", [[0.5, -1.0, 0.0]]),
    ("abs", [[0.5, 1.0, 0.0]]),
    ("mse", [[0.125, 0.5, 0.0]]),
    ("low_var_kl", [[np.exp(-0.5) + 0.5 - 1.0, np.exp(1.0) - 1.0 - 1.0, 0.0]]),
])
def test_kl_estimators(kind, expected):
    out = kl_penalty(paddle.to_tensor(LOGP), paddle.to_tensor(REF), kind)
    assert out.dtype == paddle.float64
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_low_var_kl_clamps():
    # ref - logp = +-30 is clamped to +-20: exp(-20) + 20 - 1 = 19.0..., exp(20) - 21: both clamp to 10
    out = kl_penalty(np.array([[0.0, -30.0, -1.0]]), np.array([[-30.0, 0.0, -1.0]]), "low_var_kl").numpy()
    np.testing.assert_allclose(out, [[10.0, 10.0, 0.0]])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(LOGP, REF, "k4")


# --- real data-parallel ranks (two CPU processes over gloo) -----------------------------------

DP_WORKER = '''
import json, sys
import numpy as np
import paddle.distributed as dist
dist.init_parallel_env()
from paddle_rl.algorithms import compute_advantages
rank = dist.get_rank()
group = dist.new_group([0, 1])   # the batch group, passed explicitly (there is no default group)
mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
old = np.array([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
ref = np.array([[-2.0, -1.0, 0.0], [-1.0, -3.0, -1.0]])
rows = slice(rank, rank + 1)
args = ("reinforce_plus_plus", [[1.0], [-2.0]][rank], mask[rows], None)
adv = compute_advantages(*args, old_logp=old[rows], ref_logp=ref[rows], kl_coeff=0.1, reduce=group)
local = compute_advantages(*args, old_logp=old[rows], ref_logp=ref[rows], kl_coeff=0.1)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"global": adv.numpy().tolist(), "local": local.numpy().tolist()}, f)
'''


def test_whitening_is_global_across_real_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(DP_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--devices", "", "--nproc_per_node", "2",
           "--log_dir", str(tmp_path / "logs"), str(script), str(tmp_path)]
    result = subprocess.run(cmd, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            capture_output=True, text=True, timeout=120)
    outputs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "logs").glob("*"))
                   if p.is_file())
    # no skip: a launch that cannot run here is a failure, with what the launcher and the workers said
    assert result.returncode == 0 and all(p.exists() for p in outputs), (
        f"launch exited {result.returncode}, wrote {[p.name for p in outputs if p.exists()]}\n"
        f"{result.stderr[-1500:]}{logs}")
    ranks = [json.loads(p.read_text()) for p in outputs]
    got = np.array([r["global"][0] for r in ranks])
    # returns [0.9, 1.0] and [-2.2, -2.2, -2.0] whitened together: mean -0.9, unbiased var 2.86
    scale = np.sqrt(2.86 + 1e-8)
    np.testing.assert_allclose(got, [[1.8 / scale, 1.9 / scale, 0.0], [-1.3 / scale, -1.3 / scale, -1.1 / scale]],
                               rtol=1e-5)
    # the same as one process whitening the whole batch ...
    whole = compute_advantages("reinforce_plus_plus", [1.0, -2.0], RPP_MASK, None, old_logp=RPP_OLD,
                               ref_logp=RPP_REF, kl_coeff=0.1).numpy()
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-7)
    # ... and not what each rank's own rows give (the reduction changed the numbers)
    local = np.array([r["local"][0] for r in ranks])
    assert np.abs(local - whole).max() > 0.1, local


# --- GAE (rl_algorithm ppo) ----------------------------------------------------------------------

def gae(scores, mask, values, **options):
    options.setdefault("whiten_advantages", False)
    adv_t, returns = compute_advantages("gae", np.asarray(scores, np.float64), np.asarray(mask, np.float32), None,
                                        values=np.asarray(values, np.float64), **options)
    return adv_t.numpy().astype(np.float64), returns


def test_gae_gamma_lam_one_is_return_minus_value():
    # score 1 on the last token, gamma = lam = 1: A_t = (sum of later rewards) - V_t = 1 - V_t, R_t = 1
    adv, returns = gae([1.0], [[1, 1, 1]], [[0.5, 0.2, -0.1]])
    np.testing.assert_allclose(adv, [[0.5, 0.8, 1.1]], atol=1e-6)
    np.testing.assert_allclose(returns, [[1.0, 1.0, 1.0]], atol=1e-12)


def test_gae_discounted_by_hand():
    # V = [1, 2], r = [0, 1], gamma 0.9, lam 0.5:
    # t=1: delta = 1 + 0.9*0 - 2 = -1, A1 = -1;  t=0: delta = 0 + 0.9*2 - 1 = 0.8, A0 = 0.8 + 0.45*(-1) = 0.35
    adv, returns = gae([1.0], [[1, 1]], [[1.0, 2.0]], gamma=0.9, lam=0.5)
    np.testing.assert_allclose(adv, [[0.35, -1.0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[1.35, 1.0]], atol=1e-6)


def test_gae_skips_tokens_outside_the_mask():
    # padding after the response and an observation token inside it (multi-turn) are not steps of the recursion:
    # [1, hole, 1] with V [1, 99, 2] gives the same numbers as the two-token case above, 0 on the hole
    adv, returns = gae([1.0, 1.0], [[1, 0, 1], [1, 1, 0]], [[1.0, 99.0, 2.0], [1.0, 2.0, 7.0]], gamma=0.9, lam=0.5)
    np.testing.assert_allclose(adv, [[0.35, 0.0, -1.0], [0.35, -1.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[1.35, 0.0, 1.0], [1.35, 1.0, 0.0]], atol=1e-6)


def test_gae_reward_kl_and_score_clip():
    # k1 reward KL: old - ref = [0.5, 0] -> r = [-0.1*0.5, clip(20, 10)] = [-0.05, 10]; V = 0, gamma = lam = 1
    adv, returns = gae([20.0], [[1, 1]], [[0.0, 0.0]], old_logp=np.array([[-1.0, -1.0]]),
                       ref_logp=np.array([[-1.5, -1.0]]), kl_coeff=0.1, clip_range_score=10.0)
    np.testing.assert_allclose(adv, [[9.95, 10.0]], atol=1e-5)
    np.testing.assert_allclose(returns, [[9.95, 10.0]], atol=1e-6)


def test_gae_whitening_is_an_option_and_leaves_returns():
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    values = np.array([[0.1, 0.3, -0.2], [0.4, 0.0, 5.0]])
    raw, r_raw = gae([1.0, -1.0], mask, values, gamma=0.95, lam=0.9)
    white, r_white = gae([1.0, -1.0], mask, values, gamma=0.95, lam=0.9, whiten_advantages=True)
    np.testing.assert_allclose(white, masked_whiten(raw, mask), atol=1e-6)
    assert abs(white[mask > 0].mean()) < 1e-6 and not np.allclose(white, raw)
    np.testing.assert_array_equal(r_raw, r_white)
    np.testing.assert_allclose(r_raw, (raw + values) * mask, atol=1e-6)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages("gae", np.ones(1), np.ones((1, 2), np.float32), None)

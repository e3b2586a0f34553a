"""Rollout correction (rollout_is / rollout_rs / rollout_token_veto_threshold): the math by hand, the loss weight,
the config checks, and training runs that use it."""
import math

import numpy as np
import pytest

from micro_model import micro_overrides
from paddle_rl.algorithms.correction import correction_metrics, rollout_correction
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import read_metrics

BASE = ["actor_model_name_or_path=x"]
# two responses: log r = old - rollout per token; row 1's third token is padding (its values must not count)
LOG_R = np.array([[0.1, -0.2, 0.5], [0.0, 1.0, 3.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ROLLOUT = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.0]])
OLD = ROLLOUT + LOG_R


def correct(**options):
    weight, keep, sums = rollout_correction(OLD, ROLLOUT, MASK, **options)
    return weight, keep, correction_metrics(sums)


def test_token_is_truncates_each_ratio():
    weight, keep, _ = correct(is_level="token", is_threshold=1.5)
    e = math.exp
    np.testing.assert_allclose(weight, [[e(0.1), e(-0.2), 1.5], [1.0, 1.5, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(keep, MASK)  # IS alone rejects nothing


def test_sequence_is_weights_every_token_by_the_product():
    weight, _, _ = correct(is_level="sequence", is_threshold=2.0)
    np.testing.assert_allclose(weight, [[math.exp(0.4)] * 3, [2.0, 2.0, 0.0]], rtol=1e-6)


def test_token_rejection_uses_the_reciprocal_lower_bound_by_default():
    weight, keep, m = correct(rs_level="token", rs_upper=1.5)
    # ratios 1.105 0.819 1.649 | 1.0 2.718: outside [0.667, 1.5] are the third of row 0 and the second of row 1
    np.testing.assert_array_equal(keep, [[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(weight, MASK)  # no IS: weight 1 under the mask
    assert m["rollout_corr/rejected_token_share"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rejected_seq_share"] == 0.0
    _, keep, _ = correct(rs_level="token", rs_upper=1.5, rs_lower=0.85)  # now 0.819 falls below too
    np.testing.assert_array_equal(keep, [[1, 0, 0], [1, 0, 0]])


def test_sequence_and_geometric_rejection_judge_whole_responses():
    _, keep, m = correct(rs_level="sequence", rs_upper=1.6)     # e^0.4 = 1.49 kept, e^1.0 = 2.72 rejected
    np.testing.assert_array_equal(keep, [[1, 1, 1], [0, 0, 0]])
    assert m["rollout_corr/rejected_seq_share"] == 0.5
    _, keep, _ = correct(rs_level="geometric", rs_upper=1.2)    # e^(0.4/3) = 1.14 kept, e^(1/2) = 1.65 rejected
    np.testing.assert_array_equal(keep, [[1, 1, 1], [0, 0, 0]])
    _, keep, _ = correct(rs_level="geometric", rs_upper=1.1)    # now both
    np.testing.assert_array_equal(keep, np.zeros_like(MASK))


def test_veto_rejects_a_response_with_one_tiny_ratio():
    _, keep, _ = correct(veto_threshold=0.85)                   # row 0 has e^-0.2 = 0.819
    np.testing.assert_array_equal(keep, [[0, 0, 0], [1, 1, 0]])


def test_metrics_by_hand():
    _, _, m = correct(is_level="token", is_threshold=1.5)
    r = np.exp(LOG_R[MASK > 0])
    log_r = LOG_R[MASK > 0]
    assert m["rollout_corr/kl"] == pytest.approx(-log_r.mean())             # k1 of KL(rollout || old)
    assert m["rollout_corr/k3_kl"] == pytest.approx((r - 1 - log_r).mean())
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(np.minimum(r, 1.5).mean())
    assert m["rollout_corr/is_weight/max"] == pytest.approx(1.5)
    assert m["rollout_corr/ratio/max"] == pytest.approx(math.e)             # the padded 3.0 is not counted


def test_greedy_differs_counts_masked_tokens_by_hand():
    rollout = np.array([[5, 7, 9], [1, 2, 3]])
    trainer = np.array([[5, 8, 9], [1, 2, 4]])   # differs at (0, 1) and at the padded (1, 2), which must not count
    _, _, sums = rollout_correction(OLD, ROLLOUT, MASK, greedy=(rollout, trainer))
    assert correction_metrics(sums, greedy=True)["rollout_corr/greedy_differs"] == pytest.approx(1 / 5)
    assert "rollout_corr/greedy_differs" not in correction_metrics(sums)


def test_loss_multiplies_the_policy_term_by_the_weight():
    from paddle_rl.algorithms.objective import Objective
    cfg = load_config(None, BASE + ["rl_algorithm=grpo", "kl_loss_coeff=0", "policy_loss=ppo"])
    obj = Objective(cfg, reduce=None)
    rng = np.random.default_rng(0)
    logp = rng.normal(-1, 0.1, (2, 3)).astype(np.float32)
    old = logp + rng.normal(0, 0.05, (2, 3)).astype(np.float32)
    adv = rng.normal(0, 1, (2, 3)).astype(np.float32)
    weight = np.array([[0.5, 1.0, 2.0], [1.5, 0.25, 0.0]], np.float32)
    plain = obj.loss(logp, old, None, adv, MASK, None, MASK.sum(), 2)
    weighted = obj.loss(logp, old, None, adv, MASK, None, MASK.sum(), 2, is_weight=weight)
    assert float(weighted.loss) != pytest.approx(float(plain.loss))
    # token-mean: the loss is the sum of per-token terms over all tokens; check it term by term
    terms = []
    for i in range(2):
        for j in range(3):
            one = np.zeros_like(MASK)
            one[i, j] = MASK[i, j]
            terms.append(float(obj.loss(logp, old, None, adv, one, None, MASK.sum(), 2).loss) * weight[i, j])
    assert float(weighted.loss) == pytest.approx(sum(terms), rel=1e-5)


def test_config_refuses_what_cannot_act():
    with pytest.raises(ConfigError, match="rollout_is: must be token, sequence or null, got 'tok'"):
        load_config(None, BASE + ["rollout_is=tok"])
    with pytest.raises(ConfigError, match="reuse_rollout_logprobs"):
        load_config(None, BASE + ["rollout_is=token", "reuse_rollout_logprobs=on"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold: set without rollout_rs"):
        load_config(None, BASE + ["rollout_rs_threshold=2"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold_lower"):
        load_config(None, BASE + ["rollout_rs=token", "rollout_rs_threshold=1.5", "rollout_rs_threshold_lower=2"])
    assert load_config(None, BASE + ["rollout_rs=null"]).rollout_correction is False


RULE = "distinct_chars_for_correction_test"


@pytest.fixture
def varied_reward(monkeypatch):
    """A rule whose scores differ within a group (the share of distinct characters), so advantages are not 0."""
    from paddle_rl.rewards import register_rule
    from paddle_rl.rewards.rules import RULE_REWARDS
    monkeypatch.setitem(RULE_REWARDS, RULE, None)  # the rule leaves the registry with the test

    @register_rule(RULE)
    def distinct_chars(samples, *args, **kwargs):
        return np.array([len(set(s.response)) / max(len(s.response), 1) for s in samples], np.float32), None


def _train(micro, path, **keys):
    from paddle_rl.trainer import RLTrainer
    overrides = micro_overrides(micro, str(path), **{"max_steps": 2, "do_eval": False, "reward_funcs": f"[{RULE}]",
                                                     "global_mini_batch_size": 4, **keys})
    RLTrainer(load_config(None, overrides)).train()
    return read_metrics(str(path / "metrics.jsonl"))


def test_training_reports_the_gap_and_rejects_by_the_bounds(micro, tmp_path, varied_reward):
    plain = _train(micro, tmp_path / "plain")
    assert not any(k.startswith("rollout_corr/") for k in plain[0])
    assert plain[0]["actor/grad_norm"] > 0
    corrected = _train(micro, tmp_path / "is", rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0)
    for row in corrected:
        # a synchronous run: the rollout's kernels and the training forward agree to float rounding
        assert abs(row["rollout_corr/kl"]) < 1e-5 and 0 <= row["rollout_corr/k3_kl"] < 1e-9
        assert row["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert row["rollout_corr/rejected_token_share"] == 0.0
    # the same first update: nothing rejected, weights 1 to rounding
    assert corrected[0]["actor/pg_loss"] == pytest.approx(plain[0]["actor/pg_loss"], rel=1e-4, abs=1e-7)
    assert corrected[0]["actor/grad_norm"] == pytest.approx(plain[0]["actor/grad_norm"], rel=1e-4)
    # bounds tighter than the rounding gap reject the tokens where the two forwards differ at all
    tight = _train(micro, tmp_path / "tight", rollout_rs="token", rollout_rs_threshold=1.0 + 1e-9,
                   rollout_rs_threshold_lower=1.0 - 1e-9)
    assert tight[0]["rollout_corr/rejected_token_share"] > 0
    # a veto at a ratio above 1 rejects every response: the step skips its update (momentum alone would move
    # the weights)
    vetoed = _train(micro, tmp_path / "veto", rollout_token_veto_threshold=1.5)
    assert vetoed[0]["rollout_corr/rejected_seq_share"] == 1.0
    assert vetoed[0]["actor/skipped_update"] == 1.0 and "actor/grad_norm" not in vetoed[0]


def test_data_parallel_equals_one_process(micro, tmp_path):
    """DP=2 through run_rl.py with token IS and geometric rejection on: the same losses, statistics (the
    rollout_corr/* metrics summed over both ranks) and weights as one process."""
    import os

    from paddle_rl.trainer import RLTrainer
    from test_parallel import PLUGIN, ROOT, assert_parity, launch, run_overrides
    plugin = tmp_path / "parity_reward.py"
    plugin.write_text(PLUGIN)
    keys = dict(rollout_is="token", rollout_rs="geometric", rollout_rs_threshold=1.5)
    single, dp = tmp_path / "single", tmp_path / "dp"
    single.mkdir()
    dp.mkdir()
    RLTrainer(load_config(None, run_overrides(micro, str(single), str(plugin), **keys))).train()
    launch([os.path.join(ROOT, "paddle_rl", "run_rl.py"), os.path.join(ROOT, "configs", "tiny_kk_grpo.yaml"),
            *run_overrides(micro, str(dp), str(plugin), data_parallel_degree=2, eval_datasets="", logging_dir="",
                           **keys)], str(tmp_path / "log"))
    rows = read_metrics(str(dp / "metrics.jsonl"))
    assert all("rollout_corr/k3_kl" in r for r in rows)
    assert_parity(str(single), str(dp))


# ------------------------------------------------------------------------------ real gaps: a stale rollout

def _stale(micro, plugin, out, staleness, **keys):
    """An asynchronous run whose batches lag the trainer by `staleness` policy versions (from step 2 on: the first
    batch is generated and trained on the initial weights); 4 steps, the last checkpoint's weights."""
    from paddle_rl.model_files.safetensors_io import load_state
    from paddle_rl.trainer import RLTrainer
    overrides = micro_overrides(micro, str(out), max_steps=4, do_eval=False, save_steps=4, reward_plugins=plugin,
                                reward_funcs="length_parity", kl_loss_coeff=0.0, async_rollout=True,
                                max_staleness=staleness, **keys)
    RLTrainer(load_config(None, overrides)).train()
    return read_metrics(str(out / "metrics.jsonl")), load_state(str(out / "checkpoint-4"))


@pytest.fixture(scope="module")
def parity_plugin(tmp_path_factory):
    from test_parallel import PLUGIN
    path = tmp_path_factory.mktemp("stale") / "reward.py"
    path.write_text(PLUGIN)
    return str(path)


def _weight_change(a, b):
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


GAP = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/ratio/max")
CORRECTION_ONLY = ("rollout_corr/is_weight_mean", "rollout_corr/is_weight/max", "rollout_corr/rejected_token_share",
                   "rollout_corr/rejected_seq_share")


STALE_RUNS = {}


def _plain_stale(micro, plugin, tmp_path_factory, staleness):
    """The uncorrected stale run of `staleness` (made once per module)."""
    if staleness not in STALE_RUNS:
        STALE_RUNS[staleness] = _stale(micro, plugin, tmp_path_factory.mktemp(f"plain{staleness}"), staleness)
    return STALE_RUNS[staleness]


def test_the_gap_is_reported_without_any_correction_key(micro, parity_plugin, tmp_path_factory):
    """No rollout_is / rollout_rs: the gap metrics are still there every step (the old log-probs are recomputed:
    the rollout's are a stale policy's). Step 1 is trained on the weights that generated it: rounding. From step 2
    the batch lags by real updates, and two versions of lag show a larger gap than one."""
    runs = {k: _plain_stale(micro, parity_plugin, tmp_path_factory, k)[0] for k in (1, 2)}
    for rows in runs.values():
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(set(GAP) <= set(r) and not set(r) & set(CORRECTION_ONLY) for r in rows)
        first = rows[0]
        assert abs(first["rollout_corr/kl"]) < 1e-6 and 0 <= first["rollout_corr/k3_kl"] < 1e-12
        assert first["rollout_corr/ratio/max"] < 1 + 1e-5
        for r in rows[1:]:  # lr 1e-3 moves the micro model's log-probs by a few percent a step
            assert 1e-5 < r["rollout_corr/k3_kl"] < 1e-2 and 1.01 < r["rollout_corr/ratio/max"] < 2
    # step 2 is the same batch (initial weights) against the same old weights (after step 1) in both runs
    assert runs[2][1]["rollout_corr/k3_kl"] == runs[1][1]["rollout_corr/k3_kl"]
    for step in (2, 3):  # steps 3, 4: two updates between rollout and trainer instead of one
        assert runs[2][step]["rollout_corr/k3_kl"] > 2 * runs[1][step]["rollout_corr/k3_kl"]


@pytest.mark.parametrize("staleness", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_correction_changes_the_update_of_a_stale_rollout(micro, parity_plugin, tmp_path, tmp_path_factory,
                                                          staleness):
    """rollout_is: token and rollout_rs: token on a batch lagging by `staleness` versions: the same gap measured,
    weights that are not 1 (mean 1 + k3 - k1 exactly, nothing truncated), tokens rejected, and final weights
    that differ from the uncorrected run's; step 1 (no lag) trains as the uncorrected run does."""
    plain, plain_w = _plain_stale(micro, parity_plugin, tmp_path_factory, staleness)
    weighted, weighted_w = _stale(micro, parity_plugin, tmp_path / "is", staleness, rollout_is="token")
    rejected, rejected_w = _stale(micro, parity_plugin, tmp_path / "rs", staleness, rollout_rs="token",
                                  rollout_rs_threshold=1.05)
    for rows in (weighted, rejected):
        assert rows[0]["actor/grad_norm"] == pytest.approx(plain[0]["actor/grad_norm"], rel=1e-5)
        # step 2: the batch and the old weights are those of the uncorrected run; so is the gap
        assert rows[1]["rollout_corr/k3_kl"] == pytest.approx(plain[1]["rollout_corr/k3_kl"], rel=1e-5)
    for r in weighted[1:]:
        mean = r["rollout_corr/is_weight_mean"]
        assert 1e-4 < abs(mean - 1) < 0.02
        assert mean == pytest.approx(1 + r["rollout_corr/k3_kl"] - r["rollout_corr/kl"], abs=1e-9)
        assert r["rollout_corr/is_weight/max"] == r["rollout_corr/ratio/max"] < 2.0  # below the truncation
    assert rejected[0]["rollout_corr/rejected_token_share"] == 0.0
    assert any(0 < r["rollout_corr/rejected_token_share"] < 0.5 for r in rejected[1:])
    for w in (weighted_w, rejected_w):
        assert _weight_change(plain_w, w) > 1e-3  # Adam steps of lr 1e-3 move single weights by ~1e-3


def test_greedy_choices_differ_under_a_low_precision_rollout(micro, tmp_path, varied_reward):
    """rollout_corr/greedy_differs: the share of response tokens where the argmax of the rollout's logits differs
    from the argmax of the trainer's old-log-prob pass. A float32 rollout agrees with the trainer everywhere (the
    two forwards differ by rounding only); a bfloat16 rollout chooses otherwise at a few tokens and a
    weight_only_int4 one at many (one step, 32 responses of exactly 48 tokens)."""
    share = {}
    for name, keys in (("float32", {"reuse_rollout_logprobs": "off"}), ("bfloat16", {"rollout_dtype": "bfloat16"}),
                       ("int4", {"rollout_quant_type": "weight_only_int4"})):
        rows = _train(micro, tmp_path / name, max_steps=1, max_dec_len=48, min_dec_len=48, rollout_n=8, **keys)
        share[name] = rows[0]["rollout_corr/greedy_differs"]
    print("greedy_differs", share)
    # measured: 0.0, 0.0046 (7 of 1,536 tokens), 0.163
    assert share["float32"] == 0.0
    assert 0.0 < share["bfloat16"] < 0.02 and 0.08 < share["int4"] < 0.3


def test_on_policy_old_logprobs_come_from_the_update(micro, tmp_path, varied_reward):
    """old_logprob_pass auto: on-policy (one mini-batch, update_iters 1) with a bfloat16 rollout, the old log-probs
    are the update's own forward's, detached: no old-log-prob pass runs (no time/old_logprob), yet the step reports
    what the pass would (the rollout_corr gap, greedy_differs, the token KL against the reference) to float
    rounding, and trains as the run with the pass (old_logprob_pass on) does. With the KL in the reward (kl_coeff >
    0) the advantages need them first, so the pass runs."""
    keys = dict(rollout_dtype="bfloat16", kl_loss_coeff=0.05, max_dec_len=24, min_dec_len=24)
    auto = _train(micro, tmp_path / "auto", **keys)
    with_pass = _train(micro, tmp_path / "on", old_logprob_pass="on", **keys)
    assert all("time/old_logprob" not in r for r in auto) and all("time/old_logprob" in r for r in with_pass)
    for step in (0, 1):
        for key in GAP + ("rollout_corr/greedy_differs", "actor/ref_kl", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert auto[step][key] == pytest.approx(with_pass[step][key], rel=1e-4, abs=1e-7), (step, key)
    print("ref_kl", auto[0]["actor/ref_kl"], auto[1]["actor/ref_kl"], "k3", auto[0]["rollout_corr/k3_kl"])
    assert auto[0]["rollout_corr/k3_kl"] > 0 and abs(auto[0]["actor/ref_kl"]) < 1e-6   # step 1: the reference is the actor
    assert abs(auto[1]["actor/ref_kl"]) > 1e-5
    reward_kl = _train(micro, tmp_path / "reward_kl", kl_coeff=0.05, max_steps=1, **keys)
    assert "time/old_logprob" in reward_kl[0]

"""Objective: YAML selection, presets, score shaping, DAPO filters, adaptive KL and resumable state."""
import json
import logging
import os

import numpy as np
import paddle
import pytest

from paddle_rl.algorithms import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, Objective,
                                  compute_advantages, soft_overlong_penalty)
from paddle_rl.algorithms.advantages import SCALE_REWARDS, broadcast, group_mean_std, register_advantage
from paddle_rl.config import ConfigError, RLConfig, config_to_dict, load_config
from paddle_rl.config import algorithm_args
from paddle_rl.config.fields import above
from paddle_rl.config.options import PIECE_OPTIONS, option

BASE = ["actor_model_name_or_path=x"]


def objective(*overrides, reduce=None):
    return Objective(load_config(None, BASE + list(overrides)), reduce=reduce)


def tiny_batch():
    scores = np.array([1.0, 0.0, 2.0, 2.5])
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], np.float32)
    groups = np.array([0, 0, 1, 1])
    old = np.array([[-1.0, -1.2, 0.0], [-0.5, -2.0, -1.0], [-0.3, 0.0, 0.0], [-1.1, -0.4, -0.9]], np.float32)
    ref = old - 0.1
    return scores, mask, groups, old, ref


# --- selectable from YAML ---------------------------------------------------------------------

def test_config_does_not_copy_the_registries():
    # the registries are the one list of names; the config no longer keeps its own copy
    for name in ("ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "KL_ESTIMATORS", "LOSS_AGG_MODES"):
        assert not hasattr(algorithm_args, name), name
    presets = {algorithm_args.PRESET_ESTIMATORS.get(a, a) for a in algorithm_args.RL_ALGORITHMS}
    assert presets <= set(ADVANTAGE_ESTIMATORS)   # each preset names an estimator


CHOICES = ([("advantage_estimator", n) for n in ADVANTAGE_ESTIMATORS]
           + [("rl_algorithm", n) for n in algorithm_args.RL_ALGORITHMS]
           + [("policy_loss", n) for n in POLICY_LOSSES]
           + [("loss_agg_mode", n) for n in LOSS_AGG_MODES]
           + [("kl_loss_type", n) for n in KL_ESTIMATORS]
           + [("kl_penalty", n) for n in KL_ESTIMATORS]
           + [("algorithm_preset", n) for n in algorithm_args.ALGORITHM_PRESETS]
           + [("scale_rewards", n) for n in SCALE_REWARDS])


@pytest.mark.parametrize("key, value", CHOICES)
def test_every_choice_builds_and_runs(key, value, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"actor_model_name_or_path: x\n{key}: {value}\nkl_coeff: 0.05\nkl_loss_coeff: 0.1\n")
    obj = Objective(load_config(str(path)), reduce=None)
    scores, mask, groups, old, ref = tiny_batch()
    values = np.full(mask.shape, 0.1) if obj.uses_critic else None   # gae: the critic's values
    adv = obj.advantages(scores, mask, groups, old, ref, values=values)
    assert adv.shape == [4, 3] and adv.dtype == paddle.float32 and np.isfinite(adv.numpy()).all()
    logp = paddle.to_tensor(old + 0.05, stop_gradient=False)
    out = obj.loss(logp, old, ref, adv, mask, paddle.full([4, 3], 0.7), *obj.loss_normalizers(mask))
    out.loss.backward()
    assert np.isfinite(float(out.loss)) and logp.grad is not None
    assert out.num_tokens == 9.0


@pytest.mark.parametrize("key, value", [
    ("advantage_estimator", "vtrace"), ("rl_algorithm", "a2c"), ("policy_loss", "trpo"), ("loss_agg_mode", "sum"),
    ("kl_loss_type", "k3"), ("kl_penalty", "full"), ("algorithm_preset", "openrlhf"), ("scale_rewards", "global"),
    ("dynamic_sampling_fallback", "skip"), ("clip_ratio_c", "0.5"), ("tau_neg", "0"), ("gamma", "1.5"),
    ("kl_horizon", "0"), ("max_gen_batches", "0"), ("loss_scale_factor", "0"), ("grpo_eps", "-1"),
])
def test_bad_value_names_the_key(key, value):
    # types, ranges and presets fail in load_config; registered names when the Objective is built (RLTrainer
    # builds it before loading any model)
    with pytest.raises(ConfigError, match=key):
        objective(f"{key}={value}")


@pytest.mark.parametrize("key, value, registry", [
    ("advantage_estimator", "vtrace", ADVANTAGE_ESTIMATORS), ("policy_loss", "trpo", POLICY_LOSSES),
    ("loss_agg_mode", "sum", LOSS_AGG_MODES), ("kl_loss_type", "k3", KL_ESTIMATORS),
    ("kl_penalty", "full", KL_ESTIMATORS),
])
def test_bad_name_is_one_line_with_the_choices(key, value, registry):
    config = load_config(None, BASE + [f"{key}={value}"])        # the config checks types only
    with pytest.raises(ConfigError) as error:
        Objective(config, reduce=None)
    assert str(error.value) == f"{key}: {value!r} is not one of {', '.join(registry)}"
    with pytest.raises(ConfigError, match="invalid configuration:\n  policy_loss: 'trpo'.*\n  kl_penalty: 'full'"):
        objective("policy_loss=trpo", "kl_penalty=full")


def test_registered_functions_get_only_their_declared_options():
    # each estimator / loss declares the options it reads; nothing is swallowed by **kwargs
    assert ADVANTAGE_ESTIMATORS["dr_grpo"].options == ("old_logp", "ref_logp", "kl_coeff", "kl_penalty")
    assert POLICY_LOSSES["sapo"].options == ("tau_pos", "tau_neg")
    obj = objective("policy_loss=sapo", "advantage_estimator=dr_grpo")
    assert obj._loss_options == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert obj._estimator_options == {"kl_penalty": "kl"}
    from paddle_rl.algorithms import policy_loss
    scores, mask, groups, old, ref = tiny_batch()
    with pytest.raises(TypeError, match="advantage estimator 'dr_grpo' does not read grpo_eps"):
        compute_advantages("dr_grpo", scores, mask, groups, grpo_eps=1e-6)
    with pytest.raises(TypeError, match="policy_loss 'sapo' does not read clip_range_ratio_low"):
        policy_loss("sapo", old, old, np.zeros_like(old), mask, clip_range_ratio_low=0.2)


def test_an_estimator_with_a_new_key_is_one_registration(tmp_path):
    # the estimator and its key are declared here, after RLConfig and the loader were imported: the loader looks
    # the registered pieces' keys up on every read, so the key loads, is checked and reaches the function
    before = RLConfig()
    seen = {}
    temperature = option("adv_temperature", float, 1.0, "Divides the centered scores.", check=above(0))

    @register_advantage("tempered_test", (temperature, "gamma", "reduce"))
    def tempered(scores, response_mask, group_ids, adv_temperature: float = 1.0, gamma: float = 1.0, reduce=None):
        seen.update(adv_temperature=adv_temperature, gamma=gamma)
        mean, _ = group_mean_std(scores, group_ids)
        return broadcast((np.asarray(scores) - mean) / adv_temperature, response_mask)

    try:
        assert before.adv_temperature == 1.0            # a config made before the piece registered: the default
        path = tmp_path / "run.yaml"
        path.write_text("actor_model_name_or_path: x\nadvantage_estimator: tempered_test\nadv_temperature: 4\n"
                        "gamma: 0.5\n")
        config = load_config(str(path))
        assert config.adv_temperature == 4.0 and config_to_dict(config)["adv_temperature"] == 4.0
        obj = Objective(config, reduce=None)
        scores, mask, groups, _, _ = tiny_batch()
        adv = obj.advantages(scores, mask, groups).numpy()
        assert seen == {"adv_temperature": 4.0, "gamma": 0.5}   # the new key, and an existing one read by name
        np.testing.assert_allclose(adv[:, 0], [0.125, -0.125, -0.0625, 0.0625])   # group means 0.5, 2.25; / 4
        for bad, message in (("-1", "adv_temperature: must be > 0, got -1.0"),
                             ("warm", "adv_temperature: expected a number, got 'warm'")):
            with pytest.raises(ConfigError) as error:
                load_config(None, BASE + ["advantage_estimator=tempered_test", f"adv_temperature={bad}"])
            assert message in str(error.value)
        Objective(load_config(None, BASE + ["advantage_estimator=tempered_test"]), reduce=None).advantages(
            scores, mask, groups)
        assert seen == {"adv_temperature": 1.0, "gamma": 1.0}   # unset: the declared defaults
        # a key is declared once: another piece reads the same declaration, never a second one or a group's key
        with pytest.raises(TypeError, match="'adv_temperature' is already declared by advantage estimator"):
            register_advantage("tempered_twice", (option("adv_temperature", float, 2.0),))(
                lambda scores, response_mask, group_ids, adv_temperature=2.0: None)
        with pytest.raises(TypeError, match="'kl_coeff' is a key of a config group"):
            register_advantage("kl_again", (option("kl_coeff", float, 0.0),))(
                lambda scores, response_mask, group_ids, kl_coeff=0.0: None)
    finally:
        ADVANTAGE_ESTIMATORS.remove("tempered_test")
    assert "adv_temperature" not in PIECE_OPTIONS and "gamma" in PIECE_OPTIONS   # gamma: still read by others
    assert "tempered_twice" not in ADVANTAGE_ESTIMATORS and "kl_again" not in ADVANTAGE_ESTIMATORS
    with pytest.raises(ConfigError, match="unknown key 'adv_temperature'"):
        load_config(None, BASE + ["adv_temperature=4"])


def test_cross_key_validation():
    # the policy losses that read clip_ratio_c say so where they register: the check asks the registry
    with pytest.raises(ConfigError, match="clip_ratio_c: read by policy_loss ppo only .*not by 'gspo'"):
        Objective(load_config(None, BASE + ["policy_loss=gspo", "clip_ratio_c=3"]), reduce=None)
    Objective(load_config(None, BASE + ["policy_loss=ppo", "clip_ratio_c=3"]), reduce=None)
    with pytest.raises(ConfigError, match="adaptive_kl"):
        load_config(None, BASE + ["adaptive_kl=true"])
    with pytest.raises(ConfigError, match="norm_adv_by_std"):
        load_config(None, BASE + ["norm_adv_by_std=false", "scale_rewards=batch"])
    with pytest.raises(ConfigError, match="overlong_reward_buffer"):
        load_config(None, BASE + ["enable_overlong_reward_buffer=true", "overlong_reward_buffer=5000"])


def test_paddlenlp_yaml_still_loads():
    path = os.path.join(os.path.dirname(__file__), "fixtures", "paddlenlp_grpo_argument.yaml")
    obj = Objective(load_config(path, BASE), reduce=None)
    # rl_algorithm grpo: PaddleNLP turns normalize_reward / normalize_advantage off
    assert obj.normalize_reward is False and obj.normalize_advantage is False


# --- presets and resolved conventions ---------------------------------------------------------

def test_presets_fill_unset_keys_only():
    assert objective().grpo_eps == 1e-6
    assert objective("algorithm_preset=verl").grpo_eps == 1e-6
    assert objective("algorithm_preset=trl").grpo_eps == 1e-4
    assert objective("algorithm_preset=trl", "grpo_eps=1e-6").grpo_eps == 1e-6
    assert objective().loss_agg_mode == "token-mean"
    assert objective("advantage_estimator=dr_grpo").loss_agg_mode == "seq-mean-token-sum-norm"
    assert objective("policy_loss=gspo").loss_agg_mode == "seq-mean-token-mean"
    assert objective("policy_loss=gspo", "loss_agg_mode=token-mean").loss_agg_mode == "token-mean"
    assert objective("max_dec_len=512").loss_scale_factor == 512.0
    assert objective("loss_scale_factor=100").loss_scale_factor == 100.0
    assert objective().conventions["std_ddof"] == 1


def test_trl_preset_eps_reaches_the_advantages():
    scores, mask, groups = np.array([1.0, 0.0]), np.ones((2, 1), np.float32), np.array([0, 0])
    a = 0.5 / (np.sqrt(0.5) + 1e-4)
    out = objective("algorithm_preset=trl").advantages(scores, mask, groups).numpy()
    np.testing.assert_allclose(out, [[a], [-a]], rtol=1e-6)


def test_where_kl_enters_and_reference_need():
    assert objective().needs_reference is False
    assert objective("kl_loss_coeff=0.001").needs_reference is True
    assert objective("kl_coeff=0.01").needs_reference is True
    # the REINFORCE++ preset has no KL term in the loss (PaddleNLP); an explicit estimator allows one
    assert objective("rl_algorithm=reinforce_plus_plus", "kl_loss_coeff=0.001").needs_reference is False
    obj = objective("advantage_estimator=reinforce_plus_plus", "kl_loss_coeff=0.001")
    assert obj.needs_reference is True and obj.kl_loss_coeff == 0.001


def test_rl_algorithm_presets():
    assert objective().estimator == "grpo"
    assert objective("rl_algorithm=reinforce_plus_plus").estimator == "reinforce_plus_plus"
    assert objective("rl_algorithm=reinforce_plus_plus", "advantage_estimator=rloo").estimator == "rloo"


# --- score shaping ----------------------------------------------------------------------------

def test_soft_overlong_penalty_by_hand():
    # L_max 10, L_buf 4 -> L_exp 6: 0 up to 6, (6 - len) / 4 inside, -factor beyond 10
    out = soft_overlong_penalty(np.array([5, 6, 7, 8, 10, 11]), 10, 4, factor=2.0)
    np.testing.assert_allclose(out, [0.0, 0.0, -0.5, -1.0, -2.0, -2.0])


def test_shape_scores_penalty_and_clip():
    obj = objective("enable_overlong_reward_buffer=true", "max_dec_len=10", "min_dec_len=1",
                    "overlong_reward_buffer=4", "clip_range_score=5")
    scores, metrics = obj.shape_scores(np.array([1.0, 1.0, 1.0, 20.0]), np.array([5, 8, 10, 3]),
                                       np.array([False, False, True, False]))
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [1.0, 0.5, 0.0, 5.0])
    assert metrics["score/truncated_share"] == 0.25
    assert metrics["score/overlong_penalty_mean"] == pytest.approx((0 - 0.5 - 1.0 + 0) / 4)
    assert metrics["score/clip_share"] == 0.25


def test_normalize_reward_running_statistics_and_resume():
    obj = objective("rl_algorithm=reinforce_plus_plus", "normalize_reward=true", "clip_range_score=100")
    none = np.zeros(2, bool)
    # batch 1 [1, 3]: mean 2, unbiased var 2
    s1, m1 = obj.shape_scores(np.array([1.0, 3.0]), np.array([1, 1]), none)
    np.testing.assert_allclose(s1, [-1 / np.sqrt(2 + 1e-8), 1 / np.sqrt(2 + 1e-8)], rtol=1e-6)
    assert m1["score/running_mean"] == 2.0
    # batch 2 [5]: the stream [1, 3, 5] has mean 3 and unbiased var 4
    s2, _ = obj.shape_scores(np.array([5.0]), np.array([1]), none[:1])
    np.testing.assert_allclose(s2, [2 / np.sqrt(4 + 1e-8)], rtol=1e-6)
    state = json.loads(json.dumps(obj.state_dict()))
    assert state["reward_moments"] == {"count": 3.0, "mean": 3.0, "m2": 8.0}
    resumed = objective("rl_algorithm=reinforce_plus_plus", "normalize_reward=true", "clip_range_score=100")
    resumed.set_state_dict(state)
    # batch 3 [7]: stream [1, 3, 5, 7], mean 4, unbiased var 20/3
    expected = [3 / np.sqrt(20 / 3 + 1e-8)]
    np.testing.assert_allclose(resumed.shape_scores(np.array([7.0]), np.array([1]), none[:1])[0], expected, rtol=1e-6)
    np.testing.assert_allclose(obj.shape_scores(np.array([7.0]), np.array([1]), none[:1])[0], expected, rtol=1e-6)


def test_normalize_reward_gathers_over_ranks():
    # this rank holds [1]; the other rank holds [3]: the hook adds its [count, sum, sumsq] = [1, 3, 9]
    obj = objective("advantage_estimator=grpo", "normalize_reward=true",
                    reduce=lambda v: v + np.array([1.0, 3.0, 9.0]))
    s, _ = obj.shape_scores(np.array([1.0]), np.array([1]), np.zeros(1, bool))
    np.testing.assert_allclose(s, [-1 / np.sqrt(2 + 1e-8)], rtol=1e-6)


def test_grpo_preset_ignores_score_normalization():
    obj = objective("normalize_reward=true", "normalize_advantage=true")
    s, _ = obj.shape_scores(np.array([1.0, 3.0]), np.array([1, 1]), np.zeros(2, bool))
    np.testing.assert_allclose(s, [1.0, 3.0])


def test_normalize_advantage_whitens_globally():
    obj = objective("advantage_estimator=dr_grpo", "normalize_advantage=true")
    scores, mask, groups = np.array([3.0, 1.0, 0.0, 0.0]), np.array([[1, 1], [1, 0], [1, 1], [0, 0]]), [0, 0, 1, 1]
    # dr_grpo: [1, -1, 0, 0]; valid tokens [1, 1, -1, 0, 0]: mean 0.2, squared deviations
    # 0.64 + 0.64 + 1.44 + 0.04 + 0.04 = 2.8, unbiased var 0.7
    out = obj.advantages(scores, mask, groups).numpy()
    expected = (np.array([[1, 1], [-1, 0], [0, 0], [0, 0]]) - 0.2) / np.sqrt(0.7 + 1e-8) * mask
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# --- DAPO -------------------------------------------------------------------------------------

FILTER_SCORES = np.array([1.0, 1.0, 0.0, 1.0, 2.0, 3.0, 3.0])
FILTER_GROUPS = np.array(["a", "a", "b", "b", "c", "d", "d"])   # a, d: all equal; c: a group of one


def test_filter_groups():
    keep, metrics = objective("dynamic_sampling=true").filter_groups(FILTER_SCORES, FILTER_GROUPS)
    np.testing.assert_array_equal(keep, [False, False, True, True, True, False, False])
    assert metrics["batch/zero_variance_group_share"] == 0.5
    keep, metrics = objective().filter_groups(FILTER_SCORES, FILTER_GROUPS)
    assert keep.all() and metrics["batch/zero_variance_group_share"] == 0.5


def test_select_groups_and_fallbacks():
    obj = objective("dynamic_sampling=true", "max_gen_batches=2")
    keep, _ = obj.filter_groups(FILTER_SCORES, FILTER_GROUPS)
    np.testing.assert_array_equal(obj.select_groups(keep, FILTER_GROUPS, 2, gen_round=1), [2, 3, 4])
    assert obj.select_groups(keep, FILTER_GROUPS, 3, gen_round=1) is None
    with pytest.raises(RuntimeError, match="max_gen_batches"):
        obj.select_groups(keep, FILTER_GROUPS, 3, gen_round=2)
    lenient = objective("dynamic_sampling=true", "max_gen_batches=2", "dynamic_sampling_fallback=keep")
    # qualifying b, c, then the first zero-variance group a
    np.testing.assert_array_equal(lenient.select_groups(keep, FILTER_GROUPS, 3, gen_round=2), [0, 1, 2, 3, 4])


def test_overlong_filter_mask():
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    truncated = np.array([False, True])
    assert objective().response_mask_for_update(mask, truncated) is mask
    obj = objective("overlong_filter=true")
    np.testing.assert_array_equal(obj.response_mask_for_update(mask, truncated), [[1, 1, 0], [0, 0, 0]])
    out = obj.response_mask_for_update(paddle.to_tensor(mask), paddle.to_tensor(truncated))
    assert isinstance(out, paddle.Tensor)
    np.testing.assert_array_equal(out.numpy(), [[1, 1, 0], [0, 0, 0]])
    assert obj.loss_normalizers(out) == (2.0, 1.0)


# --- adaptive KL ------------------------------------------------------------------------------

def test_adaptive_kl_controller_by_hand_and_resume():
    obj = objective("kl_coeff=0.05", "adaptive_kl=true", "kl_target=0.1", "kl_horizon=100")
    # error clip(0.15 / 0.1 - 1, -0.2, 0.2) = 0.2; coeff *= 1 + 0.2 * 10 / 100
    assert obj.update_kl_controller(0.15, 10) == pytest.approx(0.051)
    # error clip(-1) = -0.2; coeff *= 1 - 0.2 * 50 / 100
    assert obj.update_kl_controller(0.0, 50) == pytest.approx(0.051 * 0.9)
    state = json.loads(json.dumps(obj.state_dict()))
    resumed = objective("kl_coeff=0.05", "adaptive_kl=true", "kl_target=0.1", "kl_horizon=100")
    resumed.set_state_dict(state)
    assert resumed.kl_coeff == pytest.approx(0.0459)
    scores, mask, groups, old, ref = tiny_batch()
    out = resumed.loss(paddle.to_tensor(old), old, ref, paddle.zeros([4, 3]), mask, None, 9, 4)
    assert out.metrics["kl_coeff"] == pytest.approx(0.0459)
    # a fixed coefficient does not move
    fixed = objective("kl_coeff=0.05")
    assert fixed.update_kl_controller(1.0, 1000) == 0.05


def test_reward_kl_metric_and_current_coefficient_in_the_reward():
    obj = objective("advantage_estimator=dr_grpo", "kl_coeff=0.5")
    mask = np.array([[1, 1], [1, 0]], np.float32)
    old = np.array([[-1.0, -1.0], [-1.0, -1.0]])
    ref = np.array([[-1.2, -1.6], [-1.4, 0.0]])      # k1 on valid tokens: [0.2, 0.6], [0.4]
    adv, metrics = obj.advantages_and_metrics(np.array([1.0, 1.0]), mask, [0, 0], old, ref)
    # per-sequence token means 0.4 and 0.4
    assert metrics["actor/reward_kl"] == pytest.approx(0.4) and metrics["actor/reward_kl_num_seqs"] == 2
    # scores 1 - 0.5 * 0.8 = 0.6 and 1 - 0.5 * 0.4 = 0.8 -> dr_grpo [-0.1, 0.1]
    np.testing.assert_allclose(adv.numpy(), [[-0.1, -0.1], [0.1, 0.0]], rtol=1e-5)


def test_step_advantages_kl_metric_and_controller_count_the_global_batch():
    keys = ("rl_algorithm=reinforce_plus_plus", "kl_coeff=0.05", "adaptive_kl=true", "kl_target=0.05",
            "kl_horizon=100")
    scores, mask, groups, old, ref = tiny_batch()
    # the other rank of the batch group holds an identical shard: every batch sum doubles
    two_ranks = objective(*keys, reduce=lambda v: 2 * v)
    _, metrics = two_ranks.step_advantages(scores, mask, groups, old, ref)
    # k1 = old - ref = 0.1 on every response token: the token mean (kl) and the reward KL (kl_penalty: kl)
    assert metrics["actor/ref_kl"] == pytest.approx(0.1) and metrics["actor/reward_kl"] == pytest.approx(0.1)
    assert metrics["actor/reward_kl_num_seqs"] == 8.0
    # error clip(0.1 / 0.05 - 1, -0.2, 0.2) = 0.2, over the 8 sequences of the global batch
    assert metrics["actor/reward_kl_coeff"] == pytest.approx(0.05 * (1 + 0.2 * 8 / 100)) == two_ranks.kl_coeff
    # one process holding the whole (4-sequence) batch
    alone = objective(*keys).step_advantages(scores, mask, groups, old, ref)[1]
    assert alone["actor/reward_kl_coeff"] == pytest.approx(0.05 * (1 + 0.2 * 4 / 100))
    # advantages_and_metrics has no side effects; without reference log-probs there is no kl metric
    fresh = objective(*keys)
    fresh.advantages_and_metrics(scores, mask, groups, old, ref)
    assert fresh.kl_coeff == 0.05
    assert "actor/ref_kl" not in objective().step_advantages(scores, mask, groups, old)[1]


# group of four; "acc" applies to every sample, "fmt" only to samples 0 and 1 (NaN: not applicable)
GDPO_FUNCTIONS = {"acc": np.array([1.0, 0.0, 1.0, 0.0]), "fmt": np.array([1.0, 0.0, np.nan, np.nan])}


def test_gdpo_leaves_not_applicable_scores_out():
    eps = 1e-6
    a = 0.5 / (np.sqrt(1 / 3) + eps)        # acc: mean 0.5, unbiased std sqrt(1/3)
    b = 0.5 / (np.sqrt(0.5) + eps)          # fmt over samples 0, 1 only: mean 0.5, unbiased std sqrt(0.5)
    total = np.array([a + b, -a - b, a, -a])   # samples 2, 3 get 0 from fmt
    expected = total / (np.sqrt((2 * (a + b) ** 2 + 2 * a * a) / 3) + eps)   # batch mean 0
    mask = np.ones((4, 2), np.float32)
    out = compute_advantages("gdpo", np.zeros(4), mask, [0, 0, 0, 0], per_function_scores=GDPO_FUNCTIONS, grpo_eps=eps)
    np.testing.assert_allclose(out.numpy(), expected[:, None] * mask, rtol=1e-6)
    # the trainer's path: the reward result's per-function scores, NaN included, go to step_advantages
    obj = objective("advantage_estimator=gdpo")
    adv, _ = obj.step_advantages(np.zeros(4), mask, [0, 0, 0, 0], per_function_scores=GDPO_FUNCTIONS)
    np.testing.assert_allclose(adv.numpy(), expected[:, None] * mask, rtol=1e-6)
    # not the same as reading "not applicable" as a score of 0 (fmt [1, 0, 0, 0] has mean 0.25)
    zeroed = {k: np.nan_to_num(v) for k, v in GDPO_FUNCTIONS.items()}
    as_zero = obj.advantages(np.zeros(4), mask, [0, 0, 0, 0], per_function_scores=zeroed).numpy()
    assert np.abs(as_zero - adv.numpy()).max() > 0.1


# --- loss metrics -----------------------------------------------------------------------------

def test_loss_metrics_are_floats():
    obj = objective("kl_loss_coeff=0.1", "clip_ratio_c=3")
    scores, mask, groups, old, ref = tiny_batch()
    adv = obj.advantages(scores, mask, groups)
    out = obj.loss(paddle.to_tensor(old + 0.1), old, ref, adv, mask, paddle.full([4, 3], 0.7), 9, 4)
    for key in ("clipfrac_low", "clipfrac_high", "clipfrac_dual", "approx_kl", "entropy", "pg_loss", "kl_loss",
                "kl_coeff"):
        assert isinstance(out.metrics[key], float), key
    assert out.metrics["entropy"] == pytest.approx(0.7)
    assert out.metrics["approx_kl"] == pytest.approx(0.5 * 0.01, rel=1e-4)
    _, metrics = obj.advantages_and_metrics(scores, mask, groups)
    assert {"advantage/mean", "advantage/std", "advantage/max", "advantage/min",
            "actor/reward_kl_coeff"} <= set(metrics)


def test_a_clip_that_cannot_act_says_so(caplog):
    """clip_range_ratio_high set while each rollout batch makes one optimizer step: the ratio is 1 up to the
    rollout / trainer gap, so the clip cannot act on the policy's own change; the Objective says so, once, naming
    the key. More passes or more mini-batches (or leaving the key unset) say nothing."""
    def said(*overrides):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paddle_rl"):
            objective(*overrides)
        return [r.getMessage() for r in caplog.records if "single optimizer step" in r.getMessage()]

    one_step = ["global_batch_size=4", "global_mini_batch_size=4", "update_iters=1"]
    warned = said(*one_step, "clip_range_ratio_high=0.28")
    assert len(warned) == 1 and warned[0].startswith("clip_range_ratio_high: set"), warned
    assert said(*one_step, "clip_range_ratio_high=0.28", "clip_range_ratio_low=0.1")[0].startswith(
        "clip_range_ratio_low, clip_range_ratio_high: set")
    assert said(*one_step) == []
    assert said("global_batch_size=4", "global_mini_batch_size=2", "update_iters=1", "clip_range_ratio_high=0.28") == []
    assert said("global_batch_size=4", "global_mini_batch_size=4", "update_iters=2", "clip_range_ratio_high=0.28") == []

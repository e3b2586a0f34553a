"""Every advantage estimator, policy loss and aggregation mode runs from YAML on the micro model."""
import math

import pytest

from micro_model import micro_overrides
from paddle_rl.config import load_config
from paddle_rl.monitor import read_metrics

CASES = [
    {"advantage_estimator": "grpo"},
    {"advantage_estimator": "dr_grpo"},
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "gdpo"},
    {"advantage_estimator": "reinforce_plus_plus", "kl_coeff": 0.01},
    {"advantage_estimator": "reinforce_plus_plus_baseline", "kl_coeff": 0.01},
    {"policy_loss": "gspo"},
    {"policy_loss": "cispo"},
    {"policy_loss": "sapo"},
    {"policy_loss": "ppo", "clip_ratio_c": 3.0, "clip_range_ratio_high": 0.28},
    {"loss_agg_mode": "seq-mean-token-mean"},
    {"loss_agg_mode": "seq-mean-token-sum"},
    {"loss_agg_mode": "seq-mean-token-sum-norm"},
    {"kl_loss_coeff": 0.05, "kl_loss_type": "mse", "entropy_coeff": 0.01},
    {"rl_algorithm": "reinforce_plus_plus", "kl_coeff": 0.02, "adaptive_kl": True, "kl_target": 0.01},
    {"enable_overlong_reward_buffer": True, "overlong_reward_buffer": 4, "overlong_filter": True},
    {"normalize_reward": True, "normalize_advantage": True, "rl_algorithm": "reinforce_plus_plus"},
    {"rl_algorithm": "ppo", "kl_coeff": 0.01, "lam": 0.95, "use_remove_padding": True},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_variant_trains_with_finite_metrics(micro, tmp_path, case):
    from paddle_rl.trainer import RLTrainer
    overrides = micro_overrides(micro, str(tmp_path), max_steps=2, do_eval=False, update_iters=2, **case)
    RLTrainer(load_config(None, overrides)).train()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        if row.get("actor/skipped_update"):
            # the overlong filter masked every (truncated) response of the random model: nothing to learn from
            assert case.get("overlong_filter") and row["response_length/clipped_share"] == 1.0
            continue
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "reward/mean", "advantage/mean"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row.get(key))


def test_dynamic_sampling_keeps_only_informative_groups(micro, tmp_path, monkeypatch):
    import zlib

    import numpy as np

    from paddle_rl.rewards import register_rule
    from paddle_rl.rewards.rules import RULE_REWARDS
    from paddle_rl.trainer import RLTrainer
    n, groups = 4, 4  # rollout_n, global_batch_size
    monkeypatch.setitem(RULE_REWARDS, "some_informative_for_test", None)  # the test's rule leaves with the test

    @register_rule("some_informative_for_test")
    def some_informative(samples, *args, **kwargs):
        # rows come group by group (the n samples of a prompt in a row): a prompt whose checksum is not a
        # multiple of 3 scores 1, 0, 0, 0 (an informative group), any other 0, 0, 0, 0 (zero variance, dropped)
        return np.array([float(zlib.crc32(s.prompt.encode()) % 3 != 0 and i % n == 0)
                         for i, s in enumerate(samples)], dtype=np.float32), None

    overrides = micro_overrides(micro, str(tmp_path), max_steps=2, do_eval=False, dynamic_sampling=True,
                                max_gen_batches=3, dynamic_sampling_fallback="keep", global_mini_batch_size=4,
                                rollout_n=n, global_batch_size=groups, reward_funcs="[some_informative_for_test]")
    trainer = RLTrainer(load_config(None, overrides))
    generated, updated = [], []
    generate_batch, prepare_and_update = trainer._generate_batch, trainer._prepare_and_update

    def recording_generate(step, timer):
        generated.append(generate_batch(step, timer))
        return generated[-1]

    def recording_update(batch, timer):
        updated.append((np.array(batch["scores"]), [it["uid"] for it in batch["item"]]))
        return prepare_and_update(batch, timer)

    trainer._generate_batch, trainer._prepare_and_update = recording_generate, recording_update
    trainer.train()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2] and len(generated) == len(updated) == 2
    dropped = 0
    for row, (pool, train, _), (update_scores, update_uids) in zip(rows, generated, updated):
        pool_scores = pool["scores"].reshape(-1, n)
        informative = pool_scores.var(axis=1) > 1e-6
        rounds = int(row["batch/gen_rounds"])
        assert 1 <= rounds <= 3 and pool.size == rounds * groups * n
        # generation stopped at the first round with enough informative groups (no fallback filling)
        assert informative.sum() >= groups and informative[:(rounds - 1) * groups].sum() < groups
        # the training batch is exactly the first `groups` informative groups of the pool, in order ...
        chosen = np.flatnonzero(informative)[:groups]
        rows_chosen = (chosen[:, None] * n + np.arange(n)).reshape(-1)
        np.testing.assert_array_equal(train["scores"], pool["scores"][rows_chosen])
        assert [it["uid"] for it in train["item"]] == [pool["item"][i]["uid"] for i in rows_chosen]
        assert (train["scores"].reshape(-1, n).var(axis=1) > 1e-6).all()
        # ... and it is what the update trained on
        np.testing.assert_array_equal(update_scores, train["scores"])
        assert update_uids == [it["uid"] for it in train["item"]]
        # the logged shares describe the pool the groups were picked from
        assert row["batch/zero_variance_group_share"] == pytest.approx(1.0 - informative.mean())
        assert row["batch/kept_share"] == pytest.approx(informative.mean())
        dropped += int((~informative).sum())
    assert dropped > 0 and max(r["batch/gen_rounds"] for r in rows) > 1  # groups were dropped and more rounds generated


def test_dynamic_sampling_error_is_clear(micro, tmp_path, monkeypatch):
    from paddle_rl.trainer import RLTrainer
    # a constant reward gives every group zero variance
    from paddle_rl.rewards import RULE_REWARDS, register_rule
    import numpy as np
    monkeypatch.setitem(RULE_REWARDS, "constant_for_test", None)  # the test's rule leaves with the test

    @register_rule("constant_for_test")
    def constant(samples, *args, **kwargs):
        return np.ones(len(samples), dtype=np.float32), None

    overrides = micro_overrides(micro, str(tmp_path), max_steps=1, do_eval=False, dynamic_sampling=True,
                                max_gen_batches=2, reward_funcs="[constant_for_test]")
    with pytest.raises(RuntimeError, match="max_gen_batches"):
        RLTrainer(load_config(None, overrides)).train()

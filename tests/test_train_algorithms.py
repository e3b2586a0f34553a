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


def test_dynamic_sampling_keeps_only_informative_groups(micro, tmp_path):
    from paddle_rl.trainer import RLTrainer
    overrides = micro_overrides(micro, str(tmp_path), max_steps=2, do_eval=False, dynamic_sampling=True,
                                max_gen_batches=3, dynamic_sampling_fallback="keep", global_mini_batch_size=4)
    RLTrainer(load_config(None, overrides)).train()
    for row in read_metrics(str(tmp_path / "metrics.jsonl")):
        assert 1 <= row["gen_rounds"] <= 3
        assert "zero_variance_group_share" in row


def test_dynamic_sampling_error_is_clear(micro, tmp_path):
    from paddle_rl.trainer import RLTrainer
    # a constant reward gives every group zero variance
    from paddle_rl.rewards import register_rule
    import numpy as np

    @register_rule("constant_for_test")
    def constant(samples, *args, **kwargs):
        return np.ones(len(samples), dtype=np.float32), None

    overrides = micro_overrides(micro, str(tmp_path), max_steps=1, do_eval=False, dynamic_sampling=True,
                                max_gen_batches=2, reward_funcs="[constant_for_test]")
    with pytest.raises(RuntimeError, match="max_gen_batches"):
        RLTrainer(load_config(None, overrides)).train()

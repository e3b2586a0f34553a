from dataclasses import dataclass
from typing import Optional

from .fields import arg

RL_ALGORITHMS = ("grpo", "reinforce_plus_plus")


@dataclass
class AlgorithmArgs:
    rl_algorithm: str = arg("grpo", "Preset: grpo | reinforce_plus_plus.")
    advantage_estimator: Optional[str] = arg(None, "Overrides the preset's estimator (grpo, reinforce_plus_plus, ...).")
    kl_coeff: float = arg(0.0, "KL penalty folded into the token rewards (REINFORCE++ style, old vs reference).")
    kl_penalty: str = arg("kl", "Estimator of the reward KL: kl | abs | mse | low_var_kl.")
    kl_loss_coeff: float = arg(0.0, "KL term in the loss (GRPO style, current vs reference).")
    kl_loss_type: str = arg("low_var_kl", "Estimator of the loss KL: kl | abs | mse | low_var_kl.")
    pg_loss_coeff: float = arg(1.0, "Weight of the policy-gradient loss.")
    entropy_coeff: float = arg(0.0, "Entropy bonus weight.")
    policy_loss: str = arg("ppo", "ppo | gspo | cispo | sapo.")
    loss_agg_mode: Optional[str] = arg(None, "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (default: token-mean).")
    clip_range_ratio: float = arg(0.2, "PPO ratio clip.")
    clip_range_ratio_low: Optional[float] = arg(None, "Lower ratio clip (default clip_range_ratio).")
    clip_range_ratio_high: Optional[float] = arg(None, "Upper ratio clip (default clip_range_ratio; DAPO uses 0.28).")
    clip_ratio_c: Optional[float] = arg(None, "Dual-clip bound for negative advantages (> 1, e.g. 3).")
    clip_range_score: float = arg(10.0, "Scores are clipped to [-clip_range_score, clip_range_score].")
    clip_range_value: float = arg(5.0, acted=False)
    gamma: float = arg(1.0, "Discount of the REINFORCE++ token return.")
    grpo_eps: float = arg(1e-6, "Epsilon added to the group std in GRPO.")
    normalize_reward: bool = arg(False, "Running mean/std normalization of scores (REINFORCE++).")
    normalize_advantage: bool = arg(False, "Global masked mean/std normalization of advantages (REINFORCE++).")
    enable_overlong_reward_buffer: bool = arg(False, "DAPO soft overlong penalty.")
    overlong_reward_buffer: int = arg(256, "DAPO overlong buffer length L_buf.")
    overlong_penalty_factor: float = arg(1.0, "DAPO overlong penalty factor.")
    dynamic_sampling: bool = arg(False, "DAPO: drop groups whose scores are all equal.")
    max_gen_batches: int = arg(2, "DAPO: generation rounds before giving up on filling a batch.")

    def _validate_algorithm(self, errors):
        if self.rl_algorithm not in RL_ALGORITHMS:
            errors.append(f"rl_algorithm: {self.rl_algorithm!r} is not one of {', '.join(RL_ALGORITHMS)}")
        for key in ("kl_coeff", "kl_loss_coeff", "entropy_coeff", "clip_range_ratio", "clip_range_score"):
            if getattr(self, key) < 0:
                errors.append(f"{key}: must be >= 0, got {getattr(self, key)}")

    @property
    def needs_reference_model(self) -> bool:
        return self.kl_coeff > 0 or self.kl_loss_coeff > 0

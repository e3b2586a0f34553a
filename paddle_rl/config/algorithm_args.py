from dataclasses import dataclass
from typing import Optional

from .fields import arg

# The names of estimators, policy losses, KL estimators and aggregation modes are not listed here: the
# registries of paddle_rl/algorithms are the one list, and building the Objective (before any model loads)
# checks advantage_estimator / rl_algorithm, policy_loss, kl_penalty, kl_loss_type and loss_agg_mode against
# them. Nor are the keys those pieces read (grpo_eps, scale_rewards, norm_adv_by_std, gamma, lam,
# whiten_advantages, clip_range_score, kl_penalty, clip_range_ratio_low / _high, clip_ratio_c, tau_pos, tau_neg,
# loss_scale_factor): each piece declares them, with their checks, where it registers (config/options.py), and the
# loader reads them from that registry. This group holds the keys no piece reads as an option, and checks them.
RL_ALGORITHMS = ("grpo", "reinforce_plus_plus", "ppo")   # PaddleNLP's presets (their meaning is below), not a registry
PRESET_ESTIMATORS = {"ppo": "gae"}   # rl_algorithm -> its advantage estimator where the names differ
DYNAMIC_SAMPLING_FALLBACKS = ("error", "keep")

# Conventions an `algorithm_preset` fills in for keys left unset (None). docs/algorithms.md has the table.
ALGORITHM_PRESETS = {
    "paddlenlp": {"grpo_eps": 1e-6, "loss_agg_mode": "token-mean"},
    "verl": {"grpo_eps": 1e-6, "loss_agg_mode": "token-mean"},
    "trl": {"grpo_eps": 1e-4, "loss_agg_mode": "token-mean"},
}


def preset_value(config, key: str):
    """`key`'s convention in the config's algorithm_preset (the default rule of a preset-governed key)."""
    return ALGORITHM_PRESETS.get(config.algorithm_preset, ALGORITHM_PRESETS["paddlenlp"])[key]


@dataclass
class AlgorithmArgs:
    rl_algorithm: str = arg("grpo", "Preset: grpo (KL in the loss) | reinforce_plus_plus (KL in the reward, "
                            "none in the loss) | ppo (a critic: GAE advantages, clipped value loss; critic_* keys).")
    advantage_estimator: Optional[str] = arg(None, "Overrides the preset's estimator (names: docs/algorithms.md).")
    algorithm_preset: str = arg("paddlenlp", "Conventions for keys left unset: paddlenlp | verl | trl "
                                "(grpo_eps, loss_agg_mode; see docs/algorithms.md).")
    # advantages (the estimators' own keys: paddle_rl/algorithms/advantages.py)
    normalize_reward: bool = arg(False, "Running mean/std normalization of scores (REINFORCE++; ignored by the "
                                 "rl_algorithm grpo preset, as in PaddleNLP).")
    normalize_advantage: bool = arg(False, "Global masked mean/std normalization of advantages (REINFORCE++; "
                                    "ignored by the rl_algorithm grpo preset, as in PaddleNLP).")
    # KL
    kl_coeff: float = arg(0.0, "KL penalty folded into the rewards (old vs reference policy).")
    adaptive_kl: bool = arg(False, "Adapt kl_coeff toward kl_target (PPO proportional controller).")
    kl_target: float = arg(0.1, "Target reward KL of the adaptive controller.")
    kl_horizon: float = arg(10000.0, "Horizon (samples) of the adaptive controller.")
    kl_loss_coeff: float = arg(0.0, "KL term in the loss (current vs reference policy).")
    kl_loss_type: str = arg("low_var_kl", "Estimator of the loss KL (names: docs/algorithms.md).")
    # policy loss
    policy_loss: str = arg("ppo", "Policy loss (names: docs/algorithms.md).")
    pg_loss_coeff: float = arg(1.0, "Weight of the policy-gradient loss.")
    entropy_coeff: float = arg(0.0, "Entropy bonus weight.")
    clip_range_ratio: float = arg(0.2, "Ratio clip (the default of clip_range_ratio_low / _high, which the policy "
                                  "losses declare: paddle_rl/algorithms/losses.py).")
    loss_agg_mode: Optional[str] = arg(None, "Loss aggregation (names and defaults: docs/algorithms.md; unset: the "
                                       "estimator's or policy loss's own, else the preset's).")
    clip_range_value: float = arg(5.0, "Value clip of the critic's loss (rl_algorithm ppo): the new value is kept "
                                  "within clip_range_value of the rollout-time value in the clipped term.",
                                  aliases=("cliprange_value",))
    # DAPO
    enable_overlong_reward_buffer: bool = arg(False, "DAPO soft overlong penalty.")
    overlong_reward_buffer: int = arg(256, "DAPO overlong buffer length L_buf.")
    overlong_penalty_factor: float = arg(1.0, "DAPO overlong penalty factor.")
    overlong_filter: bool = arg(False, "DAPO: responses that hit max_dec_len without EOS get no loss.")
    dynamic_sampling: bool = arg(False, "DAPO: drop prompt groups whose scores are all equal and generate more.")
    max_gen_batches: int = arg(2, "DAPO: generation rounds before giving up on filling a batch.")
    dynamic_sampling_fallback: str = arg("error", "After max_gen_batches rounds without enough groups: error | keep "
                                         "(fill up with zero-variance groups).")
    # rollout correction (verl's names; docs/algorithms.md "Rollout correction")
    rollout_is: Optional[str] = arg(None, "Truncated importance sampling of the gap between the rollout's and the "
                                    "trainer's log-probs: token | sequence | null.", choices=("token", "sequence"))
    rollout_is_threshold: float = arg(2.0, "Upper bound of the rollout IS weight (and rollout_rs_threshold's default).")
    rollout_rs: Optional[str] = arg(None, "Rejection of tokens or responses whose ratio pi_old / pi_rollout leaves "
                                    "[rollout_rs_threshold_lower, rollout_rs_threshold]: token | sequence | geometric "
                                    "| null.", choices=("token", "sequence", "geometric"))
    rollout_rs_threshold: Optional[float] = arg(None, "Upper bound of rollout_rs (default rollout_is_threshold).")
    rollout_rs_threshold_lower: Optional[float] = arg(None, "Lower bound of rollout_rs (default 1 / the upper).")
    rollout_token_veto_threshold: Optional[float] = arg(None, "A response with any token ratio below this is "
                                                        "rejected whole (null: off).")

    def _validate_algorithm(self, errors):
        for key, allowed in (("rl_algorithm", RL_ALGORITHMS), ("algorithm_preset", tuple(ALGORITHM_PRESETS)),
                             ("dynamic_sampling_fallback", DYNAMIC_SAMPLING_FALLBACKS)):
            if getattr(self, key) not in allowed:
                errors.append(f"{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        for key in ("kl_coeff", "kl_loss_coeff", "entropy_coeff", "pg_loss_coeff", "clip_range_ratio",
                    "overlong_penalty_factor"):
            if getattr(self, key) < 0:
                errors.append(f"{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("kl_target", "kl_horizon"):
            if getattr(self, key) <= 0:
                errors.append(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.clip_range_value <= 0:
            errors.append(f"clip_range_value: must be > 0, got {self.clip_range_value}")
        if self.adaptive_kl and self.kl_coeff <= 0:
            errors.append("adaptive_kl: needs kl_coeff > 0 (the controller's starting value)")
        if self.max_gen_batches < 1:
            errors.append(f"max_gen_batches: must be >= 1, got {self.max_gen_batches}")
        if self.enable_overlong_reward_buffer and self.overlong_reward_buffer < 1:
            errors.append(f"overlong_reward_buffer: must be >= 1, got {self.overlong_reward_buffer}")

    def _validate_rollout_correction(self, errors):
        for key in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_rs_threshold_lower",
                    "rollout_token_veto_threshold"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                errors.append(f"{key}: must be > 0, got {value}")
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        if self.rollout_rs_threshold_lower is not None and upper > 0 and self.rollout_rs_threshold_lower >= upper:
            errors.append(f"rollout_rs_threshold_lower: {self.rollout_rs_threshold_lower} must be below the upper "
                          f"bound {upper}")
        if self.rollout_rs is None:
            for key in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
                if getattr(self, key) is not None:
                    errors.append(f"{key}: set without rollout_rs (token | sequence | geometric), so nothing reads it")

    @property
    def rollout_correction(self) -> bool:
        """Whether the update corrects for the rollout's own log-probs (rollout_is, rollout_rs or the veto)."""
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    # --- resolved settings (what the run actually uses) --------------------------------------
    @property
    def resolved_estimator(self) -> str:
        return self.advantage_estimator or PRESET_ESTIMATORS.get(self.rl_algorithm, self.rl_algorithm)

    @property
    def uses_rl_algorithm_preset(self) -> bool:
        """True when the estimator comes from rl_algorithm (PaddleNLP semantics), not advantage_estimator."""
        return self.advantage_estimator is None

    @property
    def preset_loss_agg_mode(self) -> str:
        """The preset's loss_agg_mode. The mode in effect (Objective.loss_agg_mode) is loss_agg_mode when set,
        else the default the estimator or the policy loss registers (dr_grpo, gspo), else this."""
        return preset_value(self, "loss_agg_mode")

    @property
    def loss_kl_coeff(self) -> float:
        """kl_loss_coeff in effect: the rl_algorithm reinforce_plus_plus preset has no KL term in the loss."""
        if self.uses_rl_algorithm_preset and self.rl_algorithm == "reinforce_plus_plus":
            return 0.0
        return self.kl_loss_coeff

    @property
    def score_normalization(self) -> tuple:
        """(normalize_reward, normalize_advantage) in effect: the rl_algorithm grpo preset forces both off."""
        if self.uses_rl_algorithm_preset and self.rl_algorithm == "grpo":
            return False, False
        return self.normalize_reward, self.normalize_advantage

    @property
    def needs_reference_model(self) -> bool:
        return self.kl_coeff > 0 or self.loss_kl_coeff > 0

from dataclasses import dataclass
from typing import Optional

from .fields import arg

# The names of estimators, policy losses, KL estimators and aggregation modes are not listed here: the
# registries of paddle_rl/algorithms are the one list, and building the Objective (before any model loads)
# checks advantage_estimator / rl_algorithm, policy_loss, kl_penalty, kl_loss_type and loss_agg_mode against
# them. This file checks types, ranges and its own presets.
RL_ALGORITHMS = ("grpo", "reinforce_plus_plus", "ppo")   # PaddleNLP's presets (their meaning is below), not a registry
PRESET_ESTIMATORS = {"ppo": "gae"}   # rl_algorithm -> its advantage estimator where the names differ
SCALE_REWARDS = ("group", "batch", "none")
DYNAMIC_SAMPLING_FALLBACKS = ("error", "keep")

# Conventions an `algorithm_preset` fills in for keys left unset (None). docs/algorithms.md has the table.
ALGORITHM_PRESETS = {
    "paddlenlp": {"grpo_eps": 1e-6, "loss_agg_mode": "token-mean"},
    "verl": {"grpo_eps": 1e-6, "loss_agg_mode": "token-mean"},
    "trl": {"grpo_eps": 1e-4, "loss_agg_mode": "token-mean"},
}


@dataclass
class AlgorithmArgs:
    rl_algorithm: str = arg("grpo", "Preset: grpo (KL in the loss) | reinforce_plus_plus (KL in the reward, "
                            "none in the loss) | ppo (a critic: GAE advantages, clipped value loss; critic_* keys).")
    advantage_estimator: Optional[str] = arg(None, "Overrides the preset's estimator (names: docs/algorithms.md).")
    algorithm_preset: str = arg("paddlenlp", "Conventions for keys left unset: paddlenlp | verl | trl "
                                "(grpo_eps, loss_agg_mode; see docs/algorithms.md).")
    # advantages
    grpo_eps: Optional[float] = arg(None, "Epsilon added to the std in GRPO-family estimators "
                                    "(default from algorithm_preset: 1e-6, trl 1e-4).")
    scale_rewards: str = arg("group", "GRPO std: group (group std) | batch (batch std) | none (no division).")
    norm_adv_by_std: bool = arg(True, "GRPO divides by the std (false: Dr.GRPO-style, like scale_rewards: none).")
    gamma: float = arg(1.0, "Discount of the REINFORCE++ token return and of GAE (rl_algorithm ppo).")
    lam: float = arg(1.0, "GAE lambda (rl_algorithm ppo / advantage_estimator gae; verl's algorithm.lam).",
                     aliases=("gae_lambda",))
    whiten_advantages: bool = arg(True, "GAE: whiten the advantages over every response token of the global batch "
                                  "(masked mean / std).")
    normalize_reward: bool = arg(False, "Running mean/std normalization of scores (REINFORCE++; ignored by the "
                                 "rl_algorithm grpo preset, as in PaddleNLP).")
    normalize_advantage: bool = arg(False, "Global masked mean/std normalization of advantages (REINFORCE++; "
                                    "ignored by the rl_algorithm grpo preset, as in PaddleNLP).")
    clip_range_score: float = arg(10.0, "Scores are clipped to [-clip_range_score, clip_range_score].")
    # KL
    kl_coeff: float = arg(0.0, "KL penalty folded into the rewards (old vs reference policy).")
    kl_penalty: str = arg("kl", "Estimator of the reward KL (names: docs/algorithms.md).")
    adaptive_kl: bool = arg(False, "Adapt kl_coeff toward kl_target (PPO proportional controller).")
    kl_target: float = arg(0.1, "Target reward KL of the adaptive controller.")
    kl_horizon: float = arg(10000.0, "Horizon (samples) of the adaptive controller.")
    kl_loss_coeff: float = arg(0.0, "KL term in the loss (current vs reference policy).")
    kl_loss_type: str = arg("low_var_kl", "Estimator of the loss KL (names: docs/algorithms.md).")
    # policy loss
    policy_loss: str = arg("ppo", "Policy loss (names: docs/algorithms.md).")
    pg_loss_coeff: float = arg(1.0, "Weight of the policy-gradient loss.")
    entropy_coeff: float = arg(0.0, "Entropy bonus weight.")
    clip_range_ratio: float = arg(0.2, "Ratio clip.")
    clip_range_ratio_low: Optional[float] = arg(None, "Lower ratio clip (default clip_range_ratio).")
    clip_range_ratio_high: Optional[float] = arg(None, "Upper ratio clip (default clip_range_ratio; DAPO uses 0.28).")
    clip_ratio_c: Optional[float] = arg(None, "Dual-clip bound for negative advantages (> 1, e.g. 3; policy_loss ppo).")
    tau_pos: float = arg(1.0, "SAPO gate temperature for positive advantages.")
    tau_neg: float = arg(1.05, "SAPO gate temperature for negative advantages.")
    loss_agg_mode: Optional[str] = arg(None, "Loss aggregation (names and defaults: docs/algorithms.md; unset: the "
                                       "estimator's or policy loss's own, else the preset's).")
    loss_scale_factor: Optional[float] = arg(None, "Divisor of seq-mean-token-sum-norm (default max_dec_len).")
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
                             ("scale_rewards", SCALE_REWARDS),
                             ("dynamic_sampling_fallback", DYNAMIC_SAMPLING_FALLBACKS)):
            if getattr(self, key) not in allowed:
                errors.append(f"{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        for key in ("kl_coeff", "kl_loss_coeff", "entropy_coeff", "pg_loss_coeff", "clip_range_ratio",
                    "clip_range_score", "overlong_penalty_factor"):
            if getattr(self, key) < 0:
                errors.append(f"{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("clip_range_ratio_low", "clip_range_ratio_high", "grpo_eps"):
            value = getattr(self, key)
            if value is not None and value < 0:
                errors.append(f"{key}: must be >= 0, got {value}")
        low = self.clip_range_ratio if self.clip_range_ratio_low is None else self.clip_range_ratio_low
        if low > 1:
            errors.append(f"clip_range_ratio_low: must be <= 1 (the ratio floor is 1 - clip), got {low}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            errors.append(f"clip_ratio_c: must be > 1, got {self.clip_ratio_c}")
        for key in ("tau_pos", "tau_neg", "kl_target", "kl_horizon"):
            if getattr(self, key) <= 0:
                errors.append(f"{key}: must be > 0, got {getattr(self, key)}")
        if not 0 <= self.gamma <= 1:
            errors.append(f"gamma: must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            errors.append(f"lam: must be in [0, 1], got {self.lam}")
        if self.clip_range_value <= 0:
            errors.append(f"clip_range_value: must be > 0, got {self.clip_range_value}")
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            errors.append(f"loss_scale_factor: must be > 0, got {self.loss_scale_factor}")
        if self.adaptive_kl and self.kl_coeff <= 0:
            errors.append("adaptive_kl: needs kl_coeff > 0 (the controller's starting value)")
        if not self.norm_adv_by_std and self.scale_rewards == "batch":
            errors.append("norm_adv_by_std: false contradicts scale_rewards: batch (use scale_rewards: none)")
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
    def resolved_grpo_eps(self) -> float:
        if self.grpo_eps is not None:
            return self.grpo_eps
        return ALGORITHM_PRESETS.get(self.algorithm_preset, ALGORITHM_PRESETS["paddlenlp"])["grpo_eps"]

    @property
    def preset_loss_agg_mode(self) -> str:
        """The preset's loss_agg_mode. The mode in effect (Objective.loss_agg_mode) is loss_agg_mode when set,
        else the default the estimator or the policy loss registers (dr_grpo, gspo), else this."""
        return ALGORITHM_PRESETS.get(self.algorithm_preset, ALGORITHM_PRESETS["paddlenlp"])["loss_agg_mode"]

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

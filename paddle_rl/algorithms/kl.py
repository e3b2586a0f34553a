"""KL estimators on the sampled token's log-prob under two policies, d = logp - ref_logp.

In the reward (kl_coeff, REINFORCE++/PPO style) they compare the rollout policy with the reference;
in the loss (kl_loss_coeff, GRPO style) the current policy with the reference.
"""
import paddle

from ._tensor import as_tensor
from .registry import Registry

KL_ESTIMATORS = Registry("KL estimator", positional=2)   # fn(logp, ref_logp), no options


def register_kl(name):
    return KL_ESTIMATORS.register(name)


@register_kl("kl")
def kl_k1(logp, ref_logp):
    """k1: d."""
    return logp - ref_logp


@register_kl("abs")
def kl_abs(logp, ref_logp):
    """|d|."""
    return (logp - ref_logp).abs()


@register_kl("mse")
def kl_k2(logp, ref_logp):
    """k2: d^2 / 2."""
    return 0.5 * (logp - ref_logp).square()


@register_kl("low_var_kl")
def kl_k3(logp, ref_logp):
    """k3: exp(-d) + d - 1, with (ref_logp - logp) clamped to [-20, 20] and the result to [-10, 10]."""
    log_ratio = paddle.clip(ref_logp - logp, -20.0, 20.0)
    return paddle.clip(log_ratio.exp() - log_ratio - 1.0, -10.0, 10.0)


def kl_penalty(logp, ref_logp, kind: str = "low_var_kl"):
    """Per-token KL estimate [B, T] (Paddle; numpy accepted) of the named estimator."""
    estimator = KL_ESTIMATORS.lookup(kind)
    logp = as_tensor(logp)
    return estimator(logp, as_tensor(ref_logp, like=logp))


class AdaptiveKLController:
    """Proportional controller of the reward KL coefficient (Ziegler et al. 2019):

    error = clip(observed / target - 1, -0.2, 0.2); coeff *= 1 + error * n_steps / horizon.
    """

    def __init__(self, init_coeff: float, target: float, horizon: float):
        self.value, self.target, self.horizon = float(init_coeff), float(target), float(horizon)

    def update(self, observed_kl: float, n_steps: int) -> float:
        error = min(max(float(observed_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * float(n_steps) / self.horizon
        return self.value


class FixedKLController:
    def __init__(self, init_coeff: float):
        self.value = float(init_coeff)

    def update(self, observed_kl: float, n_steps: int) -> float:
        return self.value

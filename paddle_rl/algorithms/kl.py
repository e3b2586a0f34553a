"""KL estimators between the sampled token's log-prob under two policies (d = logp - ref_logp)."""
import paddle

from ._tensor import as_tensor

KL_ESTIMATORS = {}


def register_kl(name):
    def wrap(fn):
        KL_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_kl("kl")
def kl_k1(logp, ref_logp):
    return logp - ref_logp


@register_kl("abs")
def kl_abs(logp, ref_logp):
    return (logp - ref_logp).abs()


@register_kl("mse")
def kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp).square()


@register_kl("low_var_kl")
def kl_k3(logp, ref_logp):
    log_ratio = paddle.clip(ref_logp - logp, -20.0, 20.0)
    return paddle.clip(log_ratio.exp() - log_ratio - 1.0, -10.0, 10.0)


def kl_penalty(logp, ref_logp, kind: str = "low_var_kl"):
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r} (choose from {', '.join(KL_ESTIMATORS)})")
    return KL_ESTIMATORS[kind](as_tensor(logp), as_tensor(ref_logp))

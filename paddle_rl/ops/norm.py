"""RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * weight."""
import paddle

from . import build
from ._util import contiguous, fusable


def rms_norm_reference(x, weight, eps: float):
    return x * paddle.rsqrt(paddle.square(x).mean(-1, keepdim=True) + eps) * weight


def rms_norm_fused(x, weight, eps: float):
    """The C++/CUDA kernel (with its backward); float32 only."""
    return build.run("prl_rms_norm", contiguous(x), weight, float(eps))[0]


def rms_norm(x, weight, eps: float):
    if fusable(x, weight):
        return rms_norm_fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps)

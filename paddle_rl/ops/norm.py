"""RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * weight."""
import paddle

from . import build
from ._util import contiguous, fusable
from .switches import switch, unusable


def rms_norm_reference(x, weight, eps: float):
    return x * paddle.rsqrt(paddle.square(x).mean(-1, keepdim=True) + eps) * weight


def rms_norm_fused(x, weight, eps: float):
    """The C++/CUDA kernel (with its backward); float32 only."""
    return build.run("prl_rms_norm", contiguous(x), weight, float(eps))[0]


def rms_norm(x, weight, eps: float):
    """The kernel, or the composed ops, as use_fused_rms_norm says (switches.py; unset: the kernel where it runs)."""
    use = switch("rms_norm")
    if use is False:
        return rms_norm_reference(x, weight, eps)
    if fusable(x, weight):
        return rms_norm_fused(x, weight, eps)
    if use:
        raise unusable("rms_norm", f"{x.dtype} tensors on {x.place}; the kernel takes float32 ones")
    return rms_norm_reference(x, weight, eps)

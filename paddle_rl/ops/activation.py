"""SwiGLU of a fused gate/up projection: x [..., 2F] = [gate | up] -> silu(gate) * up."""
import paddle
import paddle.nn.functional as F

from . import build
from ._util import contiguous, fusable


def swiglu_reference(x):
    gate, up = paddle.split(x, 2, axis=-1)
    return F.silu(gate) * up


def swiglu_fused(x):
    """The kernel (with its backward); float32."""
    return build.run("prl_swiglu", contiguous(x))[0]


def swiglu(x):
    if x.shape[-1] % 2 == 0 and fusable(x):
        return swiglu_fused(x)
    return swiglu_reference(x)

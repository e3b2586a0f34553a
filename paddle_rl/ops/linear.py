"""y = x W from a packed copy of W: the rollout's linear layers (few rows per decode step)."""
import paddle

from . import build
from ._util import contiguous, fusable

PANEL = 32   # columns per panel (csrc/cpu/linear.cc)


def pack_weight_reference(weight, transposed: bool = False):
    """weight [K, N] (or [N, K] with `transposed`, as a tied LM head's embedding) -> [P, K, 32]: panel p holds
    columns 32 p .. 32 p + 31, each k's 32 weights adjacent, the last panel zero-padded."""
    w = weight if transposed else weight.T
    n, k = w.shape
    if n % PANEL:
        w = paddle.concat([w, paddle.zeros([PANEL - n % PANEL, k], w.dtype)])
    return contiguous(w.reshape([-1, PANEL, k]).transpose([0, 2, 1]))


def pack_weight_fused(weight, transposed: bool = False):
    return build.run("prl_pack_weight", contiguous(weight), bool(transposed))[0]


def pack_weight(weight, transposed: bool = False):
    fn = pack_weight_fused if packing_helps(weight) else pack_weight_reference
    return fn(weight, transposed)


def packed_linear_reference(x, packed, n: int):
    w = packed.transpose([1, 0, 2]).reshape([packed.shape[1], -1])[:, :n]
    return paddle.matmul(x, w)


def packed_linear_fused(x, packed, n: int):
    return build.run("prl_packed_linear", contiguous(x), packed, int(n))[0]


def packing_helps(weight) -> bool:
    """The kernel runs for this weight: float32 on the CPU with the custom ops in use (a GPU's matmul reads its
    weights at the memory's rate without a packed copy)."""
    return fusable(weight) and weight.place.is_cpu_place()


def packed_linear(x, packed, n: int):
    """x [..., K] @ W[:, :n] from pack_weight's copy. Each row's sums run over k in order whatever the other rows
    are, so a row's output does not depend on the batch it is in."""
    fused = packing_helps(x) and packed.place.is_cpu_place()
    return (packed_linear_fused if fused else packed_linear_reference)(x, packed, n)

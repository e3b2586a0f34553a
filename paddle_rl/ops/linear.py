"""y = x W from a packed copy of W: the rollout's linear layers (few rows per decode step); the bf16 training
linear layer (bf16_linear)."""
import logging
import os

import paddle
from paddle.autograd import PyLayer

from . import build
from ._util import contiguous, cpu_build, fusable

logger = logging.getLogger("paddle_rl")

PANEL = 32   # columns per panel (csrc/cpu/linear.cc)
INTERLEAVED_MAX_K = 256   # past this K a panel's two 16-column halves lie one after the other (linear.cc HalvesApart)


def pack_weight_reference(weight, transposed: bool = False):
    """weight [K, N] (or [N, K] with `transposed`, as a tied LM head's embedding) -> [P, K, 32]: panel p holds
    columns 32 p .. 32 p + 31, the last panel zero-padded; up to K = INTERLEAVED_MAX_K each k's 32 weights adjacent,
    past it the panel's 16-column halves one after the other, [K, 16] each (the same [K, 32] of memory)."""
    w = weight if transposed else weight.T
    n, k = w.shape
    if n % PANEL:
        w = paddle.concat([w, paddle.zeros([PANEL - n % PANEL, k], w.dtype)])
    halves = _halves(k)   # each half [K, PANEL / halves], one after the other
    return contiguous(w.reshape([-1, halves, PANEL // halves, k]).transpose([0, 1, 3, 2])).reshape([-1, k, PANEL])


def _halves(k: int) -> int:
    """How many [K, ...] column blocks a panel is stored as: 2 past INTERLEAVED_MAX_K, else 1 (interleaved)."""
    return 2 if k > INTERLEAVED_MAX_K else 1


def pack_weight_fused(weight, transposed: bool = False):
    return build.run("prl_pack_weight", contiguous(weight), bool(transposed))[0]


def pack_weight(weight, transposed: bool = False):
    fn = pack_weight_fused if packing_helps(weight) else pack_weight_reference
    return fn(weight, transposed)


def packed_linear_reference(x, packed, n: int):
    k = packed.shape[1]
    halves = _halves(k)   # [P, halves, K, 32 / halves] -> [K, P, halves, 32 / halves]
    w = packed.reshape([-1, halves, k, PANEL // halves]).transpose([2, 0, 1, 3])
    return paddle.matmul(x, w.reshape([k, -1])[:, :n])


def packed_linear_fused(x, packed, n: int):
    return build.run("prl_packed_linear", contiguous(x), packed, int(n))[0]


def packing_helps(weight) -> bool:
    """The kernel runs for this weight: float32 on the CPU with the custom ops in use (a GPU's matmul reads its
    weights at the memory's rate without a packed copy)."""
    return fusable(weight) and _on_cpu(weight)


def _on_cpu(t) -> bool:
    return cpu_build() or t.place.is_cpu_place()


def packed_linear(x, packed, n: int):
    """x [..., K] @ W[:, :n] from pack_weight's copy (or pack_weight_lowp's LowpPacked). Each row's sums run over
    k in order whatever the other rows are, so a row's output does not depend on the batch it is in."""
    if isinstance(packed, LowpPacked):
        return packed_linear_lowp(x, packed)
    fused = packing_helps(x) and _on_cpu(packed)
    return (packed_linear_fused if fused else packed_linear_reference)(x, packed, n)


# ---------------------------------------------------------------------------------------------- low precision
# The rollout's weights in fewer bits (rollout_dtype: bfloat16, rollout_quant_type): csrc/cpu/linear.cc describes
# each format's layout and arithmetic; the references below compute the same products from the same packed bytes.
ROLLOUT_DTYPES = ("float32", "bfloat16")
ROLLOUT_QUANT_TYPES = ("", "weight_only_int8", "weight_only_int4")
QUANT_GROUP = 128   # weight_only_int4: rows of K per scale
_PACK_OPS = {"bfloat16": "prl_pack_weight_bf16", "weight_only_int8": "prl_pack_weight_int8",
             "weight_only_int4": "prl_pack_weight_int4"}


class LowpPacked:
    """A weight packed in a low-precision format: `data` and `scales` (what the kernel reads), `format`
    (bfloat16 | weight_only_int8 | weight_only_int4), `n` its real columns, `bf16_act` whether the activations
    are rounded to bfloat16 before the product."""

    def __init__(self, data, scales, format: str, n: int, bf16_act: bool):
        self.data, self.scales, self.format, self.n, self.bf16_act = data, scales, format, n, bf16_act


def rollout_weight_format(rollout_dtype: str, quant_type: str):
    """(packed format, bf16 activations) of a rollout: float32 | bfloat16 | the quantization, the activations
    rounded to bfloat16 under rollout_dtype bfloat16."""
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype: must be one of {', '.join(ROLLOUT_DTYPES)}, got {rollout_dtype!r}")
    if quant_type not in ROLLOUT_QUANT_TYPES:
        raise ValueError(f"rollout_quant_type: must be '' (off), weight_only_int8 or weight_only_int4, got "
                         f"{quant_type!r}")
    return (quant_type or rollout_dtype), rollout_dtype == "bfloat16"


def _round_even(x):
    """Round float32 to the nearest integer, ties to even (exact for |x| < 2^22)."""
    shifter = 12582912.0  # 1.5 * 2^23
    return (x + shifter) - shifter


def pack_weight_lowp_reference(weight, transposed: bool, format: str):
    """(data, scales) of `format` in pure Paddle, byte for byte the kernel's."""
    w = weight.T if transposed else weight            # [K, N]
    k, n = w.shape
    panels = -(-n // PANEL)
    w = paddle.concat([w, paddle.zeros([k, panels * PANEL - n], w.dtype)], axis=1) if n % PANEL else w
    if format == "bfloat16":
        w = paddle.concat([w, paddle.zeros([1, w.shape[1]], w.dtype)]) if k % 2 else w
        data = w.astype("bfloat16").reshape([-1, 2, panels, PANEL]).transpose([2, 0, 3, 1])
        return contiguous(data.reshape([panels, -1, 2 * PANEL])), paddle.zeros([1], "float32")
    if format == "weight_only_int8":
        scales = w.abs().max(axis=0) / 127.0
        q = paddle.where(scales > 0, _round_even(w / paddle.where(scales > 0, scales, paddle.ones_like(scales))),
                         paddle.zeros_like(w)).clip(-127, 127)
        data = q.astype("int8").reshape([k, panels, PANEL]).transpose([1, 0, 2])
        return contiguous(data), scales
    groups = -(-k // QUANT_GROUP)
    pad = groups * QUANT_GROUP - k
    wg = paddle.concat([w, paddle.zeros([pad, w.shape[1]], w.dtype)]) if pad else w
    wg = wg.reshape([groups, QUANT_GROUP, -1])
    scales = wg.abs().max(axis=1, keepdim=True) / 7.0
    safe = paddle.where(scales > 0, scales, paddle.ones_like(scales))
    q = paddle.where(scales > 0, _round_even(wg / safe), paddle.zeros_like(wg)).clip(-7, 7).astype("int32")
    q = q.reshape([groups * QUANT_GROUP, -1])[:k + k % 2]
    nib = paddle.bitwise_and(q, paddle.full_like(q, 15)).reshape([-1, 2, q.shape[1]])
    data = (nib[:, 0] + nib[:, 1] * 16).astype("uint8").reshape([-1, panels, PANEL]).transpose([1, 0, 2])
    return contiguous(data), contiguous(scales.reshape([groups, panels, PANEL]).transpose([1, 0, 2]))


def pack_weight_lowp_fused(weight, transposed: bool, format: str):
    data, scales = build.run(_PACK_OPS[format], contiguous(weight), bool(transposed))
    return data, scales


def pack_weight_lowp(weight, transposed: bool = False, format: str = "bfloat16", bf16_act: bool = True):
    """The rollout's copy of weight [K, N] (or [N, K] with `transposed`) in `format` (bfloat16 | weight_only_int8 |
    weight_only_int4): always made (its numbers differ from float32's), by the kernel where it runs."""
    if format not in _PACK_OPS:
        raise ValueError(f"packed weight format: must be one of {', '.join(_PACK_OPS)}, got {format!r}")
    fn = pack_weight_lowp_fused if packing_helps(weight) else pack_weight_lowp_reference
    n = weight.shape[0 if transposed else 1]
    return LowpPacked(*fn(weight, transposed, format), format, n, bool(bf16_act))


def round_bf16(x):
    """float32 rounded to bfloat16 (nearest even) and back."""
    return x.astype("bfloat16").astype("float32")


def dequantized(packed: LowpPacked, k: int):
    """The float32 [K, n] weight a LowpPacked stands for (int8: the integers, its scale applied after the sum)."""
    data, n = packed.data, packed.n
    panels = data.shape[0]
    if packed.format == "bfloat16":
        w = data.astype("float32").reshape([panels, -1, PANEL, 2]).transpose([1, 3, 0, 2])
        return w.reshape([-1, panels * PANEL])[:k, :n]
    if packed.format == "weight_only_int8":
        return data.astype("float32").transpose([1, 0, 2]).reshape([k, -1])[:, :n]
    b = data.astype("int32")
    low, high = paddle.bitwise_and(b, paddle.full_like(b, 15)), paddle.floor_divide(b, paddle.full_like(b, 16))
    q = paddle.stack([low, high], axis=2).astype("float32")          # [P, K2, 2, 32]
    q = paddle.where(q > 7, q - 16, q).reshape([panels, -1, PANEL])[:, :k]   # [P, K, 32]
    scales = paddle.repeat_interleave(packed.scales, QUANT_GROUP, axis=1)[:, :k]
    return (q * scales).transpose([1, 0, 2]).reshape([k, -1])[:, :n]


def packed_linear_lowp_reference(x, packed: LowpPacked):
    x = round_bf16(x) if packed.bf16_act else x
    y = paddle.matmul(x, dequantized(packed, x.shape[-1]))
    return y * packed.scales[:packed.n] if packed.format == "weight_only_int8" else y


def packed_linear_lowp_fused(x, packed: LowpPacked):
    return build.run("prl_packed_linear_lowp", contiguous(x), packed.data, packed.scales, int(packed.n),
                     bool(packed.bf16_act))[0]


def packed_linear_lowp(x, packed: LowpPacked):
    fused = packing_helps(x) and _on_cpu(packed.data)
    return (packed_linear_lowp_fused if fused else packed_linear_lowp_reference)(x, packed)


# ---------------------------------------------------------------------------------------------- bf16 training
# `bf16: true` on a CPU: a linear layer's three products (y = x W, dx = dy W^T, dW = x^T dy) take operands rounded
# to bfloat16 (nearest even) and sum in float32, the parameters staying float32 (the master weights). A bf16 x bf16
# product is exact in float32, so this is a bf16 matmul with float32 accumulation up to the order of the sums.
# bf16_matmul runs csrc/cpu/bf16_matmul.cc where the CPU has AMX-BF16 (TDPBF16PS tiles), AVX512-BF16 (vdpbf16ps) or
# AVX2 with FMA (the bfloat16 values widened to float32 in registers, FMAs in k order); elsewhere, or with
# PADDLE_RL_BF16_EMULATE set (non-empty, not 0), the reference rounds copies of the operands and multiplies them
# with Paddle's float32 matmul (one warning says it emulates).
BF16_KERNELS = ("amx", "avx512_bf16", "avx2")
_KERNEL_CODES = {"auto": 0, "amx": 1, "avx512_bf16": 2, "avx2": 3}


def bf16_matmul_reference(a, b, trans_a: bool = False, trans_b: bool = False):
    """op(a) @ op(b) for 2-D float32 a, b (op: the transpose where asked) from bfloat16-rounded operands."""
    return paddle.matmul(round_bf16(a), round_bf16(b), transpose_x=trans_a, transpose_y=trans_b)


def bf16_matmul_fused(a, b, trans_a: bool = False, trans_b: bool = False, kernel: str = "auto"):
    """The kernel's op(a) @ op(b); `a` and `b` each float32 or bfloat16 (to_bf16's copy: the same product, its
    packing reading half the bytes and no cast); `kernel`: auto (the best usable) | amx | avx512_bf16 | avx2 (an error
    where the CPU, OS or build cannot run it)."""
    if kernel not in _KERNEL_CODES:
        raise ValueError(f"bf16_matmul kernel: must be one of {', '.join(_KERNEL_CODES)}, got {kernel!r}")
    return build.run("prl_bf16_matmul", contiguous(a), contiguous(b), bool(trans_a), bool(trans_b),
                     _KERNEL_CODES[kernel])[0]


def bf16_matmul_accumulate(c, a, b, trans_a: bool = False, trans_b: bool = False, kernel: str = "auto"):
    """c += op(a) @ op(b) in place by the kernel (bf16_matmul_fused's operands and products, each sum starting from
    c's value): no new tensor per term of a sum of products. c: float32 [M, N], contiguous. Returns c."""
    if kernel not in _KERNEL_CODES:
        raise ValueError(f"bf16_matmul kernel: must be one of {', '.join(_KERNEL_CODES)}, got {kernel!r}")
    if not c.is_contiguous():
        raise ValueError("bf16_matmul_accumulate: c must be contiguous (it is written in place)")
    build.run("prl_bf16_matmul_accumulate", c, contiguous(a), contiguous(b), bool(trans_a), bool(trans_b),
              _KERNEL_CODES[kernel])
    return c


class Bf16PackedB:
    """A right operand B [K, N] rounded to bfloat16 and packed once (prl_bf16_pack_b) for many products
    (bf16_matmul_packed): `words` the pack, `n` its columns (the pack's rows are padded; the op checks K)."""

    def __init__(self, words, n: int):
        self.words, self.n = words, n


def bf16_pack_b(b, trans_b: bool = False) -> Bf16PackedB:
    """op(b) packed for bf16_matmul_packed (the kernel's own copy of it; bf16_matmul packs it on every call)."""
    n = b.shape[0] if trans_b else b.shape[1]
    return Bf16PackedB(build.run("prl_bf16_pack_b", contiguous(b), bool(trans_b))[0], int(n))


def bf16_matmul_packed(a, packed: Bf16PackedB, trans_a: bool = False, kernel: str = "auto"):
    """bf16_matmul_fused(a, b, trans_a, trans_b)'s numbers, with b packed once by bf16_pack_b."""
    if kernel not in _KERNEL_CODES:
        raise ValueError(f"bf16_matmul kernel: must be one of {', '.join(_KERNEL_CODES)}, got {kernel!r}")
    return build.run("prl_bf16_matmul_packed", contiguous(a), packed.words, bool(trans_a), int(packed.n),
                     _KERNEL_CODES[kernel])[0]


def to_bf16_reference(x):
    return x.astype("bfloat16")


def to_bf16_fused(x):
    return build.run("prl_to_bf16", contiguous(x))[0]


def to_bf16(x):
    """float32 x rounded to bfloat16 (nearest even, a NaN 0x7fff): Paddle's cast, bit for bit; by the kernel (in
    parallel, vectorized) where the custom ops run, Paddle's CPU cast being several times slower."""
    return (to_bf16_fused if fusable(x) and x.place.is_cpu_place() else to_bf16_reference)(x)


_usable_kernels = []


def bf16_kernels() -> tuple:
    """The bf16 matmul kernels this CPU, OS and build can run (a subset of BF16_KERNELS, best first); () when the
    custom ops are not in use."""
    if not build.available():
        return ()
    if not _usable_kernels:
        flags = build.run("prl_bf16_kernels", paddle.zeros([1]))[0].numpy()
        _usable_kernels.append(tuple(name for name, ok in zip(BF16_KERNELS, flags) if ok))
    return _usable_kernels[0]


def emulation_forced() -> bool:
    """PADDLE_RL_BF16_EMULATE set (non-empty, not 0): the bfloat16 products run their emulation / portable code."""
    value = os.environ.get("PADDLE_RL_BF16_EMULATE", "")
    return bool(value) and value != "0"


_warned_emulation = []


def bf16_kernel(*tensors) -> str:
    """What bf16_matmul runs for these tensors: the first of bf16_kernels() (amx | avx512_bf16 | avx2), or
    "emulated" (PADDLE_RL_BF16_EMULATE, no such kernel, the custom ops off, not float32 CPU tensors), which warns
    once."""
    kernels = () if emulation_forced() or not fusable(*tensors) or not all(t.place.is_cpu_place() for t in tensors) \
        else bf16_kernels()
    if kernels:
        return kernels[0]
    if not _warned_emulation:
        _warned_emulation.append(True)
        why = ("PADDLE_RL_BF16_EMULATE is set" if emulation_forced() else
               "the custom ops are not in use" if not build.available() else
               "this CPU / OS / build has none of AMX-BF16, AVX512-BF16 and AVX2" if not bf16_kernels() else
               "the operands are not float32 CPU tensors")
        logger.warning("bf16: the linear layers' bfloat16 products are emulated (operands rounded to bfloat16, "
                       "multiplied by Paddle's float32 matmul: %s): the numbers of bf16 training, not its speed", why)
    return "emulated"


def bf16_matmul(a, b, trans_a: bool = False, trans_b: bool = False):
    """op(a) @ op(b) with bfloat16-rounded operands and float32 sums: the kernel where bf16_kernel says so, else
    the reference."""
    if bf16_kernel(a, b) == "emulated":
        return bf16_matmul_reference(a, b, trans_a, trans_b)
    return bf16_matmul_fused(a, b, trans_a, trans_b)


class _Bf16Linear(PyLayer):
    # What the backward keeps: the weight gradient reads x only through its bfloat16 rounding, so x is kept as
    # that rounding, a bfloat16 tensor (half float32's bytes; the kernel's rounding of a rounded value is itself, so
    # the products are the same bits), and only when W takes a gradient. The weight is the parameter itself (no
    # copy). Fused, the rounding is to_bf16's kernel and the products read it as it is (no Paddle cast either way:
    # Paddle's CPU cast costs several times the kernel's); the forward's product then packs x from that copy too.
    @staticmethod
    def forward(ctx, x, weight, fused: bool):
        k, n = weight.shape
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)
        ctx.fused = fused
        ctx.x_shape = x.shape
        if ctx.fused:
            xb = to_bf16_fused(x) if ctx.needs[1] else None
            ctx.save_for_backward(*([xb, weight] if ctx.needs[1] else [weight]))
            return bf16_matmul_fused((x if xb is None else xb).reshape([-1, k]), weight).reshape(x.shape[:-1] + [n])
        ctx.save_for_backward(*([x.astype("bfloat16"), weight] if ctx.needs[1] else [weight]))
        return paddle.matmul(round_bf16(x), round_bf16(weight))

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensor()
        x, w = (saved[0], saved[1]) if ctx.needs[1] else (None, saved[0])
        return _bf16_linear_grads(x, w, dy, ctx.fused, ctx.needs, ctx.x_shape)


def _bf16_linear_grads(x, w, dy, fused: bool, needs, x_shape):
    """(dx, dW) of x @ w with bfloat16 products (None where needs says no): x is the input's bfloat16 rounding
    (to_bf16_fused's with `fused`, a Paddle bfloat16 tensor without) or None when W takes no gradient."""
    k, n = w.shape
    dy2 = dy.reshape([-1, n])
    if fused:
        dx = bf16_matmul_fused(dy2, w, trans_b=True).reshape(x_shape) if needs[0] else None
        dw = bf16_matmul_fused(x.reshape([-1, k]), dy2, trans_a=True) if needs[1] else None
        return dx, dw
    x = x.astype("float32").reshape([-1, k]) if x is not None else None
    dyr = round_bf16(dy2)
    dx = paddle.matmul(dyr, round_bf16(w), transpose_y=True).reshape(x_shape) if needs[0] else None
    dw = paddle.matmul(x, dyr, transpose_x=True) if needs[1] else None
    return dx, dw


class _ProductGradients(PyLayer):
    # The forward computes nothing (its output is uninitialized memory); the backward is the product's: Paddle's
    # matmul gradients (dx = dy W^T, dW = x^T dy, as one product each over the flattened rows: the calls Paddle's
    # own matmul backward makes, so the same bits), or bf16_linear's (`bf16`; `fused`: by the bf16 kernel)
    @staticmethod
    def forward(ctx, x, weight, bf16: bool, fused: bool):
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)
        ctx.bf16, ctx.fused, ctx.x_shape = bf16, fused, x.shape
        ctx.save_for_backward(x, weight)
        return paddle.empty(x.shape[:-1] + [weight.shape[1]], x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensor()
        if ctx.bf16:
            if ctx.needs[1]:
                x = to_bf16_fused(x) if ctx.fused else x.astype("bfloat16")
            return _bf16_linear_grads(x if ctx.needs[1] else None, w, dy, ctx.fused, ctx.needs, ctx.x_shape)
        k, n = w.shape
        dx = paddle.matmul(dy, w, transpose_y=True) if ctx.needs[0] else None
        dw = paddle.matmul(x.reshape([-1, k]), dy.reshape([-1, n]), transpose_x=True) if ctx.needs[1] else None
        return dx, dw


def product_gradients(x, weight, bf16: bool = False):
    """A stand-in for x @ weight (or bf16_linear(x, weight) with `bf16`) in a block recomputed in the backward
    whose output is not needed again: nothing is computed forward (the result is uninitialized) and backpropagating
    dy through it gives the product's gradients, the same bits. Used for the MLP's down projection under
    recompute_granularity core_attn_mlp (models/decoder.py): its input is made again, its output is not."""
    fused = bf16 and bf16_kernel(x, weight) != "emulated"
    return _ProductGradients.apply(x, weight, bool(bf16), fused)


def bf16_linear_reference(x, weight):
    """x [..., K] @ weight [K, N] with bfloat16-rounded operands and float32 sums, forward and backward (the input's
    gradient from the rounded dy and W, the weight's from the rounded x and dy); float32 in and out."""
    if not paddle.is_grad_enabled() or (x.stop_gradient and weight.stop_gradient):
        return paddle.matmul(round_bf16(x), round_bf16(weight))
    return _Bf16Linear.apply(x, weight, False)


def bf16_linear(x, weight):
    """The bf16 training linear layer: bf16_linear_reference's numbers, its products by the bf16 kernel where
    bf16_kernel(x, weight) names one (else the emulation, which warns once). A bfloat16 weight (a frozen layer's,
    store_weight_bf16) is read by the kernel as it is where no gradient is taken, else widened (exact)."""
    if weight.dtype == paddle.bfloat16:
        if weight.stop_gradient and (x.stop_gradient or not paddle.is_grad_enabled()) \
                and bf16_kernel(x) != "emulated":
            k, n = weight.shape
            return bf16_matmul_fused(x.reshape([-1, k]), weight).reshape(x.shape[:-1] + [n])
        weight = weight.astype("float32")
    if bf16_kernel(x, weight) == "emulated":
        return bf16_linear_reference(x, weight)
    if not paddle.is_grad_enabled() or (x.stop_gradient and weight.stop_gradient):
        k, n = weight.shape
        return bf16_matmul_fused(x.reshape([-1, k]), weight).reshape(x.shape[:-1] + [n])
    return _Bf16Linear.apply(x, weight, True)

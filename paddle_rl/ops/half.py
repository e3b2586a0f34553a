"""Half-precision products emulated on a CPU: `fp16: true`, and the rounded outputs of `fp16_opt_level: O2`.

A float16 (IEEE half) or bfloat16 matmul with float32 accumulation is emulated from float32 tensors: each operand is
rounded to the half type (nearest even; float16 overflows to +-inf above 65504 and keeps subnormals down to 2^-24,
as the hardware does) and the rounded operands are multiplied by Paddle's float32 matmul. A product of two half
values is exact in float32, so the result is the half matmul's up to the order of the float32 sums.

- half_linear_reference(x, weight, dtype, round_outputs): y = x W with its two gradients (dx = dy W^T, dW = x^T dy)
  each from rounded operands; with `round_outputs` (AMP O2, where the ops pass half tensors to each other) y, dx and
  dW are rounded to `dtype` too, as the half matmul writes them.
- half_linear: the same numbers; for bfloat16 the products run ops.bf16_linear (the AMX / AVX512-BF16 / AVX2 kernel
  where the CPU has one) and the rounding of the outputs is added around it. There is no float16 kernel (no CPU this
  project runs on multiplies float16 natively): float16 always runs the reference.
- round_half(x, dtype): float32 rounded to `dtype` and back. round_value / round_grad: that rounding applied to a
  tensor in the forward only (its gradient passed as it is) or to its gradient in the backward only.
"""
import paddle
from paddle.autograd import PyLayer

from .linear import bf16_linear

HALF_DTYPES = ("float16", "bfloat16")


def round_half(x, dtype: str):
    """float32 x rounded to `dtype` (float16: IEEE half, overflow to inf, subnormals kept; bfloat16) and back."""
    return x.astype(dtype).astype("float32")


class _RoundValue(PyLayer):
    @staticmethod
    def forward(ctx, x, dtype):
        return round_half(x, dtype)

    @staticmethod
    def backward(ctx, dy):
        return dy


class _RoundGrad(PyLayer):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return round_half(dy, ctx.dtype)


def round_value(x, dtype: str):
    """x rounded to `dtype` in the forward; the gradient passes unchanged (the cast of a half op's output)."""
    return _RoundValue.apply(x, dtype) if paddle.is_grad_enabled() and not x.stop_gradient else round_half(x, dtype)


def round_grad(x, dtype: str):
    """x unchanged in the forward; its gradient rounded to `dtype` (a half op's gradient output)."""
    return _RoundGrad.apply(x, dtype) if paddle.is_grad_enabled() and not x.stop_gradient else x


class _HalfLinear(PyLayer):
    # x is kept as its half rounding (the weight gradient reads only that), in the half dtype itself: half the bytes
    @staticmethod
    def forward(ctx, x, weight, dtype, round_outputs):
        ctx.needs = (not x.stop_gradient, not weight.stop_gradient)
        ctx.dtype, ctx.round_outputs, ctx.x_shape = dtype, round_outputs, x.shape
        xh = x.astype(dtype)
        ctx.save_for_backward(*([xh, weight] if ctx.needs[1] else [weight]))
        y = paddle.matmul(xh.astype("float32"), round_half(weight, dtype))
        return round_half(y, dtype) if round_outputs else y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensor()
        xh, w = (saved[0], saved[1]) if ctx.needs[1] else (None, saved[0])
        k, n = w.shape
        dyr = round_half(dy.reshape([-1, n]), ctx.dtype)
        out = (lambda t: round_half(t, ctx.dtype)) if ctx.round_outputs else (lambda t: t)
        dx = out(paddle.matmul(dyr, round_half(w, ctx.dtype), transpose_y=True)).reshape(ctx.x_shape) \
            if ctx.needs[0] else None
        dw = out(paddle.matmul(xh.astype("float32").reshape([-1, k]), dyr, transpose_x=True)) if ctx.needs[1] else None
        return dx, dw


def half_linear_reference(x, weight, dtype: str = "float16", round_outputs: bool = False):
    """x [..., K] @ weight [K, N] as a `dtype` matmul with float32 sums, forward and both gradients (module doc)."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half_linear: dtype must be float16 or bfloat16, got {dtype!r}")
    if not paddle.is_grad_enabled() or (x.stop_gradient and weight.stop_gradient):
        y = paddle.matmul(round_half(x, dtype), round_half(weight, dtype))
        return round_half(y, dtype) if round_outputs else y
    return _HalfLinear.apply(x, weight, dtype, bool(round_outputs))


def half_linear(x, weight, dtype: str = "float16", round_outputs: bool = False):
    """half_linear_reference's numbers; bfloat16 products by ops.bf16_linear (its kernel where the CPU has one)."""
    if dtype != "bfloat16":
        return half_linear_reference(x, weight, dtype, round_outputs)
    if not round_outputs:
        return bf16_linear(x, weight)
    return round_value(bf16_linear(round_grad(x, dtype), round_grad(weight, dtype)), dtype)


class HalfProducts:
    """The products of a layer under a half-precision strategy (models/layers.py Bf16Products.half): callable as
    (x, weight) -> y."""

    def __init__(self, dtype: str, round_outputs: bool):
        if dtype not in HALF_DTYPES:
            raise ValueError(f"HalfProducts: dtype must be float16 or bfloat16, got {dtype!r}")
        self.dtype, self.round_outputs = dtype, bool(round_outputs)

    def __call__(self, x, weight):
        return half_linear(x, weight, self.dtype, self.round_outputs)

    def __repr__(self):
        return f"HalfProducts({self.dtype}, round_outputs={self.round_outputs})"

"""y = x W + b of the training linear layers in one process (use_fused_linear).

Fused: Paddle's linear op, which takes the bias inside the one op (F.linear; a GPU build's GEMM adds it in its
epilogue, a CPU build's kernel into the product's output as it is made), and whose backward gives the bias its
gradient in the same op. Reference: the product, then the bias added by a separate op over the [tokens, out]
output (and its own backward). The same numbers (the sum is the same float32 addition)."""
import paddle
import paddle.nn.functional as F

from .switches import switch


def affine_reference(x, weight, bias=None):
    y = paddle.matmul(x, weight)
    return y if bias is None else y + bias


def affine_fused(x, weight, bias=None):
    return F.linear(x, weight, bias)


def affine(x, weight, bias=None):
    """Paddle's linear op, or the product and a separate bias add with use_fused_linear: false."""
    return (affine_reference if switch("linear") is False else affine_fused)(x, weight, bias)

"""The residual stream's sum x + y, whose backward hands its incoming gradient to both inputs as it is.

Paddle's add backward writes the gradient into two new tensors (two copies of a [tokens, hidden] float32 tensor per
residual add, each freshly allocated); the sum's gradient with respect to either input is the incoming gradient
itself, so `residual_add` passes that one tensor on. The bits are Paddle's add's (the forward is paddle.add, the
backward an identity)."""
import paddle
from paddle.autograd import PyLayer


def residual_add_reference(x, y):
    return paddle.add(x, y)


class _ResidualAdd(PyLayer):
    @staticmethod
    def forward(ctx, x, y):
        return paddle.add(x, y)

    @staticmethod
    def backward(ctx, grad):
        # one tensor for both: each consumer only reads it, and an accumulation into it (Paddle's gradient holder
        # adds in place into the first tensor it received) happens after both consumers have run, since the other
        # input's producer lies upstream of this node in every residual block
        return grad, grad


def residual_add(x, y):
    """x + y (same shape); in a pass that records gradients, the backward shares its gradient between x and y."""
    if paddle.in_dynamic_mode() and paddle.is_grad_enabled() and not (x.stop_gradient and y.stop_gradient) \
            and x.shape == y.shape and x.dtype == y.dtype:
        return _ResidualAdd.apply(x, y)
    return paddle.add(x, y)

import numpy as np
import paddle


def as_tensor(x, dtype="float32"):
    """Paddle tensor from a tensor, numpy array or list (kept as is when already a tensor of dtype)."""
    if isinstance(x, paddle.Tensor):
        return x if x.dtype == getattr(paddle, dtype) else x.astype(dtype)
    return paddle.to_tensor(np.asarray(x), dtype=dtype)

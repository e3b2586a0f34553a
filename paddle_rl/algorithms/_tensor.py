"""Small conversions shared by the algorithm modules (Paddle tensors in, numpy accepted)."""
import numpy as np
import paddle

FLOAT_DTYPES = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


def as_tensor(x, dtype=None, like=None):
    """A Paddle tensor from a tensor, numpy array or list.

    `like`: take the dtype of that tensor. `dtype=None` keeps a floating tensor's dtype and turns
    everything else (numpy, ints, bools) into float32.
    """
    if like is not None:
        dtype = like.dtype
    if isinstance(x, paddle.Tensor):
        if dtype is None:
            return x if x.dtype in FLOAT_DTYPES else x.astype("float32")
        target = dtype if isinstance(dtype, paddle.dtype) else getattr(paddle, dtype)
        return x if x.dtype == target else x.astype(target)
    array = np.asarray(x)
    if dtype is None:
        dtype = "float32"
    return paddle.to_tensor(array.astype(np.float64) if array.dtype == bool else array, dtype=dtype)


def to_numpy(x, dtype=np.float64) -> np.ndarray:
    """A numpy array (float64 unless asked otherwise) from a tensor, array or list."""
    if isinstance(x, paddle.Tensor):
        x = x.astype("float32").numpy() if x.dtype in (paddle.float16, paddle.bfloat16) else x.numpy()
    array = np.asarray(x)
    return array.astype(dtype) if dtype is not None else array


def metrics_to_floats(metrics: dict) -> dict:
    """Scalar tensors / numbers -> python floats, with one device sync for all the tensors."""
    keys = [k for k, v in metrics.items() if isinstance(v, paddle.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, paddle.Tensor)}
    if keys:
        stacked = paddle.stack([metrics[k].astype("float64").reshape([]) for k in keys]).numpy()
        out.update({k: float(v) for k, v in zip(keys, stacked)})
    return {k: out[k] for k in metrics}

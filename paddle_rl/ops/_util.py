"""Small helpers of the op wrappers."""
import paddle

from . import build


def contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


def fusable(*tensors, dtypes=(paddle.float32,)) -> bool:
    """Tensors of `dtypes` (float32) on a place the kernels were built for, eager mode, and the kernels in use."""
    if not paddle.in_dynamic_mode():
        return False
    for t in tensors:
        if t is None:
            continue
        if t.dtype not in dtypes or not (t.place.is_cpu_place() or t.place.is_gpu_place()):
            return False
    return build.available()

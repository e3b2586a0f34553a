"""The rollout's KV-cache relayout: copy windows of cache rows into another buffer in place.

`kv_place(dst, src, src_rows, dst_row, src_start, dst_start, width)` writes
    dst[dst_row + i, :, dst_start:dst_start + width] = src[src_rows[i], :, src_start:src_start + width]
for every i, with dst [Rd, H, Cd, D] and src [Rs, H, Cs, D] of one dtype. It is the one copy of the
continuous-batching engine (rollout/engine.py): dropping finished rows and the dead slots before the oldest
live row (compaction), fanning a prefilled prompt out to its samples, and placing joining rows.
The kernel (prl_kv_place, csrc/cpu/kv_cache.cc and csrc/cuda/kv_cache.cu) copies bytes: float32, float16 and
bfloat16 alike; it runs when dst is contiguous, does not share memory with src and no gradient is asked for
(else the reference, which copies the window first and is differentiable).
"""
import math

import paddle

from . import build
from ._util import contiguous, fusable


def kv_place_reference(dst, src, src_rows, dst_row: int, src_start: int, dst_start: int, width: int):
    if src_rows.shape[0] == 0 or width == 0:
        return dst
    window = paddle.gather(src[:, :, src_start:src_start + width], src_rows, axis=0)
    dst[dst_row:dst_row + src_rows.shape[0], :, dst_start:dst_start + width] = window
    return dst


def kv_place_fused(dst, src, src_rows, dst_row: int, src_start: int, dst_start: int, width: int):
    """dst contiguous, not overlapping src; src_rows int64 on dst's place."""
    if src_rows.shape[0] == 0 or width == 0:
        return dst
    build.run("prl_kv_place", dst, contiguous(src), src_rows, int(dst_row), int(src_start), int(dst_start), int(width))
    return dst


DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16)
INT64 = (paddle.int64,)


def caches_fusable(cache_k, cache_v) -> bool:
    """A KV cache the decode kernels read and write: keys and values of one of DTYPES on a kernel place."""
    return _same(cache_k.dtype, cache_v.dtype) and fusable(cache_k, cache_v, dtypes=DTYPES)


def _bytes(t) -> int:
    """Bytes of a tensor's elements (Tensor.size costs a Paddle op: the shape's product instead)."""
    return math.prod(t.shape) * t.element_size()


def _fusable(dst, src, src_rows) -> bool:
    if not _same(dst.dtype, src.dtype) or src_rows.dtype not in INT64 or not dst.is_contiguous():
        return False
    if paddle.is_grad_enabled() and not (src.stop_gradient and dst.stop_gradient):  # the kernel has no backward
        return False
    if src.is_contiguous():  # else the kernel reads a contiguous copy of src
        a, b = dst.data_ptr(), src.data_ptr()
        if a < b + _bytes(src) and b < a + _bytes(dst):
            return False
    return fusable(dst, src, dtypes=DTYPES)


def _same(a, b) -> bool:
    return a is b or a == b


def kv_place(dst, src, src_rows, dst_row: int, src_start: int, dst_start: int, width: int):
    """In place on `dst` (returned). `src_rows` int64 [n]."""
    rows, dst_shape, src_slots = src_rows.shape[0], dst.shape, src.shape[2]
    dst_rows, dst_slots = dst_shape[0], dst_shape[2]
    if not (0 <= width and 0 <= src_start and src_start + width <= src_slots and 0 <= dst_start
            and dst_start + width <= dst_slots and 0 <= dst_row and dst_row + rows <= dst_rows):
        raise ValueError(f"kv_place: window [{src_start}, {src_start + width}) of {src.shape} -> rows "
                         f"[{dst_row}, {dst_row + rows}) slots [{dst_start}, {dst_start + width}) of "
                         f"{dst.shape} is out of bounds")
    fn = kv_place_fused if _fusable(dst, src, src_rows) else kv_place_reference
    return fn(dst, src, src_rows, dst_row, src_start, dst_start, width)

"""The rollout's KV-cache relayout: copy windows of cache rows into another buffer in place.

`kv_place(dst, src, src_rows, dst_row, src_start, dst_start, width)` writes
    dst[dst_row + i, :, dst_start:dst_start + width] = src[src_rows[i], :, src_start:src_start + width]
for every i, with dst [Rd, H, Cd, D] and src [Rs, H, Cs, D] of one dtype. It is the one copy of the
continuous-batching engine (rollout/engine.py): dropping finished rows and the dead slots before the oldest
live row (compaction), fanning a prefilled prompt out to its samples, and placing joining rows.
"""
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
    if src_rows.shape[0] == 0 or width == 0:
        return dst
    build.run("prl_kv_place", dst, contiguous(src), src_rows, int(dst_row), int(src_start), int(dst_start), int(width))
    return dst


def kv_place(dst, src, src_rows, dst_row: int, src_start: int, dst_start: int, width: int):
    """In place on `dst` (returned). `src_rows` int64 [n]."""
    if not (0 <= src_start and src_start + width <= src.shape[2] and 0 <= dst_start
            and dst_start + width <= dst.shape[2] and 0 <= dst_row and dst_row + src_rows.shape[0] <= dst.shape[0]):
        raise ValueError(f"kv_place: window [{src_start}, {src_start + width}) of {src.shape} -> rows "
                         f"[{dst_row}, {dst_row + src_rows.shape[0]}) slots [{dst_start}, {dst_start + width}) of "
                         f"{dst.shape} is out of bounds")
    fn = kv_place_reference
    return fn(dst, src, src_rows, dst_row, src_start, dst_start, width)

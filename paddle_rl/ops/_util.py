"""Small helpers of the op wrappers.

`fusable` runs before every kernel call (some 60 times in a decode step of a small model), so it reads only what can
differ between calls: the tensors' dtypes, and their places only where a tensor can live elsewhere than on the CPU
(a build for accelerators); whether Paddle is such a build is read once."""
import os

import paddle

from . import build

FLOAT32 = (paddle.float32,)
_cpu_build = None   # Paddle built for the CPU alone (every eager tensor on the CPU), read on the first call


def contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


def cpu_build() -> bool:
    """Whether this Paddle runs on the CPU alone (no CUDA, ROCm, XPU or custom device in the build)."""
    global _cpu_build
    if _cpu_build is None:
        _cpu_build = not (paddle.is_compiled_with_cuda() or paddle.is_compiled_with_rocm()
                          or paddle.is_compiled_with_xpu() or paddle.device.get_all_custom_device_type())
    return _cpu_build


def fusable(*tensors, dtypes=FLOAT32) -> bool:
    """Tensors of `dtypes` (float32) on a place the kernels were built for, eager mode, and the kernels in use."""
    if not paddle.in_dynamic_mode():
        return False
    anywhere = cpu_build()   # else each tensor's place is read: the kernels run on the CPU and on CUDA devices
    for t in tensors:
        if t is None:
            continue
        if t.dtype not in dtypes:
            return False
        if not anywhere:
            place = t.place
            if not (place.is_cpu_place() or place.is_gpu_place()):
                return False
    return build.available()


def env_on(name: str) -> bool:
    """An on/off environment switch of a fused path, on unless set to 0, false, off or no (read at each call)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")

"""CPU thread settings, applied before Paddle is imported.

Paddle's CPU fp32 matmul runs ~5x faster with one OpenMP thread per core and MKL told to use
its AVX2 path on AMD CPUs (MKL_DEBUG_CPU_TYPE=5; ignored by Intel CPUs); stride kernels off makes
transposes contiguous copies (W1 step 5.2 s -> 4.4 s). Values already in the environment win.
"""
import os


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def configure_threads(processes_per_node: int = 1) -> None:
    if "paddle" in __import__("sys").modules:
        return
    local = int(os.environ.get("PADDLE_LOCAL_SIZE", os.environ.get("PADDLE_TRAINERS_NUM", processes_per_node)) or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // max(1, local))))
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    os.environ.setdefault("GLOG_minloglevel", "2")
    # transposes as real copies: Paddle's CPU strided-copy kernels are several times slower
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")

"""CPU thread and allocator settings, applied before Paddle is imported.

Paddle's CPU fp32 matmul runs ~5x faster with one OpenMP thread per core and MKL told to use
its AVX2 path on AMD CPUs (MKL_DEBUG_CPU_TYPE=5; ignored by Intel CPUs); stride kernels off makes
transposes contiguous copies (W1 step 5.2 s -> 4.4 s). Values already in the environment win. Where Paddle was
imported first, `configure_threads` makes them through Paddle's API instead, except MKL's AMD path, which holds
only if MKL has not run yet: a warning says so on AMD CPUs (an update of the tiny default took 2.8-4.2 s a step
with none of them, 2.0-2.5 s with all but MKL's, 0.7-1.1 s with all; EPYC Zen 3, 2 cores).

Paddle's CPU tensors come straight from malloc, and glibc serves blocks over 32 MB with a fresh mmap that
is unmapped on free, so every large activation pays its page faults again (a 64 MB element-wise op: 27 ms
instead of 17; a fresh [5100, 576] float32 sum 4.4 ms against 1.4 from the heap). PADDLE_RL_MALLOC says what
glibc does:
- `train` (the default): while a training run's steps go on (`training_heap`, entered by the step loop), every
  block comes from the heap and freed memory stays there, as a caching allocator would keep it; when the run
  ends glibc's mapping is back and the freed heap goes back to the system (malloc_trim). Costs: the peak RSS
  can grow by what the heap's free pieces hold (W3 float32: 6.1 -> 6.6 GB; with `heap` 6.5 -> 7.1 GB, and a 0.5B
  model with recompute off 9.3 -> 11.2 GB); the time saved is the page faults (W3's bf16 step: median 66.4 ->
  59.4 s in one sitting; docs/performance.md).
- `heap`: the same for the whole process from its start (`configure_allocator`, before Paddle is imported).
- `system`: glibc's own behaviour throughout.

`quiet_paddle_import` (called when the package is imported; it imports nothing itself, so reward-server workers and
`--help` stay without Paddle) arranges Paddle's first import, by whatever module: without a Paddle build it stops
with one line that says what to install (the suite does not install Paddle itself: the CPU and GPU builds are different
distributions that both provide `paddle`), and it keeps two import-time notices of Paddle's out of the output:
- "WARNING: OMP_NUM_THREADS set to N, not 1 ... PLEASE USE OMP_NUM_THREADS WISELY.", printed to stderr when
  OMP_NUM_THREADS > 1. `configure_threads` sets it on purpose (the cores divided among the local processes); the
  notice is about OpenBLAS builds, and Paddle's CPU wheel uses MKL.
- "No ccache found ...", a UserWarning of paddle.utils.cpp_extension: the custom ops build once per source
  version into a cache of their own (ops/build.py), so a compiler cache would not be used.
Every other line Paddle writes while it is imported passes through.
"""
import contextlib
import ctypes
import importlib.abc
import importlib.util
import io
import os
import platform
import sys
import warnings

PADDLE_MISSING = ('paddle-rl needs PaddlePaddle, which is not installed: for CPU run pip install -e ".[cpu]" '
                  '(or pip install paddlepaddle==3.3.1); for GPU first install paddlepaddle-gpu as '
                  'https://www.paddlepaddle.org.cn/install says for your CUDA version')

# lines Paddle prints to stderr while it is imported that are dropped (the module docstring says why)
PADDLE_IMPORT_NOTICES = ("WARNING: OMP_NUM_THREADS set to ", "PLEASE USE OMP_NUM_THREADS WISELY.")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


MALLOC_MODES = ("train", "heap", "system")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GLIBC_MMAP_MAX, _TRIM_AFTER = 65536, 64 << 20   # glibc's default mmap count; twice its largest mmap threshold


def _malloc_setting() -> str:
    return os.environ.get("PADDLE_RL_MALLOC", "").strip().lower() or "train"


def malloc_mode() -> str:
    """PADDLE_RL_MALLOC: train (the default), heap or system (the module docstring)."""
    value = _malloc_setting()
    if value not in MALLOC_MODES:
        raise ValueError(f"PADDLE_RL_MALLOC={value!r}: expected one of {', '.join(MALLOC_MODES)}")
    return value


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- raises AttributeError on a non-glibc libc
    except (OSError, AttributeError):
        return None
    return libc


def _keep_in_heap(libc) -> bool:
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def configure_allocator() -> bool:
    """With PADDLE_RL_MALLOC=heap: large blocks from the heap, never trimmed back to the OS (glibc only), for the
    whole process. Returns whether it applied."""
    # read, not checked: this runs when the package is imported (an unknown value is refused when a run starts)
    libc = _glibc() if _malloc_setting() == "heap" else None
    return libc is not None and _keep_in_heap(libc)


@contextlib.contextmanager
def training_heap():
    """Within: every block from the heap and freed memory kept there (PADDLE_RL_MALLOC=train, the default; glibc
    only); after: glibc's mmap for large blocks again and the heap's free memory returned (malloc_trim). Yields
    whether it applied (not under heap, which already holds for the whole process, nor system)."""
    libc = _glibc() if malloc_mode() == "train" else None
    if libc is None or not _keep_in_heap(libc):
        yield False
        return
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_AFTER)
        libc.malloc_trim(0)


# the settings configure_threads makes (values already in the environment win)
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_DEBUG_CPU_TYPE", "GLOG_minloglevel", "FLAGS_use_stride_kernel")
_configured = False   # set once the settings are made; after Paddle's import nothing is made twice


def configure_threads(processes_per_node: int = 1) -> None:
    """The module docstring's settings, before Paddle is imported. Where Paddle was imported first (`import
    paddle` before `import paddle_rl`, as a notebook or a script of one's own would), the settings still go into
    the environment, which Paddle's OpenMP and MKL read when they first run, and the two Paddle reads at import
    are made through its API: its thread count (`core.set_num_threads`) and the stride-kernel flag. MKL's AMD
    path is the one setting that cannot be made once MKL has run a product: `warn_if_mkl_may_be_set` says so."""
    global _configured
    imported = "paddle" in sys.modules
    if imported and _configured:
        return
    if not imported:
        configure_allocator()
    local = int(os.environ.get("PADDLE_LOCAL_SIZE", os.environ.get("PADDLE_TRAINERS_NUM", processes_per_node)) or 1)
    threads = str(max(1, cpu_count() // max(1, local)))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    os.environ.setdefault("GLOG_minloglevel", "2")
    # transposes as real copies: Paddle's CPU strided-copy kernels are several times slower
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")
    if imported:
        # what the user set: Paddle's import wrote OMP_NUM_THREADS=1 where it was unset, so the environment the
        # process started with tells
        given = {name for name in THREAD_SETTINGS if name in _start_environment()}
        if "OMP_NUM_THREADS" not in given:
            os.environ["OMP_NUM_THREADS"] = threads
        _configure_imported_paddle(given)
    _configured = True


def _start_environment() -> set:
    """The names of the environment this process started with (/proc/self/environ; os.environ's where that cannot
    be read)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return {entry.split(b"=", 1)[0].decode(errors="replace") for entry in f.read().split(b"\0") if entry}
    except OSError:
        return set(os.environ)


def _configure_imported_paddle(given: set) -> None:
    """Paddle was imported before configure_threads: its thread count and stride-kernel flag set through its API
    (where the environment did not already set them), and the MKL notice (`warn_if_mkl_may_be_set`)."""
    paddle = sys.modules["paddle"]
    if "OMP_NUM_THREADS" not in given and hasattr(paddle, "base"):
        paddle.base.core.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "FLAGS_use_stride_kernel" not in given and hasattr(paddle, "set_flags"):
        paddle.set_flags({"FLAGS_use_stride_kernel": False})
    if "MKL_DEBUG_CPU_TYPE" not in given:
        warn_if_mkl_may_be_set()


def warn_if_mkl_may_be_set() -> None:
    """On an AMD CPU: a warning that MKL_DEBUG_CPU_TYPE=5 (MKL's AVX2 path) was set after Paddle's import, so it
    holds only if Paddle has not run a matrix product yet (the training products ran 2.5x slower without it on an
    EPYC Zen 3 when Paddle had run one before `import paddle_rl`)."""
    if cpu_info()["vendor"] != "AuthenticAMD":
        return
    warnings.warn("paddle was imported before paddle_rl: MKL_DEBUG_CPU_TYPE=5 (MKL's AVX2 path on AMD CPUs) holds "
                  "only if Paddle has run no matrix product yet; otherwise this process's training products run "
                  "~2.5x slower. Import paddle_rl before paddle, or start Python with MKL_DEBUG_CPU_TYPE=5 set",
                  RuntimeWarning, stacklevel=4)   # the line of paddle_rl/__init__.py that calls configure_threads


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """{"model": the first processor's model name, "flags": its flags, "vendor": its vendor_id} (None / [] / ""
    where the file says nothing)."""
    model, flags, vendor = None, [], ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.split()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                if model is not None and flags and vendor:
                    break
    except OSError:
        pass
    return {"model": model or platform.processor() or None, "flags": flags, "vendor": vendor}


class _DropLines(io.TextIOBase):
    """A text stream that forwards whole lines to `target`, except those starting with one of `prefixes`."""

    def __init__(self, target, prefixes):
        super().__init__()
        self.target, self.prefixes, self.pending = target, tuple(prefixes), ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not line.startswith(self.prefixes):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.pending.startswith(self.prefixes):
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()


class _QuietPaddleFinder(importlib.abc.MetaPathFinder):
    """Finds `paddle` as the other finders do and wraps its loader so that Paddle's import-time notices
    (PADDLE_IMPORT_NOTICES on stderr) are dropped whenever, wherever it is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "paddle":
            return None
        sys.meta_path.remove(self)   # the real finders answer; this one is needed once
        spec = importlib.util.find_spec("paddle")
        if spec is None:
            raise ImportError(PADDLE_MISSING, name="paddle")
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _QuietLoader(spec.loader)
        return spec


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        stderr = sys.stderr
        sys.stderr = _DropLines(stderr, PADDLE_IMPORT_NOTICES)
        try:
            self.loader.exec_module(module)
        finally:
            sys.stderr.flush()
            sys.stderr = stderr


def quiet_paddle_import() -> None:
    """Arranges for Paddle's first import (by any module, later) to drop its notices and, without a Paddle build,
    to stop with PADDLE_MISSING's one line; imports nothing itself (reward-server workers and `--help` stay without
    Paddle)."""
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    if "paddle" in sys.modules or any(isinstance(f, _QuietPaddleFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("paddle") is None:
        raise ImportError(PADDLE_MISSING, name="paddle")
    sys.meta_path.insert(0, _QuietPaddleFinder())


def import_paddle():
    """Import Paddle without its import-time notices; ImportError with PADDLE_MISSING when no build is installed."""
    quiet_paddle_import()
    import paddle
    return paddle

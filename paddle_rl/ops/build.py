"""Building and loading the C++ (and CUDA) kernels of csrc/ with paddle.utils.cpp_extension.

The shared library is built once per source version, compiler flags, Paddle version and CPU, into
`$PADDLE_RL_OPS_CACHE` (default ~/.cache/paddle_rl/ops)/<hash>/, under a file lock so that several processes
(a distributed launch, parallel tests) build it once. Later processes register the cached library directly
(milliseconds); `python tools/build_ops.py` builds it ahead of time.

Modes (`use_custom_ops`, or $PADDLE_RL_CUSTOM_OPS before any configuration): `auto` uses the kernels when
they build and load, else logs one line saying why and runs the pure-Paddle fallbacks; `on` raises when they
cannot be used; `off` never builds them.
"""
import contextlib
import glob
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
import threading

logger = logging.getLogger("paddle_rl")

MODES = ("auto", "on", "off")
NAME = "paddle_rl_ops"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a source checkout keeps csrc/ beside the package; an installed wheel carries a copy as paddle_rl/_csrc
CSRC = next((p for p in (os.path.join(os.path.dirname(_PACKAGE), "csrc"), os.path.join(_PACKAGE, "_csrc"))
             if os.path.isdir(p)), os.path.join(os.path.dirname(_PACKAGE), "csrc"))
# -g0 after the -g of Python's own compile flags (which cpp_extension passes on): debug information made the objects
# 15x larger and the build 1.4x slower (55 s against 39 s for the two units side by side on 2 cores); the kernels
# keep their symbols, so profilers and backtraces still name them
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-pthread", "-g0"]
# the CPU kernels' translation units (csrc/paddle_rl_ops.cc says how they are split), compiled side by side by
# cpp_extension (one compiler per core, or MAX_JOBS): tools/build_ops.py took 40 s on 2 cores where the one unit
# they were before, with debug information, took 83 s
CPU_UNITS = ("paddle_rl_ops.cc", "paddle_rl_ops_attention.cc")
LD_FLAGS = ["-pthread"]


def _openmp_flags():
    """(compile, link) flags for OpenMP on the runtime Paddle's MKL runs on (paddle/libs/libiomp5.so), so the
    kernels' parallel regions use the same worker threads as the matmuls; none when Paddle ships no libiomp5
    (the kernels then split rows over std::threads)."""
    import paddle
    libs = os.path.join(os.path.dirname(paddle.__file__), "libs")
    if not os.path.isfile(os.path.join(libs, "libiomp5.so")):
        return [], []
    return ["-fopenmp"], [f"-L{libs}", "-Wl,--no-as-needed", "-liomp5", f"-Wl,-rpath,{libs}"]
CUDA_FLAGS = ["-O3", "--use_fast_math"]


class CustomOpsError(RuntimeError):
    """The fused kernels were required (use_custom_ops: on) but cannot be built or loaded."""


class _State:
    mode = os.environ.get("PADDLE_RL_CUSTOM_OPS", "auto").strip().lower() or "auto"
    loaded = None          # True / False once tried
    reason = ""            # why they are not in use
    library = None         # path of the loaded shared library
    ops = ()
    lock = threading.Lock()


def cache_root() -> str:
    root = os.environ.get("PADDLE_RL_OPS_CACHE")
    return os.path.abspath(os.path.expanduser(root or os.path.join("~", ".cache", "paddle_rl", "ops")))


def sources(with_cuda: bool):
    """What the compiler is given: the CPU kernels' translation units (+ the CUDA files)."""
    files = [os.path.join(CSRC, unit) for unit in CPU_UNITS]
    if with_cuda:
        files += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    return files


def _all_source_files():
    found = []
    for folder, _, names in os.walk(CSRC):
        found += [os.path.join(folder, n) for n in names if n.endswith((".cc", ".cu", ".h", ".cuh"))]
    return sorted(found)


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha1(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(with_cuda: bool) -> str:
    import paddle
    h = hashlib.sha256()
    for path in _all_source_files():
        h.update(os.path.relpath(path, CSRC).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(json.dumps([CXX_FLAGS, LD_FLAGS, CUDA_FLAGS, _openmp_flags(), with_cuda, paddle.__version__,
                         sys.version, _cpu_identity()]).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: str):
    import fcntl
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpp_extension():
    """paddle.utils.cpp_extension, imported without its warning about ccache."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from paddle.utils import cpp_extension
        from paddle.utils.cpp_extension import extension_utils
    return cpp_extension, extension_utils


def include_dirs() -> list:
    """The folders a compile of the units reads headers from outside the compiler's own: Paddle's (paddle/include
    and its third_party), Python's and csrc/ (what cpp_extension passes; for compiles of the units by hand)."""
    return [*_cpp_extension()[1].find_paddle_includes(False), sysconfig.get_paths()["include"], CSRC]


def _register(so_path: str):
    """Register the ops of a built library in this process; returns their names."""
    return _cpp_extension()[1].load_op_meta_info_and_register_op(so_path)


def build(force: bool = False, verbose: bool = False) -> str:
    """Build (or find) the shared library; returns its path. Raises on failure."""
    import paddle
    load = _cpp_extension()[0].load
    with_cuda = paddle.is_compiled_with_cuda()
    folder = os.path.join(cache_root(), f"{NAME}_{build_key(with_cuda)}")
    os.makedirs(folder, exist_ok=True)
    so_path = os.path.join(folder, NAME, f"{NAME}.so")
    stamp = os.path.join(folder, "built.json")
    with _file_lock(os.path.join(folder, ".lock")):
        if force or not (os.path.isfile(so_path) and os.path.isfile(stamp)):
            for old in (stamp, so_path):
                if os.path.exists(old):
                    os.remove(old)
            omp_cxx, omp_ld = _openmp_flags()
            cxx = list(CXX_FLAGS) + omp_cxx + (["-DPRL_WITH_CUDA"] if with_cuda else [])
            with _quiet(verbose, os.path.join(folder, "build.log")):
                load(name=NAME, sources=sources(with_cuda), extra_cxx_cflags=cxx,
                     extra_cuda_cflags=list(CUDA_FLAGS) + ["-DPRL_WITH_CUDA"],
                     extra_ldflags=omp_ld + list(LD_FLAGS),
                     extra_include_paths=[CSRC], build_directory=folder, verbose=verbose)
            if not os.path.isfile(so_path):
                raise CustomOpsError(f"the build finished without {so_path}")
            with open(stamp, "w", encoding="utf-8") as f:
                json.dump({"sources": [os.path.basename(s) for s in sources(with_cuda)], "cuda": with_cuda}, f)
    return so_path


@contextlib.contextmanager
def _quiet(verbose: bool, log_path: str):
    """Send the compiler's output (stdout and stderr of the build, subprocesses included) to `log_path`
    unless verbose; a failure quotes the end of that log."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    failed = None
    try:
        with open(log_path, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            except Exception as e:  # noqa: BLE001 - re-raised below with the log's tail
                failed = e
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    if failed is not None:
        with open(log_path, errors="replace") as f:
            errors = [line.rstrip() for line in f if "error" in line.lower()][:5]
        detail = "; ".join(errors) or str(failed)
        raise CustomOpsError(f"building the fused kernels failed (log: {log_path}): {detail}") from failed


def configure(mode: str) -> None:
    """Set `auto | on | off`; `on` builds and loads at once (raising CustomOpsError if that fails)."""
    mode = str(mode).strip().lower()
    if mode in ("true", "1", "yes"):
        mode = "on"
    elif mode in ("false", "0", "no"):
        mode = "off"
    if mode not in MODES:
        raise ValueError(f"use_custom_ops: expected one of {', '.join(MODES)}, got {mode!r}")
    with _State.lock:
        _State.mode = mode
        if mode == "off":
            _State.loaded, _State.reason = None, "use_custom_ops is off"
            return
        if _State.loaded is False:
            _State.loaded = None  # try again (the mode may have changed from off)
    if mode == "on":
        available()


def mode() -> str:
    return _State.mode


def available() -> bool:
    """Whether the fused kernels are in use (building and loading them on the first call)."""
    if _State.mode == "off":
        return False
    if _State.loaded is None:
        with _State.lock:
            if _State.loaded is None:
                _load()
    if not _State.loaded and _State.mode == "on":
        raise CustomOpsError(f"use_custom_ops is on but the fused kernels cannot be used: {_State.reason}")
    return bool(_State.loaded)


def _load() -> None:
    try:
        so_path = build()
        names = _register(so_path)
        _State.library, _State.ops, _State.loaded, _State.reason = so_path, tuple(names), True, ""
    except Exception as e:  # noqa: BLE001 - any build or load problem means "use the fallbacks"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _State.loaded, _State.reason = False, f"{type(e).__name__}: {first}"[:300]
        if _State.mode == "auto":
            logger.warning("custom ops unavailable (%s); using the pure-Paddle fallbacks", _State.reason)


def status() -> dict:
    return {"mode": _State.mode, "loaded": bool(_State.loaded), "library": _State.library,
            "reason": _State.reason, "cache": cache_root()}


_run_custom_op = None   # Paddle's custom-op entry, looked up on the first call (run is called per kernel launch)


def run(name: str, *args):
    """Call a registered custom op; returns its list of outputs."""
    global _run_custom_op
    if _run_custom_op is None:
        # this file imports Paddle where it uses it, as its other functions do (never at its top)
        from paddle import _C_ops
        _run_custom_op = _C_ops._run_custom_op
    return _run_custom_op(name, *args)

"""Build and run the standalone CUDA check: every kernel of csrc/cuda against the CPU kernels of csrc/cpu on the same
random inputs, without Paddle (csrc/cuda/test/prl_cuda_check.cu; needs nvcc, a C++ compiler and, to run, a GPU).

    python tools/cuda_check.py                    # build for the visible GPUs and run (exit 0 when all pass)
    python tools/cuda_check.py --arch sm_80,sm_90 # build for these architectures (A100; H100 / H200)
    python tools/cuda_check.py --build-only       # compile and link only (what the CPU-only test suite does)
    python tools/cuda_check.py --seed 7           # other random inputs

The program prints one line per kernel (name, GPU, largest absolute error, largest error relative to the output's
scale, tolerance, PASS / FAIL) and exits 1 when a kernel fails, 77 when no CUDA device is usable.

The flags are the Paddle build's (paddle_rl/ops/build.py: CXX_FLAGS for the CPU kernels, CUDA_FLAGS for the CUDA
ones) plus -DPRL_NO_PADDLE; the CPU kernels build without OpenMP (their rows split over std::threads, with the same
split). Without --arch the build targets the compute capabilities nvidia-smi reports, or sm_80 and sm_90 where it
reports none, each as native code, plus PTX of the newest for later GPUs. The binary is kept in --build-dir (default
$PADDLE_RL_OPS_CACHE or ~/.cache/paddle_rl/ops, under cuda_check_<hash>) and rebuilt when a source or flag changes.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
CHECK_SOURCE = os.path.join(CSRC, "cuda", "test", "prl_cuda_check.cu")
CPU_KERNELS = ("attention", "bf16_matmul", "kv_cache", "linear", "logprob", "rms_norm", "rollout_state", "rotary", "sampling", "swiglu")
DEFAULT_ARCHS = ("sm_80", "sm_90")
NO_DEVICE = 77


def _load_build_flags():
    """(CXX_FLAGS, LD_FLAGS, CUDA_FLAGS) of paddle_rl/ops/build.py, read from the file: importing the package would
    import Paddle, which the GPU machines that run this check do not have."""
    spec = importlib.util.spec_from_file_location("_prl_build_flags", os.path.join(ROOT, "paddle_rl", "ops", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CXX_FLAGS), list(module.LD_FLAGS), list(module.CUDA_FLAGS)


CXX_FLAGS, LD_FLAGS, CUDA_FLAGS = _load_build_flags()


class CheckError(RuntimeError):
    """The check cannot be built (no compiler, a bad --arch, a compile error)."""


def find_nvcc():
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


def find_cxx():
    return shutil.which("c++") or shutil.which("g++")


def gpu_archs():
    """sm_XY of each GPU nvidia-smi lists (deduplicated, in order); [] without nvidia-smi or GPUs."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    archs = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", line)
        if m and f"sm_{m.group(1)}{m.group(2)}" not in archs:
            archs.append(f"sm_{m.group(1)}{m.group(2)}")
    return archs


def supported_archs(nvcc: str):
    """The compute_XX names this nvcc accepts (nvcc --list-gpu-arch)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    return re.findall(r"compute_\w+", out.stdout)


def arch_flags(archs, nvcc: str):
    """-gencode flags: native code for each sm_XY, PTX of the newest (a later GPU compiles it at load time).
    Raises CheckError naming an architecture that is malformed or that this nvcc does not support."""
    if not archs:
        raise CheckError("--arch: no architecture given")
    known = supported_archs(nvcc)
    flags, numbers = [], []
    for arch in archs:
        m = re.fullmatch(r"sm_(\d+)([af]?)", arch)
        if not m:
            raise CheckError(f"--arch: {arch!r} is not of the form sm_XY (e.g. sm_80 for A100, sm_90 for H100 / H200)")
        compute = f"compute_{m.group(1)}{m.group(2)}"
        if known and compute not in known:
            raise CheckError(f"--arch: {arch} is not supported by {nvcc} (it lists {', '.join(known)})")
        flags.append(f"-gencode=arch={compute},code={arch}")
        numbers.append((int(m.group(1)), compute))
    newest = max(numbers)[1]
    flags.append(f"-gencode=arch={newest},code={newest}")
    return flags


def _sources():
    files = [CHECK_SOURCE, os.path.join(CSRC, "prl_common.h"), os.path.join(CSRC, "prl_kv_dtype.h"),
             os.path.join(CSRC, "prl_lowp.h"),
             os.path.join(CSRC, "cpu", "kernels.h")]
    files += [os.path.join(CSRC, "cpu", f"{n}.cc") for n in CPU_KERNELS]
    cuda = os.path.join(CSRC, "cuda")
    files += sorted(os.path.join(cuda, n) for n in os.listdir(cuda) if n.endswith((".cu", ".cuh", ".h")))
    return files


def cuda_sources():
    cuda = os.path.join(CSRC, "cuda")
    return sorted(os.path.join(cuda, n) for n in os.listdir(cuda) if n.endswith(".cu"))


def commands(folder: str, nvcc: str, cxx: str, archs):
    """The compile and link commands, as {step: argv}; the unit files they name are written by build()."""
    gencode = arch_flags(archs, nvcc)
    nv = [nvcc, "-std=c++17", *CUDA_FLAGS, "-DPRL_NO_PADDLE", f"-I{CSRC}", *gencode, f"-ccbin={cxx}"]
    return {
        "cpu": [cxx, "-c", "-std=c++17", *CXX_FLAGS, "-DPRL_NO_PADDLE", f"-I{CSRC}",
                os.path.join(folder, "cpu_kernels.cc"), "-o", os.path.join(folder, "cpu_kernels.o")],
        "cuda": [*nv, "-c", os.path.join(folder, "cuda_kernels.cu"), "-o", os.path.join(folder, "cuda_kernels.o")],
        "check": [*nv, "-c", CHECK_SOURCE, "-o", os.path.join(folder, "prl_cuda_check.o")],
        "link": [*nv, *(f"-Xlinker={f}" if f.startswith("-Wl") else f"-Xcompiler={f}" for f in LD_FLAGS),
                 *(os.path.join(folder, n) for n in ("prl_cuda_check.o", "cuda_kernels.o", "cpu_kernels.o")),
                 "-o", os.path.join(folder, "prl_cuda_check")],
    }


def build_key(archs, nvcc: str, cxx: str) -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(os.path.relpath(path, CSRC).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(json.dumps([list(archs), CXX_FLAGS, LD_FLAGS, CUDA_FLAGS, os.path.realpath(nvcc),
                         os.path.realpath(cxx)]).encode())
    return h.hexdigest()[:16]


def default_build_root() -> str:
    root = os.environ.get("PADDLE_RL_OPS_CACHE")
    return os.path.abspath(os.path.expanduser(root or os.path.join("~", ".cache", "paddle_rl", "ops")))


def build(archs=None, build_dir=None, force=False, log=print) -> str:
    """Compile and link the check; returns the binary's path. Raises CheckError on a missing tool or a failed step
    (the message quotes the compiler's error lines)."""
    nvcc, cxx = find_nvcc(), find_cxx()
    if nvcc is None:
        raise CheckError("nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc")
    if cxx is None:
        raise CheckError("no C++ compiler (c++ or g++) on PATH")
    archs = list(archs or gpu_archs() or DEFAULT_ARCHS)
    folder = build_dir or os.path.join(default_build_root(), f"cuda_check_{build_key(archs, nvcc, cxx)}")
    os.makedirs(folder, exist_ok=True)
    binary = os.path.join(folder, "prl_cuda_check")
    steps = commands(folder, nvcc, cxx, archs)
    if os.path.isfile(binary) and not force and build_dir is None:
        log(f"cuda_check: {binary} is up to date ({', '.join(archs)})")
        return binary
    with open(os.path.join(folder, "cpu_kernels.cc"), "w", encoding="utf-8") as f:
        f.write("".join(f'#include "cpu/{n}.cc"\n' for n in CPU_KERNELS))
    with open(os.path.join(folder, "cuda_kernels.cu"), "w", encoding="utf-8") as f:
        f.write("".join(f'#include "cuda/{os.path.basename(p)}"\n' for p in cuda_sources()))
    log(f"cuda_check: building for {', '.join(archs)} in {folder}")

    def run(step):
        done = subprocess.run(steps[step], capture_output=True, text=True, timeout=1800)
        return step, done.returncode, done.stdout + done.stderr

    if os.path.exists(binary):
        os.remove(binary)
    with ThreadPoolExecutor(3) as pool:
        compiled = list(pool.map(run, ("cuda", "check", "cpu")))
    compiled.append(run("link"))
    for step, rc, output in compiled:
        if rc != 0:
            errors = [line for line in output.splitlines() if "error" in line.lower()][:20]
            raise CheckError(f"cuda_check: the {step} step failed (rc {rc}): {' '.join(steps[step])}\n"
                             + "\n".join(errors or output.splitlines()[-20:]))
    return binary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", help="comma-separated sm_XY list (default: the visible GPUs', else sm_80,sm_90)")
    ap.add_argument("--build-only", action="store_true", help="compile and link, do not run")
    ap.add_argument("--build-dir", help="build here (always rebuilt) instead of the cache folder")
    ap.add_argument("--force", action="store_true", help="rebuild even if the cached binary is up to date")
    ap.add_argument("--seed", type=int, help="seed of the random inputs (the program's default otherwise)")
    args = ap.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()] if args.arch else None
    try:
        binary = build(archs, args.build_dir, args.force)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.build_only:
        print(f"cuda_check: built {binary}")
        return 0
    rc = subprocess.run([binary, *(["--seed", str(args.seed)] if args.seed is not None else [])]).returncode
    if rc == NO_DEVICE:
        print("cuda_check: built, but no CUDA device is usable here: nothing was compared", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())

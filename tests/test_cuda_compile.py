"""Every CUDA source of csrc/cuda compiles with nvcc against the installed Paddle's headers (a CPU wheel's
headers suffice), so a defect in a CUDA kernel shows on a machine without a GPU; and the CPU unit compiled with
the CUDA dispatch on (-DPRL_WITH_CUDA) calls exactly the host functions the CUDA sources define, with the same
signatures (its undefined `...CUDA` symbols against the CUDA object's defined ones).

Flags: those paddle.utils.cpp_extension gives nvcc (-DPADDLE_WITH_CUDA -DEIGEN_USE_GPU -DNVCC, C++17, relaxed
constexpr), the project's (build.CUDA_FLAGS, -DPRL_WITH_CUDA), sm_90, and -DPADDLE_NO_PYTHON: without it
paddle/extension.h includes Paddle's Python bindings, which need the cuBLAS headers of a full CUDA toolkit.
Paddle's headers dominate the time (about 25 s per file on 2 cores), so the default tests compile all CUDA files
as one translation unit, beside the CPU units (build.CPU_UNITS); the per-file compiles (what the build does;
3-4 minutes on 2 cores, run in parallel) are marked slow.

The standalone check (csrc/cuda/test/prl_cuda_check.cu, built by tools/cuda_check.py) runs every CUDA kernel through
its launcher (csrc/cuda/launch.h) against the CPU kernel's launcher (csrc/cpu/kernels.h) without Paddle: it is built
here for one architecture (sm_90, or the GPU's; about 30 s on 2 cores), which also proves the launchers and kernels
compile without Paddle's headers, and run where nvidia-smi lists a GPU.
"""
import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import cuda_check  # tools/cuda_check.py (tests/conftest.py puts tools/ on the path)
from paddle_rl.ops import build

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)
SOURCES = sorted(n for n in os.listdir(os.path.join(build.CSRC, "cuda")) if n.endswith(".cu"))
FLAGS = ["-c", "-DPADDLE_WITH_CUDA", "-DPADDLE_NO_PYTHON", "-DEIGEN_USE_GPU", "-DNVCC", "-std=c++17",
         "--expt-relaxed-constexpr", "-arch=sm_90", "-Xcompiler", "-fPIC", "-DPRL_WITH_CUDA", *build.CUDA_FLAGS]

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH nor at /usr/local/cuda/bin/nvcc: the "
                                                     "CUDA sources of csrc/cuda are not compiled")


def _includes():
    return [f"-I{d}" for d in build.include_dirs()]


def _compile(source: str, obj: str):
    """(return code, the compiler's output) of one nvcc -c."""
    done = subprocess.run([NVCC, *FLAGS, *_includes(), source, "-o", obj], capture_output=True, text=True,
                          timeout=900)
    return done.returncode, done.stdout + done.stderr


def _errors(output: str):
    """The compiler's error lines (nvcc's `file(line): error` and the host compiler's `file:line: error`)."""
    return [line for line in output.splitlines() if re.search(r"(\(\d+\)|:\d+(:\d+)?): (fatal )?error", line)]


def _check(rc: int, output: str, what: str):
    errors = _errors(output)
    failed = sorted({os.path.basename(re.split(r"[(:]", e, maxsplit=1)[0]) for e in errors})
    assert rc == 0, (f"nvcc failed on {what} (errors in {', '.join(failed) or '?'}):\n"
                     + "\n".join(errors[:20] or output.splitlines()[-20:]))


def _cuda_includes():
    """nvcc's own include folders (the toolkit's include/ and include/cccl), for the host compiler."""
    probe = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                           text=True, timeout=60)
    flags = []
    for line in (probe.stdout + probe.stderr).splitlines():
        m = re.match(r"#\$ (SYSTEM_)?INCLUDES=(.*)", line)
        if m:
            flags += shlex.split(m.group(2))
    return flags


def _compile_cpu_unit(unit: str, obj: str):
    """A CPU unit (build.CPU_UNITS) with the CUDA dispatch on, as the CUDA build compiles it (-O0: only its
    symbols matter here)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "no C++ compiler (c++ or g++) on PATH"
    done = subprocess.run([cxx, "-c", "-O0", "-fPIC", "-std=c++17", "-fopenmp", "-DPADDLE_WITH_CUDA",
                           "-DPADDLE_NO_PYTHON", "-DPRL_WITH_CUDA", *_includes(), *_cuda_includes(),
                           os.path.join(build.CSRC, unit), "-o", obj], capture_output=True, text=True,
                          timeout=900)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    """{"cuda": every CUDA source as one unit, each CPU unit's name: that unit}: (return code, output, object),
    compiled side by side."""
    folder = tmp_path_factory.mktemp("cuda_units")
    unit = folder / "all_cuda_sources.cu"
    unit.write_text("".join(f'#include "cuda/{name}"\n' for name in SOURCES))
    cuda_obj = str(folder / "all_cuda_sources.o")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        cuda = pool.submit(_compile, str(unit), cuda_obj)
        cpu = {name: (pool.submit(_compile_cpu_unit, name, str(folder / f"{name}.o")), str(folder / f"{name}.o"))
               for name in build.CPU_UNITS}
        return {"cuda": (*cuda.result(), cuda_obj), **{name: (*job.result(), obj) for name, (job, obj) in cpu.items()}}


def _cuda_entries(obj: str, defined: bool):
    """Mangled names of the free functions named ...CUDA that `obj` defines (or needs)."""
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to read the objects' symbols"
    which = "--defined-only" if defined else "--undefined-only"
    listed = subprocess.run([nm, "--extern-only", which, "--format=just-symbols", obj], capture_output=True, text=True,
                            check=True).stdout.split()
    names = set()
    for symbol in listed:
        m = re.match(r"_Z(\d+)", symbol)
        if m and symbol[m.end():m.end() + int(m.group(1))].endswith("CUDA"):
            names.add(symbol)
    return names


def _demangled(symbols):
    filt = shutil.which("c++filt")
    if not filt or not symbols:
        return sorted(symbols)
    return subprocess.run([filt], input="\n".join(sorted(symbols)) + "\n", capture_output=True,
                          text=True).stdout.splitlines()


@needs_nvcc
def test_cuda_sources_compile_as_one_unit(units):
    rc, output, obj = units["cuda"]
    _check(rc, output, f"{len(SOURCES)} files as one unit")
    assert os.path.getsize(obj) > 0


@needs_nvcc
def test_cpu_dispatch_matches_cuda_sources(units):
    """Each `XxxCUDA(...)` the CPU kernels call when built with CUDA is defined by csrc/cuda with that exact
    signature (else loading the library fails on a GPU machine), and each one csrc/cuda defines is called."""
    called = set()
    for name in build.CPU_UNITS:
        rc, output, obj = units[name]
        assert rc == 0, f"the CPU unit {name} does not compile with -DPRL_WITH_CUDA:\n" + "\n".join(
            _errors(output)[:20] or output.splitlines()[-20:])
        called |= _cuda_entries(obj, defined=False)
    assert units["cuda"][0] == 0, "the CUDA sources do not compile (test_cuda_sources_compile_as_one_unit)"
    defined = _cuda_entries(units["cuda"][2], defined=True)
    assert called, "the CPU units call no ...CUDA function: is the CUDA dispatch compiled in?"
    assert called == defined, (f"called by csrc/cpu but not defined in csrc/cuda: {_demangled(called - defined)}; "
                               f"defined in csrc/cuda but never called: {_demangled(defined - called)}")


@pytest.fixture(scope="module")
def compiled_each(request, tmp_path_factory):
    """name -> (return code, output) of each source the session runs test_cuda_source_compiles for, compiled
    in parallel (one nvcc per core)."""
    chosen = sorted({item.callspec.params["source"] for item in request.session.items
                     if getattr(item, "originalname", "") == "test_cuda_source_compiles"})
    folder = tmp_path_factory.mktemp("cuda_objects")
    with ThreadPoolExecutor(max(1, min(len(chosen), os.cpu_count() or 1))) as pool:
        results = pool.map(lambda n: _compile(os.path.join(build.CSRC, "cuda", n), str(folder / f"{n}.o")), chosen)
        return dict(zip(chosen, results))


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_cuda_source_compiles(compiled_each, source):
    _check(*compiled_each[source], source)


# ------------------------------------------------------------------------------------------------ standalone check

def _declared(header: str, pattern: str):
    with open(os.path.join(build.CSRC, header), encoding="utf-8") as f:
        return re.findall(pattern, f.read(), flags=re.M)


CPU_ONLY_LAUNCHERS = ("PackWeightLowp",)  # csrc/cpu/kernels.h launchers without a CUDA twin (by design)


def test_standalone_check_calls_every_launcher():
    """Every launcher of csrc/cuda/launch.h and csrc/cpu/kernels.h is called by the standalone check, and every
    CUDA source's Paddle entry calls a launcher (no kernel launched around them)."""
    with open(cuda_check.CHECK_SOURCE, encoding="utf-8") as f:
        check = f.read()
    cuda = _declared(os.path.join("cuda", "launch.h"), r"^cudaError_t (\w+)\(")
    cpu = _declared(os.path.join("cpu", "kernels.h"), r"^void (\w+)\(")
    assert len(cuda) >= 13 and len(cpu) >= 14, (cuda, cpu)  # 9 ops, 4 of them with a backward; a CPU pack
    assert not [n for n in cuda if f"prl_cuda::{n}(" not in check], "launchers the check never runs"
    assert not [n for n in cpu if f"prl_cpu::{n}(" not in check], "CPU kernels the check never compares with"
    # the low-precision pack runs on the CPU only: the GPU kernel reads the bytes it writes
    assert sorted(cuda) == sorted(n for n in cpu if n not in CPU_ONLY_LAUNCHERS), (
        "a CUDA launcher without its CPU counterpart (or the reverse)")
    assert set(CPU_ONLY_LAUNCHERS) <= set(cpu), "CPU_ONLY_LAUNCHERS names a launcher kernels.h does not declare"
    for name in SOURCES:
        with open(os.path.join(build.CSRC, "cuda", name), encoding="utf-8") as f:
            entries = f.read().split("#ifndef PRL_NO_PADDLE", 1)
        assert len(entries) == 2 and "<<<" not in entries[1], f"{name}: its Paddle entry must only call launchers"


def test_cuda_check_arch_flags():
    """--arch takes sm_XY names: native code for each, PTX of the newest; anything else is refused by name."""
    nvcc = NVCC or "nvcc"
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: the architectures nvcc supports cannot be listed")
    assert cuda_check.arch_flags(["sm_80", "sm_90"], nvcc) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]
    for bad, message in (("sm_9x", "not of the form sm_XY"), ("compute_90", "not of the form sm_XY"),
                         ("sm_20", "not supported by")):
        with pytest.raises(cuda_check.CheckError, match=message):
            cuda_check.arch_flags([bad], nvcc)


def _has_gpu():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "nvidia-smi is not on PATH: no GPU to run the standalone CUDA check on"
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return False, f"nvidia-smi lists no GPU ({(listed.stdout + listed.stderr).strip()[:200]})"
    return True, ""


@pytest.fixture(scope="module")
def check_binary(tmp_path_factory):
    """The standalone check, built for the visible GPUs (else sm_90) in a fresh folder."""
    return cuda_check.build(cuda_check.gpu_archs() or ["sm_90"], str(tmp_path_factory.mktemp("cuda_check")),
                            log=lambda *_: None)


@needs_nvcc
def test_standalone_check_builds_without_paddle(check_binary):
    """Built with no Paddle include path: a Paddle include outside the PRL_NO_PADDLE parts fails this build."""
    assert os.path.isfile(check_binary) and os.access(check_binary, os.X_OK)
    with open(check_binary, "rb") as f:
        image = f.read()
    archs = cuda_check.gpu_archs() or ["sm_90"]
    assert all(a.encode() in image for a in archs), f"no {archs} code in the binary"


@needs_nvcc
def test_standalone_check_passes_on_the_gpu(check_binary):
    """Every CUDA kernel equals its CPU kernel within tests/test_ops.py's tolerances (run where a GPU exists)."""
    has_gpu, reason = _has_gpu()
    if not has_gpu:
        pytest.skip(reason)
    done = subprocess.run([check_binary], capture_output=True, text=True, timeout=600)
    if done.returncode == cuda_check.NO_DEVICE:
        pytest.skip(f"nvidia-smi lists a GPU but CUDA cannot use it: {done.stdout.strip()}")
    lines = [line for line in done.stdout.splitlines() if re.search(r" (PASS|FAIL)$", line)]
    assert done.returncode == 0 and not any(line.endswith("FAIL") for line in lines), done.stdout + done.stderr
    kernels = {line.split()[0] for line in lines}
    for dtype in ("float32", "bfloat16", "float16"):
        assert {f"decode_attention[{dtype}]", f"rotary_qkv_cache[{dtype}]", f"kv_place[{dtype}]"} <= kernels
    assert {"packed_linear_lowp[bfloat16]", "packed_linear_lowp[int8]", "packed_linear_lowp[int8,bf16_act]",
            "packed_linear_lowp[int4]", "packed_linear_lowp[int4,bf16_act]"} <= kernels

"""The CPU kernels build for every x86 CPU kind they have code for, not only for the machine running the tests.

csrc/ picks its tiles with the compiler's target macros (ops/build.py compiles with -march=native): AMX tiles
(__AMX_TILE__ and __AMX_BF16__), AVX512-BF16 (__AVX512BF16__), AVX-512 (__AVX512F__) and AVX2 with FMA, each with
code of its own. A machine compiles only its own branches, so a change made on one kind can break the build on
another; there the library would not build, and every op would fall back to pure Paddle (with a warning, several
times slower). Each test compiles both CPU units (build.CPU_UNITS) with the build's flags for one kind's -march,
at -O0, to objects: code generation and the assembler check what a syntax check does not (an AMX tile given as a
variable, not a constant, fails only in the assembler). It then reads the assembly of paddle_rl_ops.cc for that
kind's own instructions, and for the absence of the next kind's, so the branches are known to be the ones
compiled. The kind this machine is (its -march=native macros) is skipped: every other test builds and runs it.
About 50 s on 2 cores for the three other kinds.
"""
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from paddle_rl.ops import build

# kind -> (GCC's -march, what its assembly must hold, what it must not); the kinds of docs/performance.md's machines
KINDS = {
    # Intel Xeon with AMX (Sapphire Rapids): AMX-BF16 tiles, AVX512-BF16 beside them
    "amx": ("sapphirerapids", ("tdpbf16ps", "vdpbf16ps"), ()),
    # AVX512-BF16 without AMX: AMD Zen 4's instruction sets (GCC 12 has no -march=znver4; Cooper Lake's are these)
    "avx512_bf16": ("cooperlake", ("vdpbf16ps", "%zmm"), ("tdpbf16ps",)),
    # AVX-512 without AVX512-BF16 or AMX (Intel Ice Lake)
    "avx512": ("icelake-server", ("%zmm",), ("vdpbf16ps", "tdpbf16ps")),
    # AVX2 and FMA without AVX-512 (AMD Zen 2 / Zen 3, Intel Haswell to Comet Lake); at -O0 the vector types' sums
    # are not yet fused into FMAs, so the marker is AVX2's widening of bytes into a ymm register (LoadInt8)
    "avx2": ("haswell", ("vpmovsxbd", "%ymm"), ("%zmm", "vdpbf16ps")),
}
# the macros that choose the kernels' branches
MACROS = ("__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__", "__AVX512F__", "__AVX2__", "__FMA__")

CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _macros(march: str):
    """The branch-choosing macros the compiler defines for -march, or None where it does not know that -march."""
    done = subprocess.run([CXX, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return None
    return frozenset(m for m in MACROS if re.search(rf"^#define {m} ", done.stdout, flags=re.M))


def _flags(march: str):
    """The build's compile flags (build.CXX_FLAGS, OpenMP's) for `march`, at -O0: only whether the code compiles,
    and which instructions it uses, matter here."""
    flags = [f for f in build.CXX_FLAGS if f not in ("-O3", "-march=native")]
    includes = [f"-I{d}" for d in build.include_dirs()]
    return ["-std=c++17", "-O0", f"-march={march}", *flags, *build._openmp_flags()[0], *includes]


def _compile(march: str, unit: str, obj: str):
    """(return code, the compiler's and the assembler's error lines) of one unit compiled to `obj`, its assembly
    kept beside it (`obj` with .s)."""
    done = subprocess.run([CXX, "-c", "-save-temps=obj", *_flags(march), os.path.join(build.CSRC, unit), "-o", obj],
                          capture_output=True, text=True, timeout=900)
    errors = [line for line in done.stderr.splitlines() if re.search(r":\d+(:\d+)?: ((fatal )?error|Error):", line)]
    return done.returncode, list(dict.fromkeys(errors)) or done.stderr.splitlines()[-20:]   # once per template


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """kind -> why it is skipped (this machine's own kind, or a -march the compiler does not know), or
    {unit: ((return code, errors), its assembly's path)}; the kinds' units compiled side by side."""
    assert CXX, "no C++ compiler (c++ or g++) on PATH"
    native = _macros("native")
    folder = tmp_path_factory.mktemp("isa_builds")
    results, jobs = {}, {}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for kind, (march, _, _) in KINDS.items():
            macros = _macros(march)
            if macros is None:
                results[kind] = f"{CXX} does not know -march={march}"
            elif macros == native:
                results[kind] = f"this machine is this kind (-march=native defines {', '.join(sorted(native))})"
            else:
                stems = {unit: str(folder / f"{kind}_{os.path.splitext(unit)[0]}") for unit in build.CPU_UNITS}
                jobs[kind] = {unit: (pool.submit(_compile, march, unit, stem + ".o"), stem + ".s")
                              for unit, stem in stems.items()}
        for kind, units in jobs.items():
            results[kind] = {unit: (job.result(), path) for unit, (job, path) in units.items()}
    return results


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kernels_build_for_each_cpu_kind(compiled, kind):
    result = compiled[kind]
    if isinstance(result, str):
        pytest.skip(result)
    march, present, absent = KINDS[kind]
    for unit, ((rc, errors), _) in result.items():
        assert rc == 0, f"{unit} does not compile for {kind} (-march={march}):\n" + "\n".join(errors[:20])
    with open(result["paddle_rl_ops.cc"][1], encoding="utf-8") as f:
        assembly = f.read()
    missing = [i for i in present if i not in assembly]
    assert not missing, f"-march={march}: the kernels use no {', '.join(missing)}: is this kind's branch compiled?"
    stray = [i for i in absent if i in assembly]
    assert not stray, f"-march={march}: the kernels use {', '.join(stray)}, which this kind does not have"

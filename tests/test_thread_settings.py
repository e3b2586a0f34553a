"""env.configure_threads in real processes: the thread count, MKL's AMD path and the stride-kernel flag that Paddle
reads, whether paddle_rl is imported before Paddle (the CLI, run_rl.py) or after it (`import paddle` first, as a
notebook or a script of one's own would). Paddle's import sets OMP_NUM_THREADS=1 where it is unset, so without
these settings such a process trains on one core (a step of the tiny default's update: 2.8-4.2 s against 0.7-1.1 s
on a 2-core EPYC)."""
import json
import os
import subprocess
import sys

import pytest

from paddle_rl.env import THREAD_SETTINGS, cpu_count, cpu_info

SCRIPT = r'''
import ctypes, json, os, sys, warnings
warnings.simplefilter("always")
first = sys.argv[1]
if first == "paddle":
    import paddle
import paddle_rl
import paddle
omp = ctypes.CDLL("libiomp5.so")   # Paddle's OpenMP runtime, already loaded: the same library
print(json.dumps({"env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_DEBUG_CPU_TYPE",
                                                         "FLAGS_use_stride_kernel")},
                  "omp_threads": omp.omp_get_max_threads(),
                  "stride_kernel": paddle.get_flags(["FLAGS_use_stride_kernel"])["FLAGS_use_stride_kernel"]}))
'''


def run(first: str, **given):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_SETTINGS}
    env.update(given)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, first], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux: /proc/self/environ")


@pytest.mark.parametrize("first", ["paddle_rl", "paddle"])
def test_paddle_gets_the_settings_whichever_is_imported_first(first):
    out, stderr = run(first)
    threads = max(1, cpu_count())
    assert out["env"] == {"OMP_NUM_THREADS": str(threads), "MKL_DEBUG_CPU_TYPE": "5", "FLAGS_use_stride_kernel": "0"}
    assert out["omp_threads"] == threads
    assert out["stride_kernel"] is False
    # MKL reads its CPU path when it first runs: set after Paddle's import it holds only if no product ran yet,
    # which the process is told on the CPUs where that path matters
    said = "MKL_DEBUG_CPU_TYPE=5 (MKL's AVX2 path on AMD CPUs) holds only if" in stderr
    assert said == (first == "paddle" and cpu_info()["vendor"] == "AuthenticAMD")


def test_settings_the_process_started_with_win_after_paddle_was_imported():
    """OMP_NUM_THREADS=1 given at the start is kept (Paddle's import writes the same value where none is given, so
    only the process's starting environment tells them apart); so are the others."""
    out, stderr = run("paddle", OMP_NUM_THREADS="1", FLAGS_use_stride_kernel="1", MKL_DEBUG_CPU_TYPE="4")
    assert out["env"] == {"OMP_NUM_THREADS": "1", "MKL_DEBUG_CPU_TYPE": "4", "FLAGS_use_stride_kernel": "1"}
    assert out["omp_threads"] == 1
    assert out["stride_kernel"] is True
    assert "MKL_DEBUG_CPU_TYPE=5" not in stderr

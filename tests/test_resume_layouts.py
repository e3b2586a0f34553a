"""kill -9 of every process of a 2-process run, then `resume_from_checkpoint: auto`, reproduces the uninterrupted
run exactly in DP2, TP2, PP2 and sharding stage 2 (docs/reliability.md).

Per layout, three launches of `python -m paddle.distributed.launch --nproc_per_node 2 paddle_rl/run_rl.py`
(gloo on CPU, the micro model, save_steps 2, max_steps 3):

1. the reference: 3 steps uninterrupted;
2. the same run in another folder, frozen during step 3 (PADDLE_RL_TEST_HANG=3:update stops every rank with
   SIGSTOP after its first backward of step 3, once checkpoint-2 is complete), then every process of the launch,
   the launcher included, is killed with SIGKILL;
3. the same command with resume_from_checkpoint=auto: it takes checkpoint-2 and trains step 3.

metrics.jsonl of 3 equals that of 1 value for value, wall-clock keys (TIMING_PREFIXES: time/*, perf/*) left out,
and model.safetensors of checkpoint-3 equals it bit for bit. The reward draws from Python's and NumPy's global
generators, so the runs also depend on the seeding of `random` and on each rank getting its own generator states
back (checkpoint.rng_stem).
"""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_dead_rank import MARKER, marked_pids, run_marker  # noqa: F401 (a fixture)
from test_parallel import run_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"dp2": {"data_parallel_degree": 2},
           "tp2": {"tensor_parallel_degree": 2},
           "pp2": {"pipeline_parallel_degree": 2},
           "sharding2": {"sharding_parallel_degree": 2, "sharding": "stage2"}}
HANG = "PADDLE_RL_TEST_HANG"
PLUGIN = '''
import random

import numpy as np


def noisy_length(completions, **kwargs):
    """A reward drawing from Python's and NumPy's global generators (a sampling judge, say), a data-dependent
    number of times: under data parallelism each rank's generators reach a state of their own."""
    out = []
    for c in completions:
        for _ in range(len(c) % 3):
            random.random()
            np.random.rand()
        out.append(float(len(c) % 5) - 2.0 + random.random() + float(np.random.rand()))
    return out
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume-layouts") / "rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def start(micro, plugin, out_dir, log_dir, marker, env=None, **extra):
    overrides = run_overrides(micro, out_dir, plugin, max_steps=3, save_steps=2, reward_funcs="noisy_length", **extra)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", log_dir,
           os.path.join(ROOT, "paddle_rl", "run_rl.py"), "/dev/null", *overrides]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **{MARKER: marker}, **(env or {}))
    full_env.pop("OMP_NUM_THREADS", None)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def logs(log_dir):
    out = ""
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            out += f"\n--- {name}\n" + f.read()[-3000:]
    return out


def run_to_end(micro, plugin, out_dir, log_dir, marker, timeout=400, **extra):
    proc = start(micro, plugin, out_dir, log_dir, marker, **extra)
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{output[-2000:]}{logs(log_dir)}"


def frozen_ranks(log_dir):
    """Ranks whose log says the HANG hook stopped them."""
    found = set()
    for rank in (0, 1):
        path = os.path.join(log_dir, f"workerlog.{rank}")
        if os.path.exists(path) and re.search(HANG + r": rank \d+ \(pid \d+\) sends itself SIGSTOP at step 3 update",
                                              open(path, errors="replace").read()):
            found.add(rank)
    return found


def kill_during_step_3(micro, plugin, out_dir, log_dir, marker, timeout=400, **extra):
    """Start the run, wait until both ranks are frozen in step 3, SIGKILL every process of the launch."""
    proc = start(micro, plugin, out_dir, log_dir, marker, env={HANG: "3:update"}, **extra)
    deadline = time.time() + timeout
    while frozen_ranks(log_dir) != {0, 1}:
        assert proc.poll() is None, f"the run ended before step 3 ({proc.returncode}):\n{logs(log_dir)}"
        assert time.time() < deadline, f"no rank froze in step 3 within {timeout} s:\n{logs(log_dir)}"
        time.sleep(0.2)
    time.sleep(0.5)  # the SIGSTOP itself follows the log line
    pids = marked_pids(marker)
    assert proc.pid in pids and len(pids) >= 3, pids  # the launcher and its two ranks
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not marked_pids(marker)
    assert os.path.isfile(os.path.join(out_dir, "checkpoint-2", "trainer_state.json"))
    assert not os.path.exists(os.path.join(out_dir, "checkpoint-3"))


def comparable_rows(out_dir):
    from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


@pytest.mark.parametrize("layout", ["dp2", *(pytest.param(name, marks=pytest.mark.slow)
                                             for name in ("tp2", "pp2", "sharding2"))])
def test_kill_9_and_auto_resume_reproduce_the_run(micro, plugin, tmp_path, run_marker, layout):
    from paddle_rl.model_files.safetensors_io import load_state
    degrees = LAYOUTS[layout]
    start_time = time.time()
    ref, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    run_to_end(micro, plugin, ref, str(tmp_path / "log-reference"), run_marker, **degrees)
    kill_during_step_3(micro, plugin, killed, str(tmp_path / "log-killed"), run_marker, **degrees)
    assert [r["step"] for r in comparable_rows(killed)] == [1, 2]
    run_to_end(micro, plugin, killed, str(tmp_path / "log-resumed"), run_marker, resume_from_checkpoint="auto",
               **degrees)
    assert "resumed from" in open(tmp_path / "log-resumed" / "workerlog.0").read()
    expected, got = comparable_rows(ref), comparable_rows(killed)
    assert [r["step"] for r in expected] == [1, 2, 3]
    for a, b in zip(expected, got):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert got == expected
    wa, wb = load_state(os.path.join(ref, "checkpoint-3")), load_state(os.path.join(killed, "checkpoint-3"))
    assert set(wa) == set(wb)
    differ = [k for k in wa if not np.array_equal(wa[k], wb[k])]
    assert not differ, differ
    print(f"{layout}: metrics of {len(expected)} steps and {len(wa)} tensors equal; {time.time() - start_time:.0f} s")

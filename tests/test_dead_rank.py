"""A rank killed with SIGKILL, or stuck (SIGSTOP), in a 2-process run (DP2, TP2) never hangs the others
(docs/reliability.md).

Each case trains the micro model on 2 real processes (gloo on CPU), launched by `python -m
paddle.distributed.launch ... run_rl.py` or by `paddle-rl train --nproc_per_node 2`, and makes one rank signal
itself at a precise point with the test-only hooks PADDLE_RL_TEST_DIE / PADDLE_RL_TEST_HANG
(paddle_rl/trainer/faults.py): during the rollout, inside a collective of the update, during a checkpoint save.
Every case checks that the command exits non-zero within 120 s of the signal, that the other rank's log names the
dead (or stuck) rank, and that no process of the run is left. Each run carries a marker in its environment, so
its processes are found (and killed in teardown) even after the launcher put them in sessions of their own.
"""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from micro_model import micro_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "PADDLE_RL_TEST_RUN"
LIMIT = 120.0   # seconds from the signal to the command's exit
PLUGIN = '''
def length_parity(completions, **kwargs):
    return [float(len(c) % 5) - 2.0 for c in completions]
'''
LAYOUTS = {"dp2": {"data_parallel_degree": 2}, "tp2": {"tensor_parallel_degree": 2}}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("dead-rank") / "rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def marked_pids(marker: str):
    """Processes whose environment holds MARKER=marker (the launcher, its ranks, anything they started)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            pass
    return found


@pytest.fixture
def run_marker():
    marker = uuid.uuid4().hex
    yield marker
    for pid in marked_pids(marker):  # whatever a failed case left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_run(launcher, micro, plugin, out, marker, env, **extra):
    """The command, started in a new session (its own process group), its output piped."""
    values = dict(do_eval=False, save_steps=1, max_steps=3, report_to="none", reward_plugins=plugin,
                  reward_funcs="length_parity", max_dec_len=8)
    values.update(extra)
    overrides = micro_overrides(micro, str(out / "run"), **values)
    log_dir = str(out / "log")
    if launcher == "launch":
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", log_dir,
               os.path.join(ROOT, "paddle_rl", "run_rl.py"), "/dev/null", *overrides]
    else:
        cmd = [sys.executable, "-m", "paddle_rl", "train", "/dev/null", "--nproc_per_node", "2", "--log_dir",
               log_dir, *overrides]
    full_env = dict(os.environ, PYTHONPATH=ROOT, **{MARKER: marker}, **env)
    full_env.pop("OMP_NUM_THREADS", None)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def launch(launcher, micro, plugin, out, marker, env, timeout=300, **extra):
    """Run the command to its end: (exit status, start and end time, its output, the logs by rank)."""
    start = time.time()
    proc = start_run(launcher, micro, plugin, out, marker, env, **extra)
    log_dir = str(out / "log")
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the command did not end within {timeout} s:\n{output[-3000:]}")
    end = time.time()
    logs = {}
    for rank in (0, 1):
        path = os.path.join(log_dir, f"workerlog.{rank}")
        logs[rank] = open(path, errors="replace").read() if os.path.exists(path) else ""
    return proc.returncode, start, end, output, logs


def signal_time(log: str, variable: str) -> float:
    m = re.search(variable + r": rank \d+ \(pid \d+\) sends itself \w+ at step \d+ \w+, time ([\d.]+)", log)
    assert m, f"the hook {variable} did not fire:\n{log[-3000:]}"
    return float(m.group(1))


def check_ended(marker, code, end, output, logs, dead, variable):
    """Non-zero exit, within LIMIT of the signal, nothing left running; returns (seconds after the signal, the
    other rank's watchdog message)."""
    other = 1 - dead
    details = f"{output[-2500:]}\n--- rank {other}\n{logs[other][-2500:]}\n--- rank {dead}\n{logs[dead][-1500:]}"
    assert code != 0, details
    latency = end - signal_time(logs[dead], variable)
    assert latency < LIMIT, details
    left = marked_pids(marker)
    assert not left, f"processes left running: {left}\n{details}"
    found = re.search(r"paddle_rl watchdog: rank \d+ stops: .*", logs[other])
    assert found, details
    return latency, found.group(0)


# --------------------------------------------------------------------------------------------- the watchdog alone

def _wait_for(predicate, seconds=5.0):
    deadline = time.time() + seconds
    while time.time() < deadline and not predicate():
        time.sleep(0.05)
    return predicate()


def test_watchdog_peer_states_and_collective_timeout(monkeypatch):
    """In process, with a child standing in for the peer: its states as the watchdog reads them (running,
    stopped, killed while not yet collected, gone), a collective pending past the timeout, and a peer's exit. A
    peer on another host is named, never taken for dead."""
    import socket

    from paddle_rl.parallel import watchdog as W
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert W.process_state(child.pid) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait_for(lambda: W.process_state(child.pid).startswith("stopped")), W.process_state(child.pid)
        host = socket.gethostname()
        wd = W.Watchdog(0, [(host, os.getpid(), 0), (host, child.pid, 0), ("elsewhere", 1, 0)], timeout=0.2)
        stops = []
        monkeypatch.setattr(wd, "_stop", lambda what, ranks, **kw: stops.append(f"{what}. {wd.describe_peers(ranks)}"))
        monkeypatch.setattr(W, "PEER_EXIT_GRACE", 0.0)
        wd.where = "step 2, update"
        wd.enter("all_reduce", [0, 1])
        wd._check()
        assert stops == []
        time.sleep(0.3)
        wd._check()
        assert stops == [f"all_reduce over ranks [0, 1] has not returned after 0 s (collective_timeout: 0.2) (step 2, "
                         f"update). rank 1 (pid {child.pid}): stopped (SIGSTOP or a debugger); rank 2 (pid 1 on "
                         f"elsewhere): not checked (another host)"]
        wd.leave()
        os.kill(child.pid, signal.SIGKILL)
        assert _wait_for(lambda: W.process_state(child.pid) == "exited (killed by SIGKILL)")
        wd._check()
        assert stops[1].startswith(f"rank 1 (pid {child.pid}) exited (killed by SIGKILL) (step 2, update)")
        child.wait()
        assert W.process_state(child.pid) == "gone"
        wd.left = True  # this rank finished or raises: a peer exiting is expected
        wd._check()
        assert len(stops) == 2
    finally:
        child.kill()
        child.wait()


def test_collective_timeout_key():
    from paddle_rl.config import ConfigError, load_config
    base = ["actor_model_name_or_path=model", "train_datasets=train.jsonl"]
    assert load_config(None, base).collective_timeout == 1800.0
    assert load_config(None, base + ["ddp_timeout=60"]).collective_timeout == 60.0  # the Hugging Face name
    with pytest.raises(ConfigError, match=r"collective_timeout: must be > 0 seconds, got 0"):
        load_config(None, base + ["collective_timeout=0"])


WATCHED = """
import os, socket, sys, time
from paddle_rl.parallel import watchdog as W
W.PEER_EXIT_GRACE = float(sys.argv[2])
wd = W.Watchdog(0, [(socket.gethostname(), os.getpid(), 0), (socket.gethostname(), int(sys.argv[1]), 0)], 60, 0.1)
W._WATCHDOG = wd
wd.start()
W.note("step 2, rollout")
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("how", ["peer-gone", "sigterm"])
def test_watchdog_stops_a_rank_whose_peer_is_gone_or_on_sigterm(how):
    """A rank not inside any collective: its peer's exit stops it after PEER_EXIT_GRACE (exit status 1), and SIGTERM
    (what paddle.distributed.launch sends once a rank failed) prints the peers' state and exits 143."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    proc = subprocess.Popen([sys.executable, "-c", WATCHED, str(gone.pid), "0.3" if how == "peer-gone" else "60"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    if how == "peer-gone":
        assert proc.returncode == 1, err
        assert (f"paddle_rl watchdog: rank 0 stops: rank 1 (pid {gone.pid}) is gone (step 2, rollout). Peers: rank 1 "
                f"(pid {gone.pid}): gone. Exit status 1.") in err
    else:
        assert proc.returncode == 143, err
        assert (f"paddle_rl watchdog: rank 0 stops: terminated by SIGTERM (step 2, rollout); paddle.distributed.launch "
                f"sends it to every rank once one has failed. Peers: rank 1 (pid {gone.pid}): gone. Exit status "
                f"143.") in err


# --------------------------------------------------------------------------------------------- cases
# (layout, stage, dying rank, launcher). Rank 0 hosts the rendezvous store and writes the model, so it dies too.
DEFAULT = [("dp2", "rollout", 1, "launch"), ("tp2", "update", 1, "paddle-rl"), ("dp2", "save", 0, "paddle-rl")]
SLOW = [(layout, stage, rank, launcher) for layout in LAYOUTS for stage, rank in
        (("rollout", 1), ("update", 1), ("save", 0)) for launcher in ("launch", "paddle-rl")]
SLOW = [case for case in SLOW if case not in DEFAULT]


def _case_id(case):
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", DEFAULT + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW], ids=_case_id)
def test_killed_rank_stops_the_run(micro, plugin, tmp_path, run_marker, case):
    """SIGKILL one rank at step 2 (its rollout, its update after the first backward, or its part of
    checkpoint-2): the command exits non-zero well within 120 s, the other rank's log names the dead rank, no
    process is left, and checkpoint-1 is complete."""
    layout, stage, dead, launcher = case
    code, start, end, output, logs = launch(launcher, micro, plugin, tmp_path, run_marker,
                                            {"PADDLE_RL_TEST_DIE": f"2:{stage}@{dead}"}, **LAYOUTS[layout])
    latency, message = check_ended(run_marker, code, end, output, logs, dead, "PADDLE_RL_TEST_DIE")
    print(f"{_case_id(case)}: exit {code}, {latency:.1f} s after the kill, {end - start:.1f} s in all: {message}")
    assert re.search(rf"rank {dead} \(pid \d+\):? (exited|is gone|gone)", message), message
    assert os.path.isfile(tmp_path / "run" / "checkpoint-1" / "trainer_state.json")
    assert not os.path.exists(tmp_path / "run" / "checkpoint-2")


@pytest.mark.parametrize("layout", ["dp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_stuck_rank_stops_the_run_after_collective_timeout(micro, plugin, tmp_path, run_marker, layout):
    """Rank 1 stops itself (SIGSTOP) in step 2's update: alive, it never joins the gradient sum. Rank 0 gives up
    after collective_timeout (10 s), naming the collective, the step and rank 1 as stopped; the launcher then
    kills the stopped rank, and nothing is left."""
    code, start, end, output, logs = launch("launch", micro, plugin, tmp_path, run_marker,
                                            {"PADDLE_RL_TEST_HANG": "2:update@1"}, collective_timeout=10,
                                            **LAYOUTS[layout])
    latency, message = check_ended(run_marker, code, end, output, logs, 1, "PADDLE_RL_TEST_HANG")
    print(f"stuck {layout}: exit {code}, {latency:.1f} s after SIGSTOP, {end - start:.1f} s in all: {message}")
    assert re.search(r"rank 0 stops: all_reduce.* over ranks \[0, 1\] has not returned after 1\d s "
                     r"\(collective_timeout: 10\) \(step 2, update\)", message), message
    assert re.search(r"rank 1 \(pid \d+\): stopped", message), message
    assert latency < 30, latency  # the key, not gloo's own 30 s limit


@pytest.mark.slow
def test_killed_launcher_stops_its_ranks(micro, plugin, tmp_path, run_marker):
    """paddle.distributed.launch itself killed with SIGKILL mid-run (its ranks live in sessions of their own and
    would train on): the ranks see their parent gone and stop, naming the launcher."""
    proc = start_run("launch", micro, plugin, tmp_path, run_marker, {}, max_steps=40, save_steps=100,
                     data_parallel_degree=2)
    log0 = tmp_path / "log" / "workerlog.0"
    assert _wait_for(lambda: log0.exists() and "step 2/40" in log0.read_text(errors="replace"), 120)
    assert len(marked_pids(run_marker)) == 3
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.time()
    proc.communicate()
    assert _wait_for(lambda: not marked_pids(run_marker), 30), marked_pids(run_marker)
    print(f"ranks gone {time.time() - killed:.1f} s after the launcher's SIGKILL")
    logs = [(tmp_path / "log" / f"workerlog.{rank}").read_text(errors="replace") for rank in (0, 1)]
    # each rank stops because its launcher is gone, or (the slower one) because its peer did so first
    assert all("paddle_rl watchdog: rank" in log for log in logs), logs
    assert any(re.search(rf"paddle_rl watchdog: rank \d stops: its launcher \(paddle.distributed.launch, pid "
                         rf"{proc.pid}\) is gone", log) for log in logs), logs

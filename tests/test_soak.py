"""The soak (`paddle-rl bench --soak`, paddle_rl/soak.py): its checker on real processes, ports and files (default
suite), and a 2-minute soak asserting every invariant (`slow`)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from micro_model import micro_overrides
from paddle_rl import soak
from paddle_rl.config import load_config

ROLLOUT_N, PROMPTS = 8, 8


def _row(step, drawn=PROMPTS, trained=PROMPTS, skipped=0, unselected=0, partial=0, **extra):
    return {"step": step, "batch/groups_drawn": drawn, "batch/groups_trained": trained,
            "batch/groups_dropped_reward_skipped": skipped, "batch/groups_dropped_unselected": unselected,
            "batch/partial_groups": partial, **extra}


def test_check_run_accounts_every_group_and_step():
    good = [{"step": 0, "eval/accuracy": 0.3}] + [_row(s) for s in range(1, 6)]
    good[3] = _row(3, trained=5, skipped=3)   # a reward-server outage dropped three groups
    good[4] = _row(4, trained=0, skipped=PROMPTS, **{"actor/skipped_update": 1.0})
    result = soak.check_run(good, ROLLOUT_N, PROMPTS)
    assert result["problems"] == []
    assert result["steps"] == 5 and result["steps_without_update"] == [4]
    assert result["groups"] == {"drawn": 40, "trained": 29, "dropped_reward_skipped": 11, "dropped_unselected": 0}

    # each broken invariant is named with its step
    repeated = good[:4] + [_row(3)] + good[4:]
    assert "repeated [3]" in soak.check_run(repeated, ROLLOUT_N, PROMPTS)["problems"][0]
    missing = good[:3] + good[4:]
    assert "missing [3]" in soak.check_run(missing, ROLLOUT_N, PROMPTS)["problems"][0]
    lost = good[:2] + [_row(2, trained=6)] + good[3:]   # two groups neither trained nor counted as dropped
    assert soak.check_run(lost, ROLLOUT_N, PROMPTS)["problems"] == [
        "step 2: 8 groups drawn but 6 trained + 0 dropped (reward skipped) + 0 dropped (unselected) = 6"]
    partial = good[:2] + [_row(2, partial=1)] + good[3:]
    assert soak.check_run(partial, ROLLOUT_N, PROMPTS)["problems"] == [
        "step 2: trained on 1 partial group(s) (fewer than 8 samples)"]
    # a run whose step records do not say where the groups went cannot pass
    bare = [{"step": s, "reward/mean": 0.1} for s in range(1, 4)]
    problems = soak.check_run(bare, ROLLOUT_N, PROMPTS)["problems"]
    assert len(problems) == 3 and problems[0].startswith("step 1: no batch/groups_drawn")


def test_rss_growth_bound():
    flat = [(t, 1000.0 + (t % 3)) for t in range(40)]
    assert soak.rss_growth(flat)["within_bound"]
    assert soak.rss_growth(flat)["start_mb"] == 1002.0
    leaking = [(t, 1000.0 + 5.0 * t) for t in range(40)]   # 5 MiB a sample: 150 MiB past the first quarter
    growth = soak.rss_growth(leaking)
    assert not growth["within_bound"] and growth["end_mb"] == 1195.0 and growth["bound_mb"] == 1149.5


def test_fault_plan_is_seeded_and_covers_every_kind():
    plan = soak.plan_faults(3, 600.0, 30.0, 300.0)
    assert plan == soak.plan_faults(3, 600.0, 30.0, 300.0)
    assert plan != soak.plan_faults(4, 600.0, 30.0, 300.0)
    kinds = [e["kind"] for e in plan]
    assert kinds.count("trainer") == 1 and set(kinds) == set(soak.KINDS) | {"trainer"}
    assert all(plan[i]["at"] <= plan[i + 1]["at"] for i in range(len(plan) - 1))
    assert 10 <= len(plan) <= 40
    # the kinds come in turns: no kind twice before every other one came
    rounds = [e["kind"] for e in plan if e["kind"] != "trainer"]
    for start in range(0, len(rounds) - 2, 3):
        assert sorted(rounds[start:start + 3]) == sorted(soak.KINDS)


def test_leftovers_finds_processes_ports_and_files(tmp_path):
    """Real processes: a leader in its own session whose child outlives it, a bound port, a file in the TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    leader = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; exec sleep 60"], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
    child = int(leader.stdout.readline())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    (tmp / "pymp-left").mkdir()
    try:
        leader.kill()        # the leader alone: its child is left, found by its session
        leader.wait()
        left = soak.leftovers([leader.pid], [port], str(tmp))
        assert [p["pid"] for p in left["processes"]] == [child] and "sleep 60" in left["processes"][0]["cmd"]
        assert left["ports_busy"] == [port] and left["tmp_entries"] == ["pymp-left"]
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        listener.close()
    (tmp / "pymp-left").rmdir()
    deadline = time.monotonic() + 5
    while soak.session_members({leader.pid}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert soak.leftovers([leader.pid], [port], str(tmp)) == {"processes": [], "ports_busy": [], "tmp_entries": []}


FAILING_PLUGIN = """
import os, zlib

def half_fail(prompts, completions, **kwargs):
    # the reward server cannot score the samples of every other prompt (by its text's CRC): a request holding one
    # fails, and the trainer skips its samples
    for prompt in prompts:
        if zlib.crc32(prompt.encode()) % 2:
            with open(os.environ["FAILED_PROMPTS"], "a") as f:
                f.write(prompt.replace("\\n", " ") + "\\n")
            raise RuntimeError("cannot score this prompt")
    return [1.0 if len(c) % 2 else 0.0 for c in completions]
"""


def test_step_record_accounts_groups_dropped_by_the_reward_server(micro, tmp_path):
    """A real reward server that fails the requests of some prompts, reward_server_on_failure skip: each step's
    record says how many prompt groups it drew, trained and dropped (the reward server could not score them), and
    the dropped ones are exactly the prompts the server failed."""
    plugin = tmp_path / "half_fail.py"
    plugin.write_text(FAILING_PLUGIN)
    failed = tmp_path / "failed.txt"
    port = soak.free_port()
    server = subprocess.Popen([sys.executable, "-m", "paddle_rl", "reward-server", "--port", str(port), "--plugin",
                               str(plugin), "--reward", "half_fail", "--workers", "1", "--log-level", "warning"],
                              env={**os.environ, "FAILED_PROMPTS": str(failed)}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the reward server did not start"
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        from paddle_rl.trainer import RLTrainer
        out = tmp_path / "run"
        # one request per prompt group (per_device_reward_batch_size = rollout_n), not retried
        trainer = RLTrainer(load_config(None, micro_overrides(
            micro, str(out), do_eval=False, max_steps=3, save_steps=1000, use_rm_server=True, reward_server=url,
            reward_server_on_failure="skip", reward_server_retries=0, per_device_reward_batch_size=4)))
        trainer.train()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    dropped = [int(r["batch/groups_dropped_reward_skipped"]) for r in rows]
    failed_prompts = set(failed.read_text().splitlines())
    assert sum(dropped) == len(failed_prompts) > 0
    for r, d in zip(rows, dropped):
        assert (r["batch/groups_drawn"], r["batch/groups_trained"], r["batch/groups_dropped_unselected"],
                r["batch/partial_groups"]) == (4, 4 - d, 0, 0)
        assert r["reward/skipped"] == 4 * d
    assert soak.check_run(rows, 4, 4)["problems"] == []


@pytest.mark.slow
def test_two_minute_soak_loses_nothing(tmp_path):
    """`paddle-rl bench --soak 2`: every fault kind at least once, the trainer killed and resumed, every invariant."""
    proc = subprocess.run([sys.executable, "-m", "paddle_rl", "bench", "--soak", "2", "--seed", "5",
                           "--soak-interval", "12"], capture_output=True, text=True, timeout=1800,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    work_removed = result.get("work_removed") is True
    shutil.rmtree(result["work"], ignore_errors=True)   # a failed soak keeps its folder: not left by the suite
    assert not result["problems"], output
    assert result["faults"]["trainer"] == 1
    assert all(result["faults"].get(kind, 0) >= 1 for kind in soak.KINDS), result["faults"]
    assert result["partial_groups"] == 0
    groups = result["groups"]
    assert groups["drawn"] == result["steps"] * PROMPTS
    assert groups["trained"] + groups["dropped_reward_skipped"] + groups["dropped_unselected"] == groups["drawn"]
    assert all(life["within_bound"] for life in result["rss_mb"])
    assert result["leftovers"]["processes"] == [] and result["leftovers"]["ports_busy"] == []
    assert proc.returncode == 0 and result["ok"] and work_removed, output
    assert result["leftovers"]["tmp_entries"] == []

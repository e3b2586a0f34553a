"""The sandbox and the `code` rule: hostile programs are contained and scored 0 with their reason, nothing of them
is left running, and the test layouts of public code-RL data score right."""
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from paddle_rl.rewards import RewardSample, RuleReward
from paddle_rl.rewards.code import extract_program, parse_tests, score_program
from paddle_rl.rewards.sandbox import SandboxLimits, isolation, run_program

LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=3, memory_mb=512, output_mb=1, processes=16)
pytestmark = pytest.mark.skipif(isolation() is None, reason="no network namespace can be made here (unshare)")


def _sandbox_processes():
    """pids of processes still running a sandboxed program (its interpreter on main.py in a sandbox folder)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"main.py" in cmd and state != "Z":
            out.append(int(pid))
    return out


def _nothing_left():
    deadline = time.time() + 5
    while _sandbox_processes() and time.time() < deadline:
        time.sleep(0.1)
    return not _sandbox_processes()


HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "sleep past the wall clock": ("import time\ntime.sleep(60)\n", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timeout"),
    "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", "memory"),
    "1 GB of output": ("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n", "output_too_large"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(name):
    code, status = HOSTILE[name]
    start = time.time()
    result = run_program(code, "", LIMITS)
    assert result.status == status, (result.status, result.stderr[-300:])
    assert time.time() - start < LIMITS.wall_seconds + 5
    assert _nothing_left()


@pytest.mark.skipif(isolation() is not None and "--setuid" not in isolation()[0],
                    reason="programs run as this user (not root: no switch to nobody), who owns tmp_path")
def test_write_outside_the_folder_fails(tmp_path):
    target = tmp_path / "owned.txt"
    result = run_program(f"open({str(target)!r}, 'w').write('x')\n", "", LIMITS)
    assert result.status == "runtime_error" and "PermissionError" in result.stderr and not target.exists()
    # its own folder is writable
    assert run_program("open('mine.txt', 'w').write('x')\nprint(open('mine.txt').read())\n", "", LIMITS).stdout == "x\n"


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("PADDLE_RL_TEST_SECRET", "hunter2")
    code = ("import os, glob\nseen = [k for k in os.environ]\nfor p in glob.glob('/proc/*/environ'):\n"
            "    try:\n        seen.append(open(p, 'rb').read().decode(errors='replace'))\n"
            "    except OSError:\n        pass\nprint('\\n'.join(seen))\n")
    result = run_program(code, "", LIMITS)
    assert result.status == "ok" and "hunter2" not in result.stdout and "PADDLE_RL_TEST_SECRET" not in result.stdout


def test_no_connection_reaches_localhost():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(3)
    port = listener.getsockname()[1]
    got = []
    thread = threading.Thread(target=lambda: got.append(_accept(listener)))
    thread.start()
    result = run_program(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                         "s.sendall(b'leak')\n", "", LIMITS)
    thread.join()
    listener.close()
    assert result.status == "runtime_error" and got == [None]


def _accept(listener):
    try:
        conn, _ = listener.accept()
        return conn.recv(16)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- the rule

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
PRIME_STDIO = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]})
PRIME_CALL = json.dumps({"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [4]]})


def test_layouts_score_the_fraction_passed():
    assert extract_program("<think>x</think>\n" + ADD) == "a, b = map(int, input().split())\nprint(a + b)\n"
    assert score_program(ADD, PRIME_STDIO, LIMITS, False)[0] == 1.0
    wrong = ADD.replace("a + b", "a * b")  # right on 0 0 only... and 2 2 style inputs: here 1 of 3
    score, outcomes = score_program(wrong, PRIME_STDIO, LIMITS, False)
    assert score == pytest.approx(1 / 3) and outcomes == {"pass": 1, "wrong_answer": 2}
    assert score_program(wrong, PRIME_STDIO, LIMITS, True)[0] == 0.0
    add_fn = "```python\ndef add(a, b):\n    return a + b\n```"
    assert score_program(add_fn, PRIME_CALL, LIMITS, False)[0] == 1.0
    asserts = {"test_cases": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert score_program(add_fn, asserts, LIMITS, False)[0] == 0.5
    humaneval = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}
    assert score_program(add_fn, humaneval, LIMITS, False)[0] == 1.0
    assert score_program("```python\ndef add(a, b:\n```", humaneval, LIMITS, False)[1] == {"syntax_error": 1}
    with pytest.raises(ValueError, match="no tests"):
        parse_tests({"question": "x"})


def test_code_rule_through_the_reward_with_hostile_responses():
    """A batch with hostile programs: each scores 0, the others are scored, and the process goes on."""
    from paddle_rl.config import RLConfig
    config = RLConfig(reward_funcs=["code"], sandbox_timeout=3, sandbox_memory_mb=512)
    reward = RuleReward(["code"], None, config)
    record = {"data_source": "codecontests", "reward_model": {"ground_truth": PRIME_STDIO}}
    responses = [ADD, "```python\nwhile True:\n    pass\n```", "```python\nx = bytearray(10 * 1024 ** 3)\n```", ADD]
    result = reward([RewardSample("p", r, record) for r in responses])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0, 0.0, 1.0])
    assert result.correct.tolist() == [True, False, False, True]
    metrics = result.metrics("reward")  # every test run's outcome, counted over the batch (3 tests per sample)
    assert (metrics["reward/code/pass"], metrics["reward/code/timeout"], metrics["reward/code/memory"]) == (6, 3, 3)
    assert metrics["reward/code/wrong_answer"] == 0 and metrics["reward/code/syntax_error"] == 0
    assert _nothing_left()


# ---------------------------------------------------------------------------------------------- the reward server

def _program_sample(code: str, k: int = 0):
    """A v1 sample whose program must echo its own number k (so a mixed-up answer is caught)."""
    truth = json.dumps({"inputs": [f"{k}\n"], "outputs": [f"{k}\n"]})
    return {"response": f"```python\n{code}\n```", "record": {"reward_model": {"ground_truth": truth}}}


@pytest.fixture(scope="module")
def code_server():
    from test_reward_server import Server
    server = Server("--reward", "code", "--workers", "2", "--sample-timeout", "60", "--set", "sandbox_timeout=3",
                    "--set", "sandbox_memory_mb=512")
    try:
        yield server.wait()
    finally:
        server.stop()


def test_reward_server_survives_hostile_programs(code_server):
    from test_reward_server import post
    hostile = [HOSTILE[name][0] for name in ("infinite loop", "fork bomb", "10 GB allocation", "1 GB of output")]
    samples = [_program_sample(code) for code in hostile] + [_program_sample("print(input())")]
    r = post(code_server.url + "/v1/score", {"samples": samples})
    assert r.status_code == 200, r.text
    assert r.json()["score"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    # still serving, and nothing of the programs is left
    r = post(code_server.url + "/v1/score", {"samples": [_program_sample("print(input())", 7)]})
    assert r.status_code == 200 and r.json()["score"] == [1.0]
    assert code_server.proc.poll() is None and _nothing_left()


def test_reward_server_500_programs_from_16_clients(code_server):
    """500 programs, each echoing its own number, from 16 concurrent clients: none lost or mixed up."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    url = code_server.url + "/v1/score"
    with httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=16)) as client:
        def call(k):
            code = "print(input())" if k % 5 else "print(int(input()) + 1)"  # every fifth is wrong on purpose
            r = client.post(url, json={"samples": [_program_sample(code, k)]})
            return k, r.status_code, r.json()["score"][0]
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(call, range(500)))
        elapsed = time.monotonic() - start
    assert sorted(k for k, _, _ in results) == list(range(500))
    for k, status, score in results:
        assert status == 200 and score == (0.0 if k % 5 == 0 else 1.0), (k, status, score)
    print(f"500 programs in {elapsed:.1f} s: {500 / elapsed:.1f} programs/s")


def test_converted_records_score_with_the_code_rule():
    """APPS (stdin/stdout and call-based) and AceCoder records through `paddle-rl data convert`'s converter: the
    verl layout's ground truth is what the code rule runs."""
    from paddle_rl.config import RLConfig
    from paddle_rl.data.convert import ConvertError, convert_records
    raw = [("apps.jsonl:1", {"question": "Add two numbers.", "difficulty": "introductory",
                             "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}),
           ("apps.jsonl:2", {"question": "Write add(a, b).",
                             "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})}),
           ("apps.jsonl:3", {"question": "No tests here.", "input_output": ""})]
    out, skipped, source = convert_records(raw, layout="verl")
    assert source == "apps" and skipped == ["apps.jsonl:3"] and [r["ability"] for r in out] == ["code", "code"]
    assert "```python" in out[0]["prompt"][0]["content"]  # the system prompt asks for a code block
    ace, _, ace_source = convert_records([("ace.jsonl:1", {"question": "Write add.", "test_cases": [
        "assert add(1, 2) == 3", "assert add(0, 0) == 0"]})], layout="verl")
    assert ace_source == "acecoder"
    reward = RuleReward(["code"], None, RLConfig(reward_funcs=["code"], sandbox_timeout=3))
    add_fn = "<think>easy</think> <answer>```python\ndef add(a, b):\n    return a + b\n```</answer>"
    responses = [ADD, add_fn, add_fn]
    records = out + ace
    result = reward([RewardSample("p", r, rec) for r, rec in zip(responses, records)])
    np.testing.assert_array_equal(result.scores, [1.0, 1.0, 1.0])
    with pytest.raises(ConvertError, match="2 inputs but 1 outputs"):
        convert_records([("x:1", {"question": "q", "input_output": json.dumps({"inputs": [1, 2], "outputs": [1]})})])


def test_without_a_network_namespace_it_refuses_unless_allowed(monkeypatch, caplog):
    """Where unshare cannot make a network namespace, code does not run; sandbox_allow_network runs it, loudly."""
    import logging

    from paddle_rl.rewards import sandbox
    monkeypatch.setattr(sandbox, "isolation", lambda: None)
    with pytest.raises(sandbox.SandboxError, match="sandbox_allow_network: true"):
        run_program("print(1)", "", LIMITS)
    allowed = SandboxLimits(wall_seconds=4, cpu_seconds=3, memory_mb=512, allow_network=True)
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        result = run_program("print(1)", "", allowed)
    assert result.status == "ok" and result.stdout == "1\n" and "NO network isolation" in caplog.text

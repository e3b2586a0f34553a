"""The sandbox and the `code` rule, against hostile programs: each is contained and scored 0 with its reason, the
reward pays only for tests the harness saw pass, and nothing of a program is left afterwards (no process, file,
shared-memory segment or cgroup), as root and as an ordinary user, in-process and through the reward server."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from paddle_rl.rewards import RewardSample, RuleReward
from paddle_rl.rewards import sandbox
from paddle_rl.rewards.code import extract_program, parse_tests, run_test, score_program
from paddle_rl.rewards.sandbox import SandboxError, SandboxLimits, isolation, isolation_problem, run_program

LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=3, memory_mb=512, output_mb=1, processes=16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# .ci/run sets this: where isolation is expected, its absence fails the suite instead of skipping it
REQUIRED = os.environ.get("PADDLE_RL_REQUIRE_SANDBOX") == "1"
isolated = pytest.mark.skipif(isolation() is None and not REQUIRED,
                              reason=f"programs cannot be isolated here: {isolation_problem()}")


@pytest.fixture(autouse=True)
def _isolation_required_in_ci(request):
    if REQUIRED and request.node.get_closest_marker("skipif") is not None:
        assert isolation() is not None, isolation_problem()


def _pid_namespace(pid) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def sandbox_processes(programs_only=False):
    """Processes of any sandbox: in a PID namespace other than this process's (each sandbox makes its own), or
    bwrap itself (not with `programs_only`). Found by namespace, not by name: a program that execs another binary
    is still seen."""
    own = _pid_namespace("self")
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
            state = rest.split()[0]
        except OSError:
            continue
        ns = _pid_namespace(pid)
        if state != "Z" and ((ns and ns != own and not name.endswith("(bwrap"))
                             or (name.endswith("(bwrap") and not programs_only)):
            found.append(int(pid))
    return found


# the names the hostile programs below write: /tmp, /var/tmp and /dev/shm are shared with the rest of the machine
# (an asynchronous rollout worker keeps its weights in /dev/shm), so only these names are watched there
WRITTEN = ("paddle_rl_left_behind", "x", "big", "mine.txt")


def host_traces():
    """What a program could leave on the host: its files in /tmp, /var/tmp, /dev/shm, System V segments, our
    cgroups."""
    files = {os.path.join(folder, name) for folder in ("/tmp", "/var/tmp", "/dev/shm") for name in WRITTEN
             if os.path.lexists(os.path.join(folder, name))}
    try:
        with open("/proc/sysvipc/shm") as f:
            segments = len(f.readlines())
    except OSError:
        segments = 0
    cgroups = set()
    for parents in sandbox._Cgroup._parents().values():
        for parent in parents.values():
            try:
                cgroups.update(n for n in os.listdir(parent) if n.startswith(sandbox.CGROUP_PREFIX))
            except OSError:
                pass
    return files, segments, cgroups


def nothing_left(before, timeout=10.0):
    """No sandbox process, and the host's traces as `before`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not sandbox_processes() and host_traces() == before:
            return True
        time.sleep(0.1)
    print("left:", sandbox_processes(), host_traces(), before)
    return False


@pytest.fixture
def clean_host():
    """Asserts the test leaves no process or trace of a sandbox behind."""
    before = host_traces()
    yield
    assert nothing_left(before)


# a hostile program, the status its run must end with, and the limits it runs under
MB = 1 << 20
HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "sleep past the wall clock": ("import time\ntime.sleep(60)\n", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timeout"),
    "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", "memory"),
    "10 GB over many processes": (textwrap.dedent("""\
        import os, time
        for _ in range(64):
            try:
                child = os.fork()
            except OSError:
                break
            if child == 0:
                try:
                    x = bytearray(160 * 1024 ** 2)
                    for i in range(0, len(x), 4096):
                        x[i] = 1
                except MemoryError:
                    pass
                time.sleep(30)
                os._exit(0)
        time.sleep(30)
        """), "memory"),
    "1 GB of output": ("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n", "output_too_large"),
    "a file in every writable place": (textwrap.dedent("""\
        import os
        for folder in ("/tmp", "/var/tmp", "/dev/shm", ".", os.path.expanduser("~")):
            try:
                with open(os.path.join(folder, "paddle_rl_left_behind"), "w") as f:
                    f.write("x")
            except OSError:
                pass
        os.execv("/bin/sleep", ["sleep", "60"])
        """), "timeout"),
    "2 GB file in /dev/shm": ("f = open('/dev/shm/big', 'wb')\nfor _ in range(2048):\n    f.write(b'x' * 1024 ** 2)\n",
                              "output_too_large"),
}


@isolated
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(name, clean_host):
    code, status = HOSTILE[name]
    start = time.time()
    result = run_program(code, "", LIMITS)
    assert result.status == status, (result.status, result.stderr[-300:])
    assert time.time() - start < LIMITS.wall_seconds + 5


@isolated
def test_all_processes_together_stay_under_the_memory_bound(clean_host):
    """Four children of 100 MB each under a 128 MB bound: the run is stopped before they hold 4 x 100 MB."""
    code = textwrap.dedent("""\
        import os, sys, time
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                x = bytearray(100 * 1024 ** 2)
                for i in range(0, len(x), 4096):
                    x[i] = 1
                time.sleep(5)
                os._exit(0)
            kids.append(pid)
        if all(os.waitpid(pid, 0)[1] == 0 for pid in kids):
            print("all four held 100 MB")
        """)
    result = run_program(code, "", SandboxLimits(wall_seconds=8, cpu_seconds=8, memory_mb=128, processes=16))
    assert result.status == "memory" and "all four" not in result.stdout, (result.status, result.stdout)


@isolated
def test_the_program_sees_nothing_of_the_host(tmp_path, monkeypatch, clean_host):
    """The repository, a checkpoint-like file, /etc/passwd, the parent's environment, a Unix socket on the file
    system, a listener on 127.0.0.1: none is reachable; its own folder and /tmp are writable and private."""
    monkeypatch.setenv("PADDLE_RL_TEST_SECRET", "hunter2")
    checkpoint = tmp_path / "model_state.pdparams"
    checkpoint.write_bytes(b"weights")
    os.chmod(tmp_path, 0o755)
    sock_path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(sock_path)
    unix.listen(1)
    os.chmod(sock_path, 0o777)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    port = tcp.getsockname()[1]
    code = textwrap.dedent(f"""\
        import glob, json, os, socket
        seen = {{}}
        for path in ({os.path.join(ROOT, "README.md")!r}, {str(checkpoint)!r}, "/etc/passwd", "/etc/shadow"):
            try:
                seen[path] = open(path, "rb").read(16).decode(errors="replace")
            except OSError as e:
                seen[path] = None
        env = list(os.environ) + [open(p, "rb").read().decode(errors="replace") for p in glob.glob("/proc/*/environ")
                                  if os.access(p, os.R_OK)]
        for what, family, address in (("unix", socket.AF_UNIX, {sock_path!r}), ("tcp", socket.AF_INET,
                                                                                 ("127.0.0.1", {port}))):
            s = socket.socket(family)
            s.settimeout(2)
            try:
                s.connect(address)
                seen[what] = "connected"
            except OSError as e:
                seen[what] = None
        open("mine.txt", "w").write("x")
        open("/tmp/mine.txt", "w").write("y")
        seen["own"] = open("mine.txt").read() + open("/tmp/mine.txt").read()
        seen["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print(json.dumps({{"seen": seen, "env": env}}))
        """)
    try:
        result = run_program(code, "", LIMITS)
    finally:
        unix.close()
        tcp.close()
    assert result.status == "ok", result.stderr[-500:]
    out = json.loads(result.stdout)
    seen = out["seen"]
    assert seen[os.path.join(ROOT, "README.md")] is None and seen[str(checkpoint)] is None
    assert seen["/etc/passwd"] is None and seen["/etc/shadow"] is None
    assert seen["unix"] is None and seen["tcp"] is None
    assert seen["own"] == "xy" and max(seen["processes"]) <= 3  # bwrap's init, the program, and nothing else
    assert not any("hunter2" in e or "PADDLE_RL_TEST_SECRET" in e for e in out["env"])


@isolated
def test_the_program_runs_as_nobody_without_capabilities(clean_host):
    code = ("import os\nstatus = open('/proc/self/status').read()\n"
            "print(os.getuid(), os.getgid(), status.split('CapEff:')[1].split()[0], "
            "status.split('NoNewPrivs:')[1].split()[0])\n")
    result = run_program(code, "", LIMITS)
    assert result.status == "ok" and result.stdout.split() == ["65534", "65534", "0000000000000000", "1"], result


# ---------------------------------------------------------------------------------------------- reward hacking

WRONG_ADD = "```python\ndef add(a, b):\n    return a - b\n```"    # wrong: every test must fail
ASSERTS = {"test_cases": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
HUMANEVAL = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert abs(candidate(1.5, 1) - 2.5) < 1e-9\n",
             "entry_point": "add"}
CALL = {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [4]]}
LYING = "class Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
HACKS = {
    "sys.exit(0) after the definitions": WRONG_ADD.replace("\n```", "\nimport sys\nsys.exit(0)\n```"),
    "os._exit(0) after the definitions": WRONG_ADD.replace("\n```", "\nimport os\nos._exit(0)\n```"),
    "raise SystemExit(0)": WRONG_ADD.replace("\n```", "\nraise SystemExit(0)\n```"),
    "SystemExit inside the function": "```python\nimport sys\ndef add(a, b):\n    sys.exit(0)\n```",
    "SIGKILL of itself": "```python\nimport os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n```",
    "an __eq__ that is always True": "```python\n" + LYING + "def add(a, b):\n    return Yes(0)\n```",
    "a __bool__ and __sub__ that lie": ("```python\nclass Liar:\n    def __eq__(self, o):\n        return True\n"
                                       "    def __sub__(self, o):\n        return 0\n    def __bool__(self):\n"
                                       "        return True\ndef add(a, b):\n    return Liar()\n```"),
    "patched exec and json": ("```python\nimport builtins, json\nbuiltins.exec = lambda *a, **k: None\n"
                              "json.dumps = lambda *a, **k: '[3]'\ndef add(a, b):\n    return a - b\n```"),
    "patched builtins": ("```python\nimport builtins\nbuiltins.abs = lambda x: 0\nbuiltins.all = lambda x: True\n"
                         "builtins.AssertionError = KeyboardInterrupt\ndef add(a, b):\n    return a - b\n```"),
}


@isolated
@pytest.mark.parametrize("layout", ["asserts", "humaneval", "call"])
@pytest.mark.parametrize("name", sorted(HACKS))
def test_a_hack_never_passes_a_test(name, layout):
    truth = {"asserts": ASSERTS, "humaneval": HUMANEVAL, "call": CALL}[layout]
    score, outcomes = score_program(HACKS[name], truth, LIMITS, False)
    assert score == 0.0 and "pass" not in outcomes, outcomes


@isolated
def test_hacks_are_told_apart_in_the_outcomes():
    test = ("assert", "assert add(1, 2) == 3", None)
    program = extract_program
    assert run_test(program(HACKS["sys.exit(0) after the definitions"]), test, LIMITS) == "early_exit"
    assert run_test(program(HACKS["os._exit(0) after the definitions"]), test, LIMITS) == "early_exit"
    assert run_test(program(HACKS["an __eq__ that is always True"]), test, LIMITS) == "bad_type"
    right = "def add(a, b):\n    return a + b\n"
    assert run_test(right, test, LIMITS) == "pass"
    # builtins patched by the program are not the test's
    everything = ("assert", "assert all(add(a, b) == a + b for a, b in [(1, 2), (2, 2)])", None)
    assert run_test(program(HACKS["patched builtins"]), everything, LIMITS) == "wrong_answer"
    # a right program may still end itself on stdin / stdout tests: only its output counts there
    assert run_test("print(sum(map(int, input().split())))\nimport sys\nsys.exit(0)\n", ("stdio", "1 2\n", "3\n"),
                    LIMITS) == "pass"
    # a test that compares a program's own class instance is refused (documented)
    point = "class P:\n    def __init__(self, x):\n        self.x = x\n"
    assert run_test(point, ("assert", "assert P(1).x == 1", None), LIMITS) == "pass"
    assert run_test(point, ("assert", "assert P(1) != None", None), LIMITS) == "bad_type"


# ---------------------------------------------------------------------------------------------- the rule

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
PRIME_STDIO = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]})
PRIME_CALL = json.dumps({"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [4]]})


@isolated
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


@isolated
def test_code_rule_through_the_reward_with_hostile_responses(clean_host):
    """A batch with hostile programs: each scores 0, the others are scored, and the process goes on."""
    from paddle_rl.config import config_from_values
    config = config_from_values(dict(reward_funcs=["code"], sandbox_timeout=3, sandbox_memory_mb=512))
    reward = RuleReward(["code"], None, config)
    record = {"data_source": "codecontests", "reward_model": {"ground_truth": PRIME_STDIO}}
    responses = [ADD, "```python\nwhile True:\n    pass\n```", "```python\nx = bytearray(10 * 1024 ** 3)\n```", ADD]
    result = reward([RewardSample("p", r, record) for r in responses])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0, 0.0, 1.0])
    assert result.correct.tolist() == [True, False, False, True]
    metrics = result.metrics("reward")  # every test run's outcome, counted over the batch (3 tests per sample)
    assert (metrics["reward/code/pass"], metrics["reward/code/timeout"], metrics["reward/code/memory"]) == (6, 3, 3)
    assert metrics["reward/code/wrong_answer"] == 0 and metrics["reward/code/syntax_error"] == 0


# ---------------------------------------------------------------------------------------------- the reward server

def _program_sample(code: str, k: int = 0):
    """A v1 sample whose program must echo its own number k (so a mixed-up answer is caught)."""
    truth = json.dumps({"inputs": [f"{k}\n"], "outputs": [f"{k}\n"]})
    return {"response": f"```python\n{code}\n```", "record": {"reward_model": {"ground_truth": truth}}}


@pytest.fixture(scope="module")
def code_server():
    """Workers that overrun 2 s are killed mid-program (sandbox_timeout 3 s): a program must die with its worker."""
    from test_reward_server import Server
    server = Server("--reward", "code", "--workers", "2", "--sample-timeout", "2", "--timeout-score", "0",
                    "--set", "sandbox_timeout=3",
                    "--set", "sandbox_memory_mb=512")
    try:
        yield server.wait()
    finally:
        server.stop()


@isolated
def test_reward_server_survives_hostile_programs(code_server):
    from test_reward_server import post
    before = host_traces()
    hostile = [HOSTILE[name][0] for name in ("infinite loop", "fork bomb", "10 GB allocation", "1 GB of output",
                                             "a file in every writable place")]
    samples = [_program_sample(code) for code in hostile] + [_program_sample("print(input())")]
    r = post(code_server.url + "/v1/score", {"samples": samples})
    assert r.status_code == 200, r.text
    assert r.json()["score"] == [0.0] * len(hostile) + [1.0]
    # still serving, and nothing of the programs is left (the killed workers' programs included)
    r = post(code_server.url + "/v1/score", {"samples": [_program_sample("print(input())", 7)]})
    assert r.status_code == 200 and r.json()["score"] == [1.0]
    assert code_server.proc.poll() is None and nothing_left(before)


@isolated
def test_reward_server_200_hostile_programs_from_16_clients(code_server):
    """200 samples from 16 concurrent clients, most of them hostile (early exits, an exec of another binary, a
    lying __eq__, a sleeper past the worker's time limit, whose worker is killed, a child left behind by its parent,
    files in /tmp and /dev/shm), each right one echoing its own number: every score is right and nothing is left.
    The sleeper comes once in 24 samples (9 workers killed; each holds one of the 2 workers for the 2-s limit), the
    others once in 8."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_reward_server import post
    before = host_traces()
    url = code_server.url + "/v1/score"
    kinds = ["print(input())",
             "import sys\nsys.exit(0)",
             "import os\nos._exit(0)",
             "import time\ntime.sleep(60)",
             "import os\nfor p in ('/tmp/x', '/dev/shm/x'):\n    open(p, 'w').write('x')\nif os.fork():\n    os._exit(0)\n"
             "import time\ntime.sleep(60)",
             "print(int(input()) + 1)",
             "class Y(str):\n    def __eq__(s, o):\n        return True\nprint(Y(''))",
             "import os\nos.execv('/bin/sh', ['sh', '-c', 'exit 0'])"]
    with httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=16)) as client:
        def kind(k):  # the sleeper (kinds[3]) in one sample of 24, the right program in its other two places
            return 0 if k % len(kinds) == 3 and k % 24 != 3 else k % len(kinds)

        def call(k):
            r = client.post(url, json={"samples": [_program_sample(kinds[kind(k)], k)]})
            return k, r.status_code, r.json()["score"][0]
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(call, range(200)))
        elapsed = time.monotonic() - start
    assert sorted(k for k, _, _ in results) == list(range(200))
    for k, status, score in results:
        assert status == 200 and score == (1.0 if kind(k) == 0 else 0.0), (k, kinds[kind(k)], score)
    # the next run sweeps the cgroups its killed predecessors could not remove
    assert post(url, {"samples": [_program_sample("print(input())", 9)]}).json()["score"] == [1.0]
    assert code_server.proc.poll() is None and nothing_left(before, timeout=20)
    print(f"200 programs in {elapsed:.1f} s")


@isolated
@pytest.mark.slow
def test_reward_server_500_programs_from_16_clients(code_server):
    """500 programs, each echoing its own number, from 16 concurrent clients: none lost or mixed up (the scale
    check; test_reward_server_200_hostile_programs_from_16_clients checks the same with hostile programs by
    default)."""
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


@isolated
def test_a_killed_caller_leaves_nothing(tmp_path):
    """SIGKILL of the process that runs a sandbox (a trainer, a reward-server worker): the program, its children
    and its files die with it; the cgroup the caller could not remove goes at the next start."""
    before = host_traces()
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {ROOT!r})
        from paddle_rl.rewards.sandbox import SandboxLimits, run_program
        print("start", flush=True)
        run_program("import os, time\\nos.fork()\\nopen('/dev/shm/x', 'wb').write(b'x' * 2 ** 20)\\n"
                    "print('running', flush=True)\\ntime.sleep(60)\\n", "",
                    SandboxLimits(wall_seconds=60, cpu_seconds=60))
        """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "start"
    deadline = time.time() + 20
    while len(sandbox_processes(programs_only=True)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(sandbox_processes(programs_only=True)) >= 2   # the program and its child are running
    caller.kill()
    caller.wait()
    deadline = time.time() + 10
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert not sandbox_processes()
    sandbox.isolation.cache_clear()   # the next start sweeps the dead caller's cgroup
    assert isolation() is not None
    assert nothing_left(before)


def _run_as_ordinary_user(code: str) -> dict:
    """Runs the sandbox module from a copy readable by everyone, as uid 65534 through setpriv, with the system's
    Python; `code` is the body of a function given `sandbox`, returning a JSON-able dict."""
    folder = tempfile.mkdtemp(prefix="paddle_rl_test_user_")
    try:
        os.chmod(folder, 0o755)
        for name in ("sandbox.py", "harness.py"):
            shutil.copy(os.path.join(os.path.dirname(sandbox.__file__), name), folder)
        with open(os.path.join(folder, "drive.py"), "w") as f:
            f.write("import json, sys\nsys.path.insert(0, %r)\nimport sandbox\n" % folder
                    + "def body(sandbox):\n" + textwrap.indent(code, "    ") + "\nprint(json.dumps(body(sandbox)))\n")
        for name in os.listdir(folder):
            os.chmod(os.path.join(folder, name), 0o644)
        done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3",
                               "-I", os.path.join(folder, "drive.py")], capture_output=True, text=True, timeout=300,
                              cwd="/")
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@isolated
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isfile("/usr/bin/python3") or shutil.which("setpriv") is None,
                    reason="needs root (to become an ordinary user with setpriv) and /usr/bin/python3")
def test_an_ordinary_user_gets_the_same_isolation(tmp_path, clean_host):
    """As uid 65534 (no cgroup: the memory watchdog applies), the hostile programs are contained as for root."""
    secret = tmp_path / "secret"
    secret.write_text("s")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)   # readable by everyone on the host: the sandbox still hides it
    cases = {name: HOSTILE[name] for name in ("fork bomb", "10 GB over many processes", "a file in every writable place",
                                             "2 GB file in /dev/shm", "sleep past the wall clock")}
    cases["host file"] = (f"print(open({str(secret)!r}).read())", "runtime_error")
    cases["four children of 100 MB under 128 MB"] = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
                                                     "        x = bytearray(100 * 1024 ** 2)\n        time.sleep(5)\n"
                                                     "        os._exit(0)\ntime.sleep(5)\n", "memory")
    body = ("iso = sandbox.isolation()\nif iso is None:\n    return {'problem': sandbox.isolation_problem()}\n"
            f"cases = {json.dumps({k: v[0] for k, v in cases.items()})}\nout = {{'memory': iso.memory, 'cgroup': iso.cgroup}}\n"
            "for name, code in cases.items():\n"
            "    mb = 128 if '128 MB' in name else 512\n"
            "    out[name] = sandbox.run_program(code, '', sandbox.SandboxLimits(wall_seconds=4, cpu_seconds=3, "
            "memory_mb=mb, output_mb=1, processes=16)).status\n"
            "out['hack'] = sandbox.run_program('def add(a, b):\\n    return 0\\nimport os\\nos._exit(0)', '', "
            "test={'code': 'assert add(1, 2) == 3'}).status\n"
            "out['uid'] = sandbox.run_program('import os; print(os.getuid())').stdout.strip()\nreturn out\n")
    out = _run_as_ordinary_user(body)
    assert "problem" not in out, out
    assert out["cgroup"] is None and "watchdog" in out["memory"]
    for name, (_, status) in cases.items():
        assert out[name] == status, (name, out[name])
    assert out["hack"] == "early_exit" and out["uid"] == "65534"


# ---------------------------------------------------------------------------------------------- refusing

def test_without_isolation_it_refuses_unless_allowed(monkeypatch, caplog):
    """Where bubblewrap cannot isolate (here: made missing), code does not run and the code rule and the python tool
    stop at start-up naming what is missing and the key; sandbox_allow_unisolated runs programs, loudly."""
    import logging

    from paddle_rl.config import RLConfig, config_from_values
    from paddle_rl.rewards import build_reward
    from paddle_rl.rollout.episodes import PYTHON_TOOL_LIMITS, load_environment
    monkeypatch.setenv("PATH", "/nonexistent")   # no bwrap on the PATH
    sandbox.isolation.cache_clear()
    try:
        assert isolation() is None and "bubblewrap (bwrap) is not installed" in isolation_problem()
        with pytest.raises(SandboxError, match="sandbox_allow_unisolated: true"):
            run_program("print(1)", "", LIMITS)
        with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
            build_reward(RLConfig(reward_funcs=["code"]))
        with pytest.raises(SandboxError, match="env_tools: the python tool"):
            load_environment("tools", ("calculator", "python"))
        load_environment("tools", ("calculator",))   # no untrusted code: nothing to refuse
        allowed = SandboxLimits(wall_seconds=4, cpu_seconds=3, memory_mb=512, allow_unisolated=True)
        with caplog.at_level(logging.WARNING, logger="paddle_rl"):
            result = run_program("print(1)", "", allowed)
        assert result.status == "ok" and result.stdout == "1\n" and "WITHOUT isolation" in caplog.text
        # the harness still decides tests where nothing isolates
        assert run_program("import os\nos._exit(0)", "", allowed, test={"code": "assert False"}).status == "early_exit"
        build_reward(config_from_values(dict(reward_funcs=["code"], sandbox_allow_unisolated=True)))
        load_environment("tools", ("python",), sandbox=SandboxLimits(allow_unisolated=True))
    finally:
        sandbox.isolation.cache_clear()


@isolated
def test_the_tool_environment_limits_calls_per_turn():
    from paddle_rl.rollout.episodes import ToolEnvironment
    env = ToolEnvironment(("calculator",), max_calls=2)
    env.reset({})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    step = env.step(call * 5)
    assert step.tool_calls == 5 and step.tool_errors == 3
    assert step.observation.splitlines()[:2] == ["2", "2"] and step.observation.count("max_tool_calls_per_turn") == 3
@isolated
def test_converted_records_score_with_the_code_rule():
    """APPS (stdin/stdout and call-based) and AceCoder records through `paddle-rl data convert`'s converter: the
    verl layout's ground truth is what the code rule runs."""
    from paddle_rl.config import config_from_values
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
    reward = RuleReward(["code"], None, config_from_values(dict(reward_funcs=["code"], sandbox_timeout=3)))
    add_fn = "<think>easy</think> <answer>```python\ndef add(a, b):\n    return a + b\n```</answer>"
    responses = [ADD, add_fn, add_fn]
    records = out + ace
    result = reward([RewardSample("p", r, rec) for r, rec in zip(responses, records)])
    np.testing.assert_array_equal(result.scores, [1.0, 1.0, 1.0])
    with pytest.raises(ConvertError, match="2 inputs but 1 outputs"):
        convert_records([("x:1", {"question": "q", "input_output": json.dumps({"inputs": [1, 2], "outputs": [1]})})])




def test_the_sandbox_keys_are_declared_by_their_readers():
    """code_score and the limits beside the code rule; the two isolation keys in sandbox.py, read by the code rule and
    the tool environment's python tool: the same names, defaults and error lines as when they were group fields."""
    from paddle_rl.config import ConfigError, load_config
    from paddle_rl.config.options import PIECE_OPTIONS
    assert PIECE_OPTIONS.readers("sandbox_timeout") == [("reward rule", "code")]
    assert PIECE_OPTIONS.readers("sandbox_allow_network") == [("reward rule", "code"), ("environment", "tools")]
    config = load_config(None, {"actor_model_name_or_path": "m"})
    assert (config.code_score, config.sandbox_timeout, config.sandbox_memory_mb, config.sandbox_processes,
            config.sandbox_allow_network, config.sandbox_allow_unisolated) == ("fraction", 10.0, 1024, 32, False, False)
    for override, message in (({"code_score": "most"}, "code_score: must be fraction or all, got 'most'"),
                              ({"sandbox_memory_mb": 32}, "sandbox_timeout / sandbox_memory_mb / sandbox_processes: "
                                                          "must be > 0 s, >= 64 MB and >= 1, got 10.0, 32, 32")):
        with pytest.raises(ConfigError) as error:
            load_config(None, {"actor_model_name_or_path": "m", **override})
        assert message in str(error.value)

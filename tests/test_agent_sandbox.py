"""Agent programs in the sandbox (env_plugin: agent, agent_sandbox: true, the default): the code rule's hostile set
run as agent programs through a real rollout (the tiny tool model's engine, the recording proxy, bubblewrap):
writes outside its folder, reads of host files, connections to host ports, a fork bomb, a memory hog, a program
that hunts for other episodes' session keys, one that floods the proxy with connections. Each scores zero or is
refused, the well-behaved episodes beside them are recorded as usual, nothing is left behind, and no program
reaches another episode's conversation; as root and as uid 65534 (as the code rule's tests)."""
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from paddle_rl.rewards.sandbox import isolation, isolation_problem
from paddle_rl.rollout import agent_relay, agents
from paddle_rl.rollout.agents import AgentEnvironment, AgentProxy, AgentSettings, _Episode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "data", "tiny_tool")
REQUIRED = os.environ.get("PADDLE_RL_REQUIRE_SANDBOX") == "1"
isolated = pytest.mark.skipif(isolation() is None and not REQUIRED,
                              reason=f"programs cannot be isolated here: {isolation_problem()}")

# each program claims as its reward what it managed from inside: 0 means every attempt was refused
PROGRAM = r'''
import json, os, random, socket, sys, time, urllib.error, urllib.request

task = json.load(sys.stdin)
record = task["record"]
mode = record["mode"]
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]


def post(body, key=key, path="/chat/completions"):
    request = urllib.request.Request(base + path, json.dumps(body).encode(),
                                     {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    for attempt in range(50):   # a connection closed at once: this program's own connections are all taken
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.1)
    raise SystemExit("no connection")


def ask():
    status, answer = post({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8})
    assert status == 200, answer


gained, found = 0, {}
if mode in ("ok", "linger"):
    ask()
    gained = 0.5
    status = open("/proc/self/status").read()
    found = {"uid": os.getuid(), "cap_eff": status.split("CapEff:")[1].split()[0],
             "no_new_privs": status.split("NoNewPrivs:")[1].split()[0], "processes": len(
                 [p for p in os.listdir("/proc") if p.isdigit()])}
    if mode == "linger":   # still running while the others look for it
        time.sleep(3)
elif mode == "files":   # host files: read the test's secret and the repository, write everywhere
    for path in record["read"]:
        try:
            gained += open(path).read(64) != ""
        except OSError:
            pass
    for path in record["write"]:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("x")
        except OSError:
            pass
    ask()
elif mode == "network":   # the host's listeners on 127.0.0.1 and its other addresses, and the outside
    for host, port in record["connect"]:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, port))
            gained += 1
        except OSError as e:
            found[f"{host}:{port}"] = type(e).__name__
    ask()
elif mode == "fork_bomb":   # processes until fork fails (the count reached on stderr), then every one forks on
    ask()                    # (backing off when refused: CPU is not what this one tests) and the program leaves
    count, parent = 1, os.getpid()
    while True:
        try:
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
            count += 1
        except OSError:
            print(json.dumps({"processes": count}), file=sys.stderr, flush=True)
            break
    end = time.time() + 2
    while time.time() < end:
        try:
            os.fork()
        except OSError:
            time.sleep(0.05)
    if os.getpid() == parent:
        print(json.dumps({"reward": 0.0}), flush=True)
    os._exit(0)   # all of them, the forks left behind with their program
elif mode == "memory":   # 4 x 100 MB over four processes, under agent_memory_mb 256
    for _ in range(4):
        if os.fork() == 0:
            x = bytearray(100 * 1024 ** 2)
            for i in range(0, len(x), 4096):
                x[i] = 1
            time.sleep(60)
            os._exit(0)
    time.sleep(60)
    gained = 1
elif mode == "forge":   # other episodes' sessions: in /proc, by guessing, on the proxy's socket
    own = key
    seen = set()
    time.sleep(0.5)   # the other programs have started
    for pid in os.listdir("/proc"):
        for name in ("environ", "cmdline"):
            try:
                text = open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace")
            except OSError:
                continue
            for part in text.replace("\0", " ").replace("=", " ").split():
                if part.startswith("session-") and part != own:
                    seen.add(part)
    found["sessions_seen"] = len(seen)
    for other in list(seen) + ["session-" + "%032x" % random.getrandbits(128) for _ in range(20)]:
        status, _ = post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, key=other)
        gained += status not in (401, 403)   # past the session check: that episode's conversation
        found.setdefault("statuses", []).append(status)
    ask()
elif mode == "flood":   # 200 connections at once, each a request left half written
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    held = []
    for _ in range(200):
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000000\r\n")
            held.append(s)
        except OSError:
            pass
    time.sleep(0.5)
    alive = 0
    for s in held:
        s.settimeout(0.01)
        try:
            alive += s.recv(1) != b""
        except socket.timeout:
            alive += 1
        except OSError:
            pass
    found["held_open"] = alive
    for s in held:
        s.close()
    time.sleep(0.2)
    ask()
print(json.dumps(found), file=sys.stderr)
print(json.dumps({"reward": float(gained)}))
'''
MODES = ["ok", "files", "network", "fork_bomb", "memory", "forge", "flood", "ok"]


def _program_processes(markers) -> list:
    """Host processes whose command line names one of `markers` (the run's program file, its proxy folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(m in cmdline for m in markers):
            found.append((int(pid), cmdline.replace("\0", " ")[:200]))
    return found


def hostile_rollout(folder: str, sandbox: bool = True, modes=MODES, timeout: float = 30.0) -> dict:
    """One rollout of MODES' programs (one sample each) in `folder` (a folder this user may write); what was seen
    from outside: the samples' rewards and failures, the host files and listeners the programs went for, the
    trainer's threads while they ran, what is left afterwards."""
    from paddle_rl.models import Tokenizer, load_model
    from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key
    tok = Tokenizer.from_pretrained(os.path.join(TOOL, "model"))
    model = load_model(os.path.join(TOOL, "model"))
    stops = sorted(set(tok.eos_token_ids) | set(model.config.eos_token_ids))
    engine = RolloutEngine(model, tok.pad_token_id, stops)
    program = os.path.join(folder, "hostile_agent.py")
    with open(program, "w") as f:
        f.write(PROGRAM)
    os.chmod(program, 0o644)
    secret = os.path.join(folder, "secret.txt")
    with open(secret, "w") as f:
        f.write("the trainer's secret")
    os.chmod(secret, 0o644)
    written = [os.path.join(folder, "escaped.txt"), os.path.join(ROOT, "paddle_rl_left_behind"),
               "/tmp/paddle_rl_left_behind", "/var/tmp/paddle_rl_left_behind", "/dev/shm/paddle_rl_left_behind",
               os.path.join(os.path.expanduser("~"), "paddle_rl_left_behind")]
    written = [p for p in written if not os.path.lexists(p)]
    listeners, targets = [], []
    addresses = ["127.0.0.1"]
    try:   # the host's address on its default route, where it has one
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("10.255.255.255", 1))
        addresses.append(probe.getsockname()[0])
        probe.close()
    except OSError:
        pass
    for address in dict.fromkeys(addresses):
        s = socket.socket()
        s.bind((address, 0))
        s.listen(8)
        s.setblocking(False)
        listeners.append(s)
        targets.append([address, s.getsockname()[1]])
    extra = {"files": {"read": [secret, os.path.join(ROOT, "README.md")], "write": written},
             "network": {"connect": targets + [["1.1.1.1", 53]]}}
    rows = [json.loads(line) for line in open(os.path.join(TOOL, "tool", "train.jsonl"))][:len(modes)]
    records = [dict(r, mode=m, **extra.get(m, {})) for r, m in zip(rows, modes)]
    settings = AgentSettings([sys.executable, program], timeout=timeout, concurrency=len(modes), on_failure="zero",
                             max_turns=3, max_prompt_len=64, program_reward=True, vocab_size=tok.vocab_size,
                             sandbox=sandbox, memory_mb=256, processes=16)
    env = AgentEnvironment(settings, tok, stops, {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_dec_len": 1,
                                                  "max_dec_len": 32})
    params = SamplingParams(max_dec_len=32, min_dec_len=1, temperature=1.0, stop_token_ids=stops)
    keys = [sample_key(5, 1, f"t:{i}", 0) for i in range(len(records))]
    threads_before = threading.active_count()
    peak = [threads_before]
    done = threading.Event()

    def watch():
        while not done.wait(0.01):
            peak[0] = max(peak[0], threading.active_count())
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    failures, findings = {}, {}
    start = time.monotonic()
    try:
        episodes = env.episodes(records, [r["src"] for r in records], [f"t:{i}" for i in range(len(records))], 1)
        original = episodes._ended

        def ended(episode, failure, err):   # the failure kinds, and the programs' own findings, as they end
            failures[episode.row] = failure[0] if failure else None
            findings[episode.row] = err.decode(errors="replace")[-300:]
            return original(episode, failure, err)
        episodes._ended = ended
        out = engine.generate([tok.encode(r["src"]) for r in records], 1, params, keys, episodes)
        proxy_folder = env.proxy.folder if sandbox else None
    finally:
        env.close()
        done.set()
        watcher.join()
    seconds = time.monotonic() - start
    accepted = 0
    for s in listeners:
        try:
            while True:
                s.accept()[0].close()
                accepted += 1
        except (BlockingIOError, OSError):
            pass
        s.close()
    deadline = time.monotonic() + 10
    markers = [program] + ([proxy_folder] if proxy_folder else [])
    while _program_processes(markers) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    leftover_threads = [t.name for t in threading.enumerate() if t.name.startswith("agent-proxy")]
    result = {"rewards": out["env_reward"].tolist(), "failed": out["agent_failed"].tolist(),
              "failures": [failures.get(i) for i in range(len(modes))], "turns": out["turns"].tolist(),
              "written": [p for p in written if os.path.lexists(p)], "accepted": accepted,
              "threads": peak[0] - threads_before, "processes": _program_processes(markers),
              "proxy_folder_left": bool(proxy_folder and os.path.exists(proxy_folder)),
              "leftover_threads": leftover_threads, "seconds": seconds, "uid": os.geteuid(),
              "findings": [findings.get(i) for i in range(len(modes))]}
    for p in result["written"]:   # an escape found: clean it up for the next run
        os.unlink(p)
    return result


def check_contained(result: dict) -> None:
    """What MODES' rollout must show in the sandbox."""
    by_mode = dict(zip(MODES[:-1], zip(result["rewards"], result["failures"])))
    assert result["rewards"][0] == result["rewards"][-1] == 0.5 and result["failures"][0] is None, result
    assert result["failures"][-1] is None and result["turns"][0] == 1, result
    # as nobody without capabilities, alone in its PID namespace (bwrap's init, the relay, itself)
    assert json.loads(result["findings"][0]) == {"uid": 65534, "cap_eff": "0" * 16, "no_new_privs": "1",
                                                 "processes": 3}, result
    for mode in ("files", "network", "forge", "flood"):   # every attempt refused; the program still ran to its end
        assert by_mode[mode] == (0.0, None), (mode, result)
    assert by_mode["fork_bomb"] == (0.0, None), result   # held at the process bound; its forks die with it
    bomb = json.loads(result["findings"][MODES.index("fork_bomb")].splitlines()[0])
    assert 1 < bomb["processes"] < 16, result   # agent_processes 16: bwrap, its init and the relay count too
    assert by_mode["memory"] == (0.0, "memory"), result
    assert result["written"] == [] and result["accepted"] == 0, result
    assert result["processes"] == [] and not result["proxy_folder_left"] and result["leftover_threads"] == [], result
    # the flood's 200 connections reach the proxy as at most CONNECTIONS connection threads
    # (a thread per program, one per connection it has open, the flood's CONNECTIONS, a few of the engine's)
    assert result["threads"] <= 2 * len(MODES) + agents.CONNECTIONS + 16, result


@isolated
def test_hostile_agent_programs_are_contained_as_root(tmp_path):
    os.chmod(tmp_path, 0o755)
    result = hostile_rollout(str(tmp_path))
    print(json.dumps(result))
    check_contained(result)


@isolated
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root (to become an ordinary user with setpriv)")
def test_hostile_agent_programs_are_contained_as_an_ordinary_user():
    """The same rollout run by uid 65534 (bwrap in a user namespace, the memory watchdog instead of a cgroup). The
    suite's interpreter lives under /root (0700 here): the run sees the host through a mount namespace in which
    /root holds only that interpreter's folder, read-only."""
    folder = tempfile.mkdtemp(prefix="paddle_rl_test_agent_user_")
    try:
        os.chmod(folder, 0o755)
        os.chown(folder, 65534, 65534)
        result = _as_ordinary_user(f"import test_agent_sandbox as t\nprint(json.dumps(t.hostile_rollout({folder!r})))",
                                   folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result))
    assert result["uid"] == 65534
    check_contained(result)


def _as_ordinary_user(code: str, folder: str) -> dict:
    """Runs `code` (its last stdout line JSON) as uid 65534 with this interpreter, the repository and `folder`."""
    command = ["bwrap", "--dev-bind", "/", "/"]
    prefix = os.path.realpath(sys.prefix)
    if prefix.startswith("/root/"):   # the folders above it made passable (bwrap makes them 0700)
        command += ["--tmpfs", "/root"]
        parts = prefix.split("/")[2:-1]
        for i in range(1, len(parts) + 1):
            command += ["--perms", "0755", "--dir", "/root/" + "/".join(parts[:i])]
        command += ["--ro-bind", prefix, prefix]
    # the compiled kernels are not what is tested here (built anew under this HOME they would take minutes)
    command += ["--chdir", ROOT, "--setenv", "HOME", folder, "--setenv", "PYTHONPATH", f"{ROOT}:{ROOT}/tests",
                "--setenv", "PADDLE_RL_CUSTOM_OPS", "off",
                "--", "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
                "import json, sys\n" + code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_episodes_socket_serves_that_episode_only():
    """The proxy of sandboxed programs: a Unix socket per episode, bound into that episode's sandbox alone. A
    request on it with another episode's session (known, here, to the test) is refused (403), with no session 401;
    its own session passes; after the episode ends the socket is gone."""
    proxy = AgentProxy(sandboxed=True)
    try:
        a, b = (_Episode(i, i, 0, {}, "", f"t:{i}", None) for i in range(2))
        proxy.open(object(), a)
        proxy.open(object(), b)

        def get(episode, session):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(proxy.socket_path(episode))
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {session}\r\n"
                      "Connection: close\r\n\r\n".encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            s.close()
            return int(data.split(b" ", 2)[1])
        assert get(a, b.session) == 403 and get(b, a.session) == 403
        assert get(a, "session-x") == 401
        assert get(a, a.session) == 200 and get(b, b.session) == 200
        assert oct(os.stat(proxy.folder).st_mode & 0o777) == "0o700"
        path = proxy.socket_path(a)
        proxy.close(a)
        assert not os.path.exists(path) and get(b, b.session) == 200
    finally:
        proxy.shutdown()
    assert not os.path.exists(proxy.folder)


@isolated
def test_without_the_sandbox_a_program_finds_the_other_sessions(tmp_path, caplog):
    """The check above can fail: unsandboxed (agent_sandbox: false, warned loudly), the same forging program reads
    the other programs' sessions from /proc and reaches their conversations, and the file writes land on the host."""
    import logging
    os.chmod(tmp_path, 0o755)
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        result = hostile_rollout(str(tmp_path), sandbox=False, modes=["forge", "files", "linger", "linger"])
    assert "OUTSIDE ANY SANDBOX" in caplog.text
    assert result["rewards"][0] >= 1 and result["rewards"][1] >= 1, result
    assert result["written"], result


def test_the_agent_sandbox_keys_are_checked(tmp_path):
    from paddle_rl.config import ConfigError, load_config

    def config(*overrides):
        return load_config(None, [f"actor_model_name_or_path={TOOL}/model", "env_plugin=agent",
                                  "agent_command=python a.py", *overrides])
    c = config()
    assert (c.agent_sandbox, c.agent_allow_network, c.agent_memory_mb, c.agent_processes,
            c.agent_sandbox_binds) == (True, False, 1024, 64, [])
    for overrides, message in (
            (["agent_sandbox=false", "agent_allow_network=true"], "agent_allow_network: acts only with agent_sandbox: "
                                                                  "true"),
            (["agent_sandbox=false", "agent_memory_mb=512"], "agent_memory_mb: acts only with agent_sandbox: true"),
            (["agent_memory_mb=32"], "agent_memory_mb: must be >= 64, got 32"),
            (["agent_processes=1"], "agent_processes: must be >= 4, got 1"),
            ([f"agent_sandbox_binds=[{tmp_path}/missing]"], "agent_sandbox_binds: .*missing: not found")):
        with pytest.raises(ConfigError, match=message):
            config(*overrides)
    for key in ("agent_sandbox=false", "agent_memory_mb=512"):   # without the agent environment: refused by name
        with pytest.raises(ConfigError, match=f"{key.split('=')[0]}: acts only with env_plugin: agent"):
            load_config(None, [f"actor_model_name_or_path={TOOL}/model", key])


def test_without_bubblewrap_agent_sandbox_is_named(monkeypatch):
    """Where bwrap is missing (made so: an empty PATH), the preflight and the environment refuse by the key's name;
    with agent_sandbox: false the run may start, warned."""
    from paddle_rl.config import load_config
    from paddle_rl.rewards import sandbox
    from paddle_rl.rewards.sandbox import SandboxError
    from paddle_rl.trainer.preflight import plugin_problems
    config = load_config(None, [f"actor_model_name_or_path={TOOL}/model", "env_plugin=agent",
                                f"agent_command={sys.executable} a.py"])
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.isolation.cache_clear()
    try:
        problems = plugin_problems(config)
        assert len(problems) == 1 and problems[0].startswith("agent_sandbox: agent programs run in a sandbox, and "
                                                             "here bubblewrap (bwrap) is not installed"), problems
        with pytest.raises(SandboxError, match="agent_sandbox: cannot isolate agent programs here"):
            AgentEnvironment(AgentSettings([sys.executable, "a.py"]), None, [], {})
        config.agent_sandbox = False
        assert plugin_problems(config) == []
    finally:
        sandbox.isolation.cache_clear()


def test_a_killed_trainers_proxy_folder_goes_at_the_next_start():
    """The proxy's folder (its sockets, the relay's copy) is removed by shutdown or at exit; one whose process was
    killed goes when the next proxy starts. A live process's folder stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tempfile.mkdtemp(prefix=f"{agents.FOLDER_PREFIX}{dead.pid}_")
    open(os.path.join(left, "0-x.sock"), "w").close()
    live = tempfile.mkdtemp(prefix=f"{agents.FOLDER_PREFIX}{os.getpid()}_")
    proxy = AgentProxy(sandboxed=True)
    try:
        assert not os.path.exists(left) and os.path.isdir(live)
        assert os.path.isfile(proxy.relay) and os.path.dirname(proxy.relay) == proxy.folder
    finally:
        proxy.shutdown()
        os.rmdir(live)
    assert not os.path.exists(proxy.folder)


def test_the_relay_delivers_an_answer_sent_before_the_request_was_read(tmp_path):
    """A proxy refusal (401 / 403) is answered before the request's body is read, and the proxy then closes its end
    with that body unread: the relay's next read from it fails (ECONNRESET) and its writes to it fail (EPIPE). The
    answer it already holds still reaches the program, whole (it was lost with the connection: a hostile program's
    urllib raised IncompleteRead and the episode failed)."""
    path = str(tmp_path / "proxy.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    answer_body = b'{"error": "refused"}' * 400

    def refuse():   # reads the request line and headers only, answers in two writes, closes
        conn, _ = server.accept()
        seen = b""
        while b"\r\n\r\n" not in seen:
            seen += conn.recv(1 << 16)
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: %d\r\n\r\n" % len(answer_body))
        time.sleep(0.2)   # the program's body keeps coming into this socket meanwhile, unread
        conn.sendall(answer_body)
        conn.close()

    refuser = threading.Thread(target=refuse, daemon=True)
    refuser.start()
    poll = select.epoll()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    poll.register(listener.fileno(), agent_relay.IN)
    relay = agent_relay.Relay(poll, path, 4)
    stop = threading.Event()

    def run():
        while not stop.is_set():
            for fd, mask in poll.poll(0.05):
                if fd == listener.fileno():
                    relay.accept(listener)
                else:
                    relay.event(fd, mask)

    relaying = threading.Thread(target=run, daemon=True)
    relaying.start()
    program = socket.create_connection(listener.getsockname(), timeout=10)
    body = b"x" * (4 << 20)   # more than the sockets between them hold
    program.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
    sender = threading.Thread(target=lambda: _send_quietly(program, body), daemon=True)
    sender.start()
    received = b""
    try:
        while True:
            chunk = program.recv(1 << 16)
            if not chunk:
                break
            received += chunk
    finally:
        stop.set()
        relaying.join(5)
        program.close()
        server.close()
    head, _, got = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and got == answer_body, (head, len(got), len(answer_body))


def _send_quietly(sock, data):
    try:
        sock.sendall(data)
    except OSError:   # the relay stops taking the body once the proxy is gone
        pass

"""Hostile clients against the suite's HTTP servers, and the rate a well-behaved client keeps meanwhile.

    python tools/hostile_clients.py --seconds 5                 # both servers
    python tools/hostile_clients.py --server reward --seconds 5

Starts `python -m reward_server` (kk, 1 worker) and `paddle-rl rollout-server` (the bundled tiny_arith model) on
free 127.0.0.1 ports, each with an API key and its default limits (docs/reliability.md, "Hostile clients"). For each
attack, a well-behaved client sends requests one after another on one keep-alive connection for --seconds, with
and without the attack running in other threads, and the table gives its requests per second, its failures, and
what the server answered the attacker (HTTP statuses, or `closed`). The tests (tests/test_hostile_clients.py)
use the same clients with small limits.
"""
import argparse
import multiprocessing
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save as save_safetensors  # noqa: E402

REWARD_KEY, ROLLOUT_KEY = "reward-k3y", "rollout-k3y"
PADDLENLP_BODY = b'{"src": ["q"], "tgt": ["(1) Zoey is a knight"], "response": ["<answer>(1) Zoey is a knight</answer>"]}'


# ------------------------------------------------------------------------------------------------ raw clients

def status_of(answer: bytes) -> Optional[int]:
    """The HTTP status of a raw answer (None: the server closed the connection without one)."""
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return out


def exchange(port: int, chunks: List[bytes], delay: float = 0.0, timeout: float = 30.0):
    """Send `chunks` on a new connection, `delay` seconds apart (stopping when the server has closed it), then read
    until the server closes: (raw answer, seconds from connecting to the close)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, chunk in enumerate(chunks):
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            if delay and i + 1 < len(chunks):
                sock.settimeout(delay)
                try:
                    if not sock.recv(1, socket.MSG_PEEK):   # closed by the server
                        break
                    break   # an answer arrived: stop sending, read it
                except socket.timeout:
                    pass
        answer = read_until_closed(sock, timeout)
    return answer, time.monotonic() - start


def head(method: str, path: str, key: Optional[str] = None, length: Optional[int] = None, extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if key:
        lines.append(f"X-API-Key: {key}")
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def slow_head(port: int, path: str = "/", byte_delay: float = 0.2, timeout: float = 60.0):
    """Slowloris: a request head sent one byte every `byte_delay` seconds, never finished in time."""
    text = head("POST", path) + b"X-Padding: " + b"a" * 100000
    return exchange(port, [text[i:i + 1] for i in range(len(text))], byte_delay, timeout)


def slow_body(port: int, path: str, key: str, byte_delay: float = 0.2, body: bytes = PADDLENLP_BODY,
              timeout: float = 60.0):
    """A keyed request whose body comes one byte every `byte_delay` seconds."""
    return exchange(port, [head("POST", path, key, len(body))] + [body[i:i + 1] for i in range(len(body))],
                    byte_delay, timeout)


def big_head(port: int, size: int, timeout: float = 30.0):
    """A request head of `size` bytes (one header line), sent at once."""
    return exchange(port, [b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"],
                    timeout=timeout)


def oversized(port: int, path: str, key: Optional[str], size: int, declared: bool = True, timeout: float = 30.0):
    """A body of `size` bytes: declared by Content-Length (refused before reading), or chunked without a length
    (refused once the read passes the limit)."""
    if declared:
        return exchange(port, [head("POST", path, key, size), b"[" * 65536], timeout=timeout)
    block = b"[" * 65536
    chunk = f"{len(block):x}\r\n".encode() + block + b"\r\n"
    text = head("POST", path, key, extra="Transfer-Encoding: chunked\r\n")
    return exchange(port, [text] + [chunk] * (size // len(block) + 1) + [b"0\r\n\r\n"], timeout=timeout)


def open_idle(port: int, count: int) -> List[socket.socket]:
    """`count` connections that send nothing."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10.0) for _ in range(count)]


def closed_by_server(socks: List[socket.socket]) -> int:
    """How many of `socks` the server has closed."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    readable = {fd for fd, _ in poller.poll(0)}
    closed = 0
    for s in socks:
        if s.fileno() in readable:
            try:
                closed += s.recv(65536, socket.MSG_PEEK) == b""
            except OSError:
                closed += 1
    return closed


def bad_safetensors() -> dict:
    """Bodies that are not safetensors files, by what is wrong with them."""
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    return {
        "empty": b"",
        "short": b"\x01\x02",
        "header length past the end": (10 ** 9).to_bytes(8, "little") + b"{}",
        "header not JSON": (7).to_bytes(8, "little") + b"{nope!}",
        "offsets past the data": len(header).to_bytes(8, "little") + header + b"\x00" * 8,
        "unknown dtype": (lambda h: len(h).to_bytes(8, "little") + h + b"\x00" * 16)(
            b'{"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}'),
    }


def malformed_json() -> dict:
    return {"not JSON": b"{nope", "truncated": b'{"src": ["a"], "tgt": [', "nested 100000 deep": b"[" * 100000 +
            b"]" * 100000, "not UTF-8": b'{"src": ["\xff\xfe"]}', "a list, not an object": b"[1, 2, 3]"}


def post(url: str, path: str, body: bytes, key: Optional[str], headers: Optional[dict] = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["X-API-Key"] = key
    return httpx.post(url + path, content=body, headers=h, timeout=30.0)


# ------------------------------------------------------------------------------------------------ servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, cmd: List[str], env: dict, log: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd + ["--port", str(self.port)], cwd=ROOT, env={**os.environ, **env,
                                                                                      "PYTHONPATH": ROOT},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up; log: {self.log.name}")

    def peak_rss_mb(self) -> float:
        """The server process's peak resident memory (VmHWM), in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def reward_server(*flags, log: str = os.devnull) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "reward_server", "--reward", "kk", "--workers", "1", *flags],
                         {"PADDLE_RL_REWARD_API_KEY": REWARD_KEY}, log)


def rollout_server(model: str, *flags, log: str = os.devnull) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "paddle_rl", "rollout-server", f"actor_model_name_or_path={model}",
                          *flags], {"PADDLE_RL_ROLLOUT_API_KEY": ROLLOUT_KEY}, log)


# ------------------------------------------------------------------------------------------------ the rate

class Polite:
    """The well-behaved client: one request after another on one keep-alive connection."""

    def __init__(self, kind: str, url: str):
        self.kind, self.url = kind, url
        self.key = REWARD_KEY if kind == "reward" else ROLLOUT_KEY
        self.client = httpx.Client(timeout=30.0, headers={"X-API-Key": self.key})

    def one(self) -> bool:
        if self.kind == "reward":
            r = self.client.post(self.url + "/", content=PADDLENLP_BODY, headers={"Content-Type": "application/json"})
            return r.status_code == 200 and r.json()["score"] != []
        r = self.client.post(self.url + "/v1/generate", json={"prompts": [[1, 2, 3]], "n": 1, "params": {
            "temperature": 0.0, "max_dec_len": 4, "min_dec_len": 4}})
        return r.status_code == 200 and len(r.json()["rows"]) == 1

    def rate(self, seconds: float):
        """(requests per second answered right, failures, median seconds per request) over `seconds`."""
        done = failed = 0
        times = []
        end = time.monotonic() + seconds
        start = time.monotonic()
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                ok = self.one()
            except httpx.HTTPError:
                ok = False
            times.append(time.monotonic() - t)
            done += ok
            failed += not ok
        return done / (time.monotonic() - start), failed, float(np.median(times))


class Attack:
    """`fn(port, stop)` in `threads` threads of another process (the attacker's own interpreter: threads of the
    measuring process would take its GIL), over and over until stopped; counts what the server answered."""

    def __init__(self, fn, port: int, threads: int = 1):
        self.fn, self.port, self.threads = fn, port, threads
        self.context = multiprocessing.get_context("fork")
        self.stop_event = self.context.Event()
        self.results = self.context.Queue()
        self.process = self.context.Process(target=self._run, daemon=True)

    def start(self) -> None:
        self.process.start()

    def _run(self) -> None:
        answers, lock = Counter(), threading.Lock()

        def loop():
            while not self.stop_event.is_set():
                try:
                    outcome = self.fn(self.port, self.stop_event)
                except OSError as e:
                    outcome = type(e).__name__
                with lock:
                    answers[outcome] += 1

        workers = [threading.Thread(target=loop, daemon=True) for _ in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.results.put(answers)

    def stop(self) -> Counter:
        self.stop_event.set()
        answers = self.results.get(timeout=180)
        self.process.join(10)
        return answers


def _status(answer) -> str:
    status = status_of(answer[0])
    return "closed" if status is None else str(status)


def attacks(kind: str, url: str) -> dict:
    """name -> (fn(port, stop) -> outcome, threads)."""
    path = "/" if kind == "reward" else "/v1/generate"
    key = REWARD_KEY if kind == "reward" else ROLLOUT_KEY

    def slowloris(port, stop):
        return _status(slow_head(port, path, byte_delay=0.5))

    def slow_keyed_body(port, stop):
        return _status(slow_body(port, path, key, byte_delay=0.5))

    def flood(port, stop):   # 1000 idle connections held open; each one the server closes is opened again
        socks = open_idle(port, 1000)
        reopened = 0
        while not stop.is_set():
            time.sleep(0.1)
            poller = select.poll()
            for sock in socks:
                poller.register(sock, select.POLLIN)
            gone = {fd for fd, _ in poller.poll(0)}
            for i, sock in enumerate(socks):
                if sock.fileno() in gone:
                    sock.close()
                    socks[i] = socket.create_connection(("127.0.0.1", port), timeout=10.0)
                    reopened += 1
        for sock in socks:
            sock.close()
        return f"{reopened} closed by the server (and opened again)"

    def too_large(port, stop):
        return _status(oversized(port, path, key, 2 ** 30, declared=True))

    def unkeyed_push(port, stop):
        return _status(oversized(port, "/v1/weights", None, 2 ** 30, declared=True))

    def bad_json(port, stop):
        return " ".join(str(post(url, path, body, key).status_code) for body in malformed_json().values())

    def bad_weights(port, stop):
        bodies = list(bad_safetensors().values()) + [
            save_safetensors({"model.norm.weight": np.zeros(3, np.float32)}),
            save_safetensors({"model.norm.weight": np.zeros(3, np.float64)})]
        return " ".join(str(post(url, "/v1/weights", body, key, {"X-Policy-Version": "9"}).status_code)
                        for body in bodies)

    out = {"slowloris head, 200 connections": (slowloris, 200),
           "slow keyed body, 64 connections": (slow_keyed_body, 64),
           "1000 idle connections held open": (flood, 1),
           "oversized bodies (1 GiB declared), keyed": (too_large, 4),
           "malformed JSON": (bad_json, 4)}
    if kind == "rollout":
        out["malformed / misshapen / float64 weight pushes"] = (bad_weights, 4)
        out["weight pushes without the key (1 GiB declared)"] = (unkeyed_push, 4)
    return out


def bench(kind: str, server: ServerProcess, seconds: float) -> List[str]:
    """One row per attack: the polite client's rate while it runs, and quiet (the mean of the rates just before and
    just after it: other jobs on the machine move the rate too)."""
    polite = Polite(kind, server.url)
    polite.rate(1.0)   # warm
    rows = []
    for name, (fn, threads) in attacks(kind, server.url).items():
        before, before_failed, before_median = polite.rate(seconds)
        attack = Attack(fn, server.port, threads)
        attack.start()
        time.sleep(1.0)   # the attack under way
        rate, failed, median = polite.rate(seconds)
        answers = attack.stop()
        time.sleep(1.0)
        after, after_failed, after_median = polite.rate(seconds)
        quiet, quiet_failed = (before + after) / 2, before_failed + after_failed
        told = ", ".join(f"{k} x{v}" for k, v in answers.most_common(4))
        rows.append(f"| {kind} | {name} | {quiet:.1f} ({before:.1f}, {after:.1f}) | {rate:.1f} ({rate / quiet:.0%}) | "
                    f"{1e3 * before_median:.1f}, {1e3 * after_median:.1f} / {1e3 * median:.1f} | "
                    f"{quiet_failed} / {failed} | {told} | {os.getloadavg()[0]:.1f} |")
        print(rows[-1], flush=True)
        time.sleep(1.0)
    health = httpx.get(server.url + "/health").json()
    rows.append(f"| {kind} | (the server's connection counters after all rows; its peak RSS {server.peak_rss_mb():.0f} "
                f"MB) | | | | | {health['connections']} | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=("reward", "rollout", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement window per row")
    parser.add_argument("--model", default=os.path.join(ROOT, "data", "tiny_arith", "model"))
    args = parser.parse_args()
    rows = ["| server | attack | well-behaved client, requests/s, quiet (before, after) | under the attack (of quiet) "
            "| median ms per request, quiet (before, after) / under the attack | its failures (quiet / attack) "
            "| what the attacker got | load average |", "|---|---|---|---|---|---|---|---|"]
    kinds = ("reward", "rollout") if args.server == "both" else (args.server,)
    for kind in kinds:
        server = reward_server() if kind == "reward" else rollout_server(args.model)
        try:
            rows += bench(kind, server.wait(), args.seconds)
        finally:
            server.stop()
    print("\n".join(rows))


if __name__ == "__main__":
    main()

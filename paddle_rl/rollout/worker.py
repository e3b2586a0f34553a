"""A rollout engine in a process of its own: the asynchronous rollout's worker.

The trainer starts it (`RolloutWorker`), with its own thread count (on a GPU machine: its own devices), and
talks to it over a local authenticated connection:
    ("weights", path, version)   load the policy weights (a safetensors file under Hugging Face names, written
                                 by the trainer to a tmpfs folder and removed by the worker once read)
    ("generate", request, prompts, n, params, keys)
                                 -> ("batch", request, StepBatch, version, stats): the rollout columns, tagged with
                                 the weights version that generated them
    ("stop",)
Messages are handled in order, so a generate request sent after a weights message decodes with those weights.
With partial rollouts (`partial=True`) a weights message that arrives during a generation is applied between two
decode steps: the batch goes on under the new weights, each token tagged with its version (`token_version`), the
rows keeping the KV caches the older weights wrote; the batch's `policy_version` is the version it started with.
The worker holds a plain model (a LoRA trainer sends its merged weights) and exits when the connection closes
(the trainer ended or died). A worker that dies is reported by `result` within `poll` seconds, with its exit code
and the end of its log.
"""
import dataclasses
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import deque
from multiprocessing.connection import Client, Listener
from typing import Dict, Optional

import numpy as np

from ..env import configure_threads
from ..models import load_model, load_weights
from ..model_files.safetensors_io import read_file
from .engine import RolloutEngine
from .settings import EngineSettings


class RolloutWorkerError(RuntimeError):
    """The rollout worker died or stopped answering."""


class RolloutWorker:
    def __init__(self, model_dir: str, settings: EngineSettings, threads: int = 0, log_path: Optional[str] = None,
                 start_timeout: float = 300.0, partial: bool = False):
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"paddle_rl_rollout_worker_{os.getpid()}.log")
        self.weights_dir = tempfile.mkdtemp(prefix="paddle_rl_weights_",
                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        env = dict(os.environ)
        if threads > 0:
            env["OMP_NUM_THREADS"] = str(threads)
        env["PADDLE_RL_WORKER_KEY"] = authkey.hex()
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "paddle_rl.rollout.worker", host, str(port)],
                                        env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._conn = self._accept(start_timeout)
        self._conn.send(("init", {"model_dir": model_dir, "weights_dir": self.weights_dir,
                                  "settings": dataclasses.asdict(settings), "partial": partial}))
        self.version = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def _accept(self, timeout: float):
        import socket
        self._listener._listener._socket.settimeout(1.0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._listener.accept()
            except socket.timeout:
                self._check_alive("starting")
                if time.monotonic() > deadline:
                    self.close()
                    raise RolloutWorkerError(f"the rollout worker did not connect within {timeout:g} s "
                                             f"(log: {self.log_path})") from None

    def _check_alive(self, doing: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise RolloutWorkerError(f"the rollout worker (pid {self.process.pid}) exited with code {code} while "
                                     f"{doing}; the end of its log ({self.log_path}):\n{self._tail()}")

    def _tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    # ---------------------------------------------------------------- requests
    def push_weights(self, state: Dict[str, np.ndarray], version: int) -> None:
        """The policy of `version` (a {Hugging Face name: array} state) for the generate requests sent after it."""
        from safetensors.numpy import save_file
        path = os.path.join(self.weights_dir, f"v{version}.safetensors")
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._send(("weights", path, version))
        self.version = version

    def submit(self, request, prompts, n: int, params, keys) -> None:
        self._send(("generate", request, [list(p) for p in prompts], n, params, None if keys is None else list(keys)))

    def _send(self, message) -> None:
        self._check_alive("waiting for a request")
        try:
            self._conn.send(message)
        except (OSError, EOFError):
            self._check_alive("receiving a request")
            raise

    def result(self, doing: str, poll: float = 1.0):
        """(request, StepBatch, version, stats) of the oldest request; RolloutWorkerError if the worker dies."""
        while not self._conn.poll(poll):
            self._check_alive(doing)
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            time.sleep(0.5)  # let the exit code arrive
            self._check_alive(doing)
            raise RolloutWorkerError(f"the rollout worker closed its connection while {doing} "
                                     f"(log: {self.log_path}):\n{self._tail()}") from None
        if message[0] == "error":
            raise RolloutWorkerError(f"the rollout worker failed while {doing}:\n{message[1]}")
        return message[1:]

    def close(self) -> None:
        try:
            if hasattr(self, "_conn"):
                self._conn.send(("stop",))
                self._conn.close()
        except (OSError, EOFError):
            pass
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._listener.close()
        self._log.close()
        import shutil
        shutil.rmtree(self.weights_dir, ignore_errors=True)


# ---------------------------------------------------------------- the worker process
def _serve(conn) -> None:
    """Answer the trainer's messages until it stops or goes away; then remove the weights folder (a trainer
    killed with -9 cannot)."""
    import shutil
    weights_dir = None
    try:
        weights_dir = _Server(conn).serve()
    finally:
        if weights_dir:
            shutil.rmtree(weights_dir, ignore_errors=True)


class _Server:
    """The worker's side: answers the trainer's messages in order. With `partial` (partial rollouts) a weights
    message that arrives while a batch is being generated is applied between two decode steps, and the batch goes on
    under the new weights (each token tagged with its version); other messages wait their turn. For that it is a
    stage of its engine (rollout/engine.py): `between_steps`, `tags_versions`."""
    tags_versions = True

    def __init__(self, conn):
        self.conn = conn
        self.inbox = deque()
        self.engine = None
        self.version = None
        self.weights_dir = None
        self.load_s = 0.0  # loading the weights received since the last batch

    def _next(self):
        return self.inbox.popleft() if self.inbox else self.conn.recv()

    def _load(self, path: str, version: int) -> None:
        start = time.perf_counter()
        load_weights(self.engine.model, read_file(path))
        os.remove(path)
        self.version = version
        self.engine.version = version
        self.load_s += time.perf_counter() - start

    def between_steps(self) -> bool:
        """The engine's stage of a partial rollout: weights the trainer sent meanwhile are loaded between decode
        steps (True when they were: the engine repacks); other messages wait in the inbox."""
        loaded = False
        while self.conn.poll(0):
            message = self.conn.recv()
            if message[0] == "weights":
                self._load(message[1], message[2])
                loaded = True
            else:
                self.inbox.append(message)
        return loaded

    def _init(self, spec: dict) -> None:
        self.weights_dir = spec["weights_dir"]
        model = load_model(spec["model_dir"])
        model.eval()
        for p in model.parameters():
            p.stop_gradient = True
        self.engine = RolloutEngine(model, settings=EngineSettings(**spec["settings"]),
                                    stages=[self] if spec.get("partial") else [])

    def _generate(self, request, prompts, n, params, keys) -> None:
        start = time.perf_counter()
        started = self.version
        batch = self.engine.generate(prompts, n, params, keys)
        batch["policy_version"] = np.full(batch.size, -1 if started is None else started, dtype=np.int64)
        stats = dict(self.engine.stats, generate_s=time.perf_counter() - start, weights_load_s=self.load_s,
                     peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        self.load_s = 0.0
        self.conn.send(("batch", request, batch, started, stats))

    def serve(self):
        """Until the trainer stops or goes away; returns the weights folder to remove."""
        import traceback
        while True:
            try:
                message = self._next()
            except (EOFError, OSError):
                return self.weights_dir  # the trainer is gone
            kind = message[0]
            try:
                if kind == "stop":
                    return self.weights_dir
                if kind == "init":
                    self._init(message[1])
                elif kind == "weights":
                    self._load(message[1], message[2])
                elif kind == "generate":
                    self._generate(*message[1:])
            except (EOFError, OSError):
                return self.weights_dir
            except Exception:  # noqa: BLE001 - reported to the trainer, which raises it
                self.conn.send(("error", traceback.format_exc()))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_threads()
    conn = Client((argv[0], int(argv[1])), authkey=bytes.fromhex(os.environ.pop("PADDLE_RL_WORKER_KEY")))
    print(f"rollout worker pid {os.getpid()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    _serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main())

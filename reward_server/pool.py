"""A pool of scoring processes with a per-sample time limit.

Each worker process builds the reward functions once and scores one sample per task. One dispatcher thread per
worker hands it tasks and waits at most `sample_timeout` seconds for each answer; a worker that overruns is
killed and replaced, so a pathological input costs one sample's time limit and never stalls the server.
"""
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from paddle_rl.config import config_from_values
from paddle_rl.rewards import RewardSample, build_local_reward

logger = logging.getLogger("reward_server")

STARTUP_TIMEOUT = 120.0


class ScoringFailure(Exception):
    """A sample could not be scored: kind is "error", "timeout" or "crash"; index is the sample's index."""

    def __init__(self, kind: str, index: int, message: str):
        super().__init__(message)
        self.kind, self.index, self.message = kind, index, message


@dataclass
class SampleScore:
    score: float
    per_function: Dict[str, Optional[float]]
    correct: Optional[bool]
    timed_out: bool = False


class Batch:
    """The samples of one request; `future` resolves to a list of SampleScore or a ScoringFailure."""

    def __init__(self, n: int):
        self.results: List[Optional[SampleScore]] = [None] * n
        self.remaining = n
        self.future: Future = Future()
        self.lock = threading.Lock()
        if n == 0:
            self.future.set_result([])

    @property
    def done(self) -> bool:
        return self.future.done()

    def set(self, index: int, value: SampleScore):
        with self.lock:
            if self.future.done():
                return
            self.results[index] = value
            self.remaining -= 1
            if self.remaining == 0:
                self.future.set_result(self.results)

    def fail(self, failure: ScoringFailure):
        with self.lock:
            if not self.future.done():
                self.future.set_exception(failure)


@dataclass
class Task:
    batch: Batch
    index: int
    sample: Dict[str, Any]
    enqueued: float = field(default_factory=time.monotonic)


# ------------------------------------------------------------------------------------------------ worker process

def _worker_main(conn, config_values: dict):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        scorer = build_local_reward(config_from_values(config_values))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, sample = message
        try:
            result = scorer([RewardSample(**sample)], index_base=index)
            per = {name: (None if values[0] != values[0] else float(values[0]))
                   for name, values in result.per_function.items()}
            correct = None if result.correct is None else bool(result.correct[0])
            conn.send(("ok", float(result.scores[0]), per, correct))
        except Exception as e:  # noqa: BLE001 - becomes the request's error
            conn.send(("error", str(e) or type(e).__name__))


class _Worker:
    def __init__(self, ctx, config_values: dict, slot: int):
        self.ctx, self.config_values, self.slot = ctx, config_values, slot
        self.process = None
        self.conn = None

    def start(self):
        parent, child = self.ctx.Pipe()
        process = self.ctx.Process(target=_worker_main, args=(child, self.config_values),
                                   name=f"reward-worker-{self.slot}", daemon=True)
        process.start()
        child.close()
        if not parent.poll(STARTUP_TIMEOUT):
            process.kill()
            raise RuntimeError(f"reward worker {self.slot} did not start within {STARTUP_TIMEOUT:g}s")
        try:
            status, detail = parent.recv()
        except EOFError:
            raise RuntimeError(f"reward worker {self.slot} exited during start-up "
                               f"(exit code {process.exitcode})") from None
        if status != "ready":
            process.join(5)
            raise RuntimeError(f"reward worker {self.slot} failed to start: {detail}")
        self.process, self.conn = process, parent

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill(self):
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process, self.conn = None, None

    def stop(self):
        if self.conn is not None and self.alive:
            try:
                self.conn.send(None)
                self.process.join(2)
            except (OSError, ValueError):
                pass
        self.kill()


# ------------------------------------------------------------------------------------------------ pool

class ScoringPool:
    def __init__(self, config_values: dict, workers: int = 2, sample_timeout: float = 10.0,
                 timeout_score: Optional[float] = None, max_pending: int = 65536,
                 preload=("paddle_rl.rewards", "math_verify")):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.config_values = config_values
        self.sample_timeout = float(sample_timeout)
        self.timeout_score = timeout_score
        self.max_pending = max_pending
        methods = multiprocessing.get_all_start_methods()
        self.ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(list(preload))
        self.queue: "queue.Queue[Optional[Task]]" = queue.Queue()
        self.workers = [_Worker(self.ctx, config_values, i) for i in range(workers)]
        self.threads: List[threading.Thread] = []
        self.closing = False
        self.stats = {"samples": 0, "timeouts": 0, "errors": 0, "crashes": 0, "restarts": 0}

    def start(self):
        for worker in self.workers:
            worker.start()
        for worker in self.workers:
            thread = threading.Thread(target=self._dispatch, args=(worker,), name=f"reward-dispatch-{worker.slot}",
                                      daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self):
        self.closing = True
        for _ in self.threads:
            self.queue.put(None)
        for thread in self.threads:
            thread.join(self.sample_timeout + 5)
        for worker in self.workers:
            worker.stop()

    @property
    def pending(self) -> int:
        return self.queue.qsize()

    @property
    def alive(self) -> int:
        return sum(w.alive for w in self.workers)

    def submit(self, samples: List[Dict[str, Any]]) -> Batch:
        """Queue a request's samples; raises OverflowError when the queue is full."""
        if self.pending + len(samples) > self.max_pending:
            raise OverflowError(f"{self.pending} samples already waiting (limit {self.max_pending})")
        batch = Batch(len(samples))
        for i, sample in enumerate(samples):
            self.queue.put(Task(batch, i, sample))
        return batch

    def _restart(self, worker: _Worker):
        worker.kill()
        self.stats["restarts"] += 1
        while not self.closing:
            try:
                worker.start()
                return
            except RuntimeError as e:
                logger.error("%s; retrying in 1s", e)
                time.sleep(1.0)

    def _dispatch(self, worker: _Worker):
        while True:
            task = self.queue.get()
            if task is None:
                return
            if task.batch.done:
                continue
            if not worker.alive:
                self._restart(worker)
                if self.closing:
                    task.batch.fail(ScoringFailure("crash", task.index, "server shutting down"))
                    return
            try:
                worker.conn.send((task.index, task.sample))
                ready = worker.conn.poll(self.sample_timeout)
                message = worker.conn.recv() if ready else None
            except (EOFError, OSError, BrokenPipeError):
                code = worker.process.exitcode if worker.process is not None else None
                self.stats["crashes"] += 1
                logger.error("reward worker %d died on sample %d (exit code %s)", worker.slot, task.index, code)
                task.batch.fail(ScoringFailure("crash", task.index,
                                               f"sample {task.index}: the scoring process died (exit code {code})"))
                self._restart(worker)
                continue
            self.stats["samples"] += 1
            if message is None:
                self.stats["timeouts"] += 1
                logger.warning("sample %d: scoring exceeded %gs; worker %d replaced", task.index,
                               self.sample_timeout, worker.slot)
                self._restart(worker)
                if self.timeout_score is not None:
                    task.batch.set(task.index, SampleScore(float(self.timeout_score), {}, None, timed_out=True))
                else:
                    task.batch.fail(ScoringFailure(
                        "timeout", task.index,
                        f"sample {task.index}: scoring did not finish within {self.sample_timeout:g}s"))
                continue
            if message[0] == "ok":
                _, score, per, correct = message
                task.batch.set(task.index, SampleScore(score, per, correct))
            else:
                self.stats["errors"] += 1
                task.batch.fail(ScoringFailure("error", task.index, message[1]))

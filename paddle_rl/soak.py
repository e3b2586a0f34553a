"""`paddle-rl bench --soak MINUTES`: a long run that meets many faults in a row, and the check that it lost nothing.

The run: the tiny default (configs/tiny_arith_grpo.yaml's model and data) trained by `paddle-rl train` as a process
of its own, generating on two `paddle-rl rollout-server`s and scored by a `paddle-rl reward-server` (two workers,
use_rm_server, reward_server_on_failure skip), a checkpoint every few steps, all on 127.0.0.1 with fresh ports.
Beside it a chaos loop, seeded (`--seed`; its schedule is printed before it starts), SIGKILLs and restarts after a
drawn pause: a rollout server (one at a time: the other keeps the run going), a reward-server worker (the server
replaces it), the reward server itself (its client retries; past its retries a request's samples are skipped and
their groups dropped), and once, half-way, the trainer (kill -9 of its process group), resumed from its last
complete checkpoint (`resume_from_checkpoint: auto`; the resumed run is given the max_steps that ends it about at
the deadline, the learning rate being constant). A fault waits while the trainer starts (its servers must answer
then) or while a server it would kill is down.

At the end (`check_run`, `leftovers`): every prompt group of every step was trained or counted as dropped with its
reason (metrics.jsonl's `batch/groups_*`), no step trained on a partial group (`batch/partial_groups` 0), the
steps of metrics.jsonl are 1..N once each (the resumed run continues the first), no process of the run is left (by
session: each started process leads its own), every port is free, the children's temporary folder (their TMPDIR)
is empty, and the trainer's RSS at the end of each of its two lives is within the bound of its start. Printed: the
faults by kind, the steps lost to them, peak RSS at start and end; the last line is one JSON object.
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import httpx
import yaml

from .env import cpu_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(ROOT, "configs", "tiny_arith_grpo.yaml")
KINDS = ("rollout_server", "reward_worker", "reward_server")
# the trainer's RSS at the end of a life may exceed its start by this share or this many MiB, the larger
RSS_BOUND_SHARE, RSS_BOUND_MB = 0.10, 64.0
GROUP_KEYS = ("batch/groups_drawn", "batch/groups_trained", "batch/groups_dropped_reward_skipped",
              "batch/groups_dropped_unselected", "batch/partial_groups")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def session_members(sessions) -> List[dict]:
    """Live processes (zombies left out) whose session is one of `sessions`: [{pid, session, state, cmd}]."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="utf-8", errors="replace") as f:
                text = f.read()
            fields = text[text.rindex(")") + 2:].split()
            state, session = fields[0], int(fields[3])
            if session not in sessions or state in "ZX":
                continue
            pid = int(stat.split("/")[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append({"pid": pid, "session": session, "state": state, "cmd": cmd[:200]})
        except (OSError, ValueError, IndexError):
            continue   # gone meanwhile
    return out


def children(pid: int) -> List[int]:
    """The descendants of `pid` (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(path, encoding="utf-8") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def parent(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
        return int(text[text.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
        return text[text.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError):
        return False


def rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def read_metrics(path: str) -> List[dict]:
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass   # a line being written
    return rows


# ------------------------------------------------------------------------------------------------ the checks

def check_run(rows: List[dict], rollout_n: int, prompts_per_step: int) -> dict:
    """The invariants of a finished run's metrics.jsonl rows (step 0, an evaluation, left out): {"problems": [...],
    "steps", "groups": {drawn, trained, dropped_reward_skipped, dropped_unselected}, "steps_without_update"}.
    A problem is a sentence naming the step."""
    problems = []
    steps = [r.get("step") for r in rows if r.get("step", 0) > 0]
    if steps != list(range(1, len(steps) + 1)):
        repeated = sorted(s for s, count in Counter(steps).items() if count > 1)
        missing = sorted(set(range(1, max(steps or [0]) + 1)) - set(steps))
        problems.append(f"steps are not 1..{len(steps)} once each in order: repeated {repeated}, missing {missing}")
    totals = {k.split("/", 1)[1]: 0 for k in GROUP_KEYS}
    without_update = []
    for row in rows:
        step = row.get("step", 0)
        if step <= 0:
            continue
        absent = [k for k in GROUP_KEYS if k not in row]
        if absent:
            problems.append(f"step {step}: no {', '.join(absent)} in its record")
            continue
        drawn, trained, skipped, unselected, partial = (int(row[k]) for k in GROUP_KEYS)
        for key in GROUP_KEYS:
            totals[key.split("/", 1)[1]] += int(row[key])
        if drawn != prompts_per_step:
            problems.append(f"step {step}: {drawn} prompt groups drawn, the step's batch is {prompts_per_step}")
        if trained + skipped + unselected != drawn:
            problems.append(f"step {step}: {drawn} groups drawn but {trained} trained + {skipped} dropped (reward "
                            f"skipped) + {unselected} dropped (unselected) = {trained + skipped + unselected}")
        if partial:
            problems.append(f"step {step}: trained on {partial} partial group(s) (fewer than {rollout_n} samples)")
        if trained == 0 or row.get("actor/skipped_update"):
            without_update.append(step)
    groups = {k.replace("groups_", ""): v for k, v in totals.items() if k != "partial_groups"}
    return {"problems": problems, "steps": len(steps), "groups": groups, "partial_groups": totals["partial_groups"],
            "steps_without_update": without_update}


def rss_growth(samples: List[tuple]) -> dict:
    """samples [(seconds, rss MiB)] of one trainer process -> peak RSS over its first and last quarter (after the
    first sample: the model loading) and whether the end stays within the bound."""
    if len(samples) < 4:
        return {"start_mb": None, "end_mb": None, "within_bound": True, "samples": len(samples)}
    quarter = max(1, len(samples) // 4)
    start = max(r for _, r in samples[:quarter])
    end = max(r for _, r in samples[-quarter:])
    bound = start + max(RSS_BOUND_MB, RSS_BOUND_SHARE * start)
    return {"start_mb": round(start, 1), "end_mb": round(end, 1), "bound_mb": round(bound, 1),
            "within_bound": end <= bound, "samples": len(samples)}


def leftovers(sessions, ports, tmp_dir: str) -> dict:
    """What the run left: live processes of its sessions, ports that cannot be bound, entries of its TMPDIR."""
    entries = []
    for root, dirs, files in os.walk(tmp_dir):
        entries += [os.path.relpath(os.path.join(root, name), tmp_dir) for name in files + dirs]
    entries.sort()
    return {"processes": session_members(set(sessions)), "ports_busy": [p for p in ports if not port_free(p)],
            "tmp_entries": entries}


# ------------------------------------------------------------------------------------------------ the processes

@dataclass
class Proc:
    name: str
    cmd: List[str]
    log_path: str
    env: dict
    port: Optional[int] = None
    popen: Optional[subprocess.Popen] = None
    started_at: float = 0.0
    ready: bool = False
    sessions: List[int] = field(default_factory=list)
    lives: List[dict] = field(default_factory=list)   # per start: {"tmp": its TMPDIR, "killed": SIGKILLed}

    def start(self) -> None:
        log = open(self.log_path, "a", encoding="utf-8")
        log.write(f"\n---- {time.strftime('%H:%M:%S')} start: {' '.join(self.cmd)}\n")
        log.flush()
        # a TMPDIR of its own per start: what a process that ended normally left is told apart from what a
        # SIGKILLed one could not remove
        tmp = os.path.join(self.env["TMPDIR"], f"{self.name}.{len(self.lives)}")
        os.makedirs(tmp)
        self.lives.append({"tmp": tmp, "killed": False})
        # a session of its own: its descendants are found by session id, and kill -9 takes the whole group
        self.popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(self.env, TMPDIR=tmp),
                                      cwd=ROOT, start_new_session=True)
        log.close()
        self.sessions.append(self.popen.pid)
        self.started_at, self.ready = time.monotonic(), False

    @property
    def pid(self) -> Optional[int]:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        if not self.alive():
            return False
        try:
            return httpx.get(self.url() + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        if self.alive():
            self.lives[-1]["killed"] = True
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen is not None:
            self.popen.wait()
        self.ready = False

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, as a user stops a server; SIGKILL after `timeout`. The exit status."""
        if self.popen is None:
            return None
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.popen.returncode

    def tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""


def plan_faults(seed: int, seconds: float, interval: float, trainer_kill_at: float) -> List[dict]:
    """The chaos schedule: [{"at" (seconds from the start), "kind", "target" (rollout server index), "down_s"}],
    one fault of each kind in turn (shuffled per round) every `interval` seconds (+-50%), and the trainer's kill."""
    rng = random.Random(seed)
    events, t, cycle = [], interval * rng.uniform(0.5, 1.0), []
    while t < seconds - interval / 2:
        if not cycle:
            cycle = list(KINDS)
            rng.shuffle(cycle)
        kind = cycle.pop()
        event = {"at": round(t, 1), "kind": kind, "target": rng.randrange(2) if kind == "rollout_server" else 0,
                 # down time before the restart: a reward server's may outlast its client's retries
                 "down_s": round(rng.uniform(0.0, 20.0 if kind == "reward_server" else 10.0), 1)}
        events.append(event)
        t += interval * rng.uniform(0.5, 1.5)
    events.append({"at": round(trainer_kill_at, 1), "kind": "trainer", "target": 0, "down_s": 0.0})
    return sorted(events, key=lambda e: e["at"])


class Soak:
    def __init__(self, minutes: float, seed: int, interval: float, work: str, prompts: int, save_steps: int,
                 extra: Optional[dict] = None, log=print):
        self.seconds, self.seed, self.work, self.log = minutes * 60.0, seed, work, log
        self.tmp = os.path.join(work, "tmp")      # the children's TMPDIR: empty at the end
        self.out = os.path.join(work, "out")
        os.makedirs(self.tmp)
        with open(TINY_CONFIG, encoding="utf-8") as f:
            base = yaml.safe_load(f)
        for key in ("actor_model_name_or_path", "train_datasets", "eval_datasets"):
            base[key] = os.path.join(ROOT, base[key])
        self.ports = {"reward": free_port(), "rollout": [free_port(), free_port()]}
        self.config = dict(base, **{
            "output_dir": self.out, "logging_dir": os.path.join(self.out, "logs"), "seed": seed,
            "global_batch_size": prompts, "global_mini_batch_size": prompts, "max_steps": 100000,
            "lr_scheduler_type": "constant", "do_eval": False, "save_steps": save_steps, "save_total_limit": 2,
            "disable_tqdm": True, "logging_steps": 1,
            "rollout_server_urls": [f"http://127.0.0.1:{p}" for p in self.ports["rollout"]],
            "rollout_server_timeout": 300.0,
            "use_rm_server": True, "reward_funcs": base["reward_funcs"],
            "reward_server": f"http://127.0.0.1:{self.ports['reward']}", "reward_server_retries": 5,
            "reward_server_backoff": 1.0, "reward_server_timeout": 60.0, "reward_server_on_failure": "skip"},
            **(extra or {}))
        self.config_path = os.path.join(work, "soak.yaml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.config, f)
        env = {**os.environ, "TMPDIR": self.tmp, "PADDLE_RL_ROLLOUT_API_KEY": "", "PADDLE_RL_REWARD_API_KEY": ""}
        server_env = {**env, "OMP_NUM_THREADS": "1"}   # two rollout servers and the trainer share the cores
        py = [sys.executable, "-m", "paddle_rl"]
        self.reward = Proc("reward_server", py + ["reward-server", "--config", self.config_path, "--port",
                                                  str(self.ports["reward"]), "--workers", "2", "--log-level",
                                                  "warning"], os.path.join(work, "reward_server.log"), env,
                           self.ports["reward"])
        self.rollout = [Proc(f"rollout_server_{i}", py + ["rollout-server", self.config_path, "--port", str(port),
                                                          "--log-level", "warning"],
                             os.path.join(work, f"rollout_server_{i}.log"), server_env, port)
                        for i, port in enumerate(self.ports["rollout"])]
        self.trainer = Proc("trainer", py + ["train", self.config_path], os.path.join(work, "trainer.log"), env)
        self.events = plan_faults(seed, self.seconds, interval, 0.5 * self.seconds)
        self.done: List[dict] = []
        self.rss: List[List[tuple]] = [[]]          # per life of the trainer: [(seconds, MiB)]
        self.kill_record: Optional[dict] = None
        self.restarts: List[tuple] = []             # (due time, Proc)
        self.orphan_watch: List[tuple] = []         # (fault record, pids, kill time): a killed server's children

    # -------------------------------------------------------------------------------------------- helpers
    def now(self) -> float:
        return time.monotonic() - self.t0

    def metrics(self) -> List[dict]:
        return read_metrics(os.path.join(self.out, "metrics.jsonl"))

    def last_step(self) -> int:
        rows = self.metrics()
        return max((r.get("step", 0) for r in rows), default=0)

    def checkpoints(self) -> List[int]:
        steps = []
        for path in glob.glob(os.path.join(self.out, "checkpoint-*")):
            if os.path.exists(os.path.join(path, "trainer_state.json")):
                steps.append(int(path.rsplit("-", 1)[1]))
        return sorted(steps)

    def wait_healthy(self, procs, limit: float = 600.0) -> None:
        deadline = time.monotonic() + limit
        for proc in procs:
            while not proc.healthy():
                if not proc.alive():
                    raise RuntimeError(f"soak: {proc.name} exited ({proc.popen.returncode}) while starting:\n"
                                       f"{proc.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"soak: {proc.name} did not answer /health in {limit:g} s:\n{proc.tail()}")
                time.sleep(0.5)
            proc.ready = True

    def servers_ready(self) -> bool:
        for proc in [self.reward] + self.rollout:
            if not proc.ready:
                if proc.alive() and proc.healthy():
                    proc.ready = True
                    self.log(f"[{self.now():7.1f}s] {proc.name} answers again")
                else:
                    return False
        return True

    def trainer_running(self) -> bool:
        """The trainer is past its start-up (a step of this life is logged: metrics.jsonl written since it started,
        past the step it resumed from): faults may hit its servers, which it needs to answer while it starts."""
        path = os.path.join(self.out, "metrics.jsonl")
        return self.trainer.alive() and os.path.exists(path) and os.path.getmtime(path) > self.trainer_wall_start \
            and self.last_step() > self.life_first_step

    # -------------------------------------------------------------------------------------------- faults
    def fire(self, event: dict) -> None:
        kind, t = event["kind"], self.now()
        record = dict(event, fired_at=round(t, 1), step=self.last_step())
        if kind == "rollout_server":
            proc = self.rollout[event["target"]]
            proc.kill9()
            self.restarts.append((time.monotonic() + event["down_s"], proc))
        elif kind == "reward_server":
            proc = self.reward
            # its children (forkserver, resource tracker, workers) leave by themselves once it is gone: how long
            # they took is recorded (`children_gone_s`); one still there at the end is a process left behind
            self.orphan_watch.append((record, children(proc.pid), time.monotonic()))
            proc.kill9()
            self.restarts.append((time.monotonic() + event["down_s"], proc))
        elif kind == "reward_worker":
            # the scoring workers: the children of the server's forkserver (its grandchildren; the forkserver and
            # the resource tracker are its children)
            server = self.reward.pid
            workers = [k for k in children(server) if parent(k) not in (server, None)]
            if not workers:
                record["skipped"] = "no worker found"
            else:
                victim = random.Random(self.seed + len(self.done)).choice(workers)
                record["pid"] = victim
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    record["skipped"] = "the worker was gone"
        elif kind == "trainer":
            before = self.last_step()
            checkpoint = max(self.checkpoints() or [0])
            self.trainer.kill9()
            record.update(last_logged_step=before, checkpoint=checkpoint)
            self.kill_record = record
        self.done.append(record)
        self.log(f"[{t:7.1f}s] fault {kind}" + (f" #{event['target']}" if kind == "rollout_server" else "") +
                 f" at step {record['step']}" + (f" (restart in {event['down_s']:g} s)" if kind in
                                                 ("rollout_server", "reward_server") else "") +
                 (f": {record['skipped']}" if "skipped" in record else ""))

    def resume_trainer(self) -> None:
        """The trainer's second life: the same command with resume_from_checkpoint auto and the max_steps that ends
        it about at the deadline (from the first life's step rate)."""
        self.wait_healthy([self.reward] + self.rollout)
        rows = [r for r in self.metrics() if r.get("step", 0) > 0]
        rate = len(rows) / max(self.kill_record["fired_at"] - self.first_step_at, 1.0)   # steps a second
        checkpoint = self.kill_record["checkpoint"]
        # the resume itself (loading, start-up) takes about what the first life's start took
        remaining = self.seconds - self.now() - self.startup_s
        self.max_steps = checkpoint + max(2, int(rate * max(remaining, 0.0)))
        self.trainer.cmd = self.trainer.cmd[:5] + ["resume_from_checkpoint=auto", f"max_steps={self.max_steps}"]
        self.rss.append([])
        self.life_first_step = checkpoint
        self.trainer_wall_start = time.time()
        self.trainer.start()
        self.log(f"[{self.now():7.1f}s] trainer resumed from checkpoint-{checkpoint} to max_steps {self.max_steps} "
                 f"({rate * 60:.1f} steps a minute in its first life)")

    # -------------------------------------------------------------------------------------------- the run
    def run(self) -> dict:
        self.t0 = time.monotonic()
        self.life_first_step, self.first_step_at, self.max_steps = 0, None, None
        self.log(f"soak: {self.seconds / 60:g} min, seed {self.seed}, work folder {self.work}")
        self.log("soak: fault schedule (seconds from the start; each waits while the trainer starts or its target is "
                 "down):")
        for e in self.events:
            self.log(f"  {e['at']:7.1f}  {e['kind']}" + (f" #{e['target']}" if e["kind"] == "rollout_server" else "")
                     + (f", down {e['down_s']:g} s" if e["kind"] != "trainer" else ""))
        for proc in [self.reward] + self.rollout:
            proc.start()
        self.wait_healthy([self.reward] + self.rollout)
        self.trainer_wall_start = time.time()
        self.trainer.start()
        # the schedule counts from the trainer's first step (start-up is not soak time)
        pending = list(self.events)
        status = None
        while True:
            time.sleep(1.0)
            if self.first_step_at is None:
                if self.last_step() > 0:
                    self.startup_s = time.monotonic() - self.trainer.started_at
                    self.t0 = time.monotonic()        # the clock starts at the first step
                    self.first_step_at = 0.0
                    self.log(f"[{0.0:7.1f}s] first step logged: the schedule starts")
                elif not self.trainer.alive():
                    status = self.trainer.popen.returncode
                    break
                else:
                    continue
            if self.trainer_running():   # past its start-up: the steps' memory
                value = rss_mb(self.trainer.pid)
                if value is not None:
                    self.rss[-1].append((self.now(), value))
            for watched in list(self.orphan_watch):
                record, pids, killed = watched
                if not any(alive(p) for p in pids):
                    record["children_gone_s"] = round(time.monotonic() - killed, 1)
                    self.orphan_watch.remove(watched)
            for due, proc in list(self.restarts):
                if time.monotonic() >= due:
                    self.restarts.remove((due, proc))
                    proc.start()
                    self.log(f"[{self.now():7.1f}s] {proc.name} restarted")
            if not self.trainer.alive():
                if self.kill_record is not None and len(self.rss) == 1:
                    self.resume_trainer()
                    continue
                status = self.trainer.popen.returncode
                break
            if pending and pending[0]["at"] <= self.now() and self.trainer_running() and self.servers_ready() \
                    and not self.restarts and (pending[0]["kind"] != "trainer" or self.checkpoints()):
                self.fire(pending.pop(0))
            if self.now() > self.seconds + 900:
                self.log("soak: the trainer runs 15 min past the deadline: stopped")
                self.trainer.kill9()
                status = "overran"
                break
        return self.finish(status, pending)

    def finish(self, status, pending) -> dict:
        stopped = {p.name: p.stop() for p in [self.reward] + self.rollout}
        time.sleep(2.0)
        procs = [self.reward, self.trainer] + self.rollout
        sessions = [s for p in procs for s in p.sessions]
        # what SIGKILLed processes could not remove from their TMPDIR (multiprocessing's pymp-* folder): counted,
        # then removed as their supervisor would; every other process must have left its own empty
        killed_left, stopped_left = {}, {}
        for life in (life for p in procs for life in p.lives):
            entries = sorted(os.listdir(life["tmp"]))
            if life["killed"]:
                if entries:
                    killed_left[os.path.basename(life["tmp"])] = entries
                shutil.rmtree(life["tmp"])
            elif entries:
                stopped_left[os.path.basename(life["tmp"])] = entries
            else:
                os.rmdir(life["tmp"])
        left = leftovers(sessions, [self.ports["reward"]] + self.ports["rollout"], self.tmp)
        rows = self.metrics()
        checked = check_run(rows, self.config["rollout_n"], self.config["global_batch_size"])
        lives = [rss_growth(samples) for samples in self.rss]
        faults: Dict[str, int] = {}
        for record in self.done:
            if "skipped" not in record:
                faults[record["kind"]] = faults.get(record["kind"], 0) + 1
        redone = 0 if self.kill_record is None else self.kill_record["last_logged_step"] - \
            self.kill_record["checkpoint"]
        rows = [r for r in rows if r.get("step", 0) > 0]
        problems = list(checked["problems"])
        if status != 0:
            problems.append(f"the trainer ended with {status!r}:\n{self.trainer.tail()}")
        if self.kill_record is None:
            problems.append("the trainer was never killed and resumed")
        elif self.max_steps is not None and checked["steps"] != self.max_steps:
            problems.append(f"metrics.jsonl ends at step {checked['steps']}, the resumed run's max_steps is "
                            f"{self.max_steps}")
        if left["processes"]:
            problems.append("processes left: " + "; ".join(f"{p['pid']} {p['cmd']}" for p in left["processes"]))
        if left["ports_busy"]:
            problems.append(f"ports still bound: {left['ports_busy']}")
        stray = [e for e in left["tmp_entries"] if e.split("/")[0] not in stopped_left]
        if stray:
            problems.append(f"files left in the children's TMPDIR outside their own folders: {stray[:20]}")
        for name, entries in stopped_left.items():
            problems.append(f"files left in its TMPDIR by {name}, which was not killed (ended by itself or by "
                            f"SIGTERM): {entries}")
        for life, growth in enumerate(lives, 1):
            if not growth["within_bound"]:
                problems.append(f"the trainer's RSS grew past the bound in life {life}: {growth}")
        result = {
            "soak_minutes": self.seconds / 60.0, "seed": self.seed, "machine": machine(),
            "faults": faults, "faults_total": sum(faults.values()), "faults_not_fired": len(pending),
            "steps": checked["steps"], "steps_redone_after_trainer_kill": redone,
            "steps_without_update": checked["steps_without_update"],
            "groups": checked["groups"], "partial_groups": checked["partial_groups"],
            "resent_groups": sum(r.get("rollout_server/resent_groups", 0.0) for r in rows),
            "rollout_servers_rejoined": sum(r.get("rollout_server/rejoined", 0.0) for r in rows),
            "rss_mb": lives, "rss_bound": f"end <= start + max({RSS_BOUND_MB:g} MiB, "
                                         f"{100 * RSS_BOUND_SHARE:g}% of start), per life of the trainer",
            "servers_stopped": stopped, "leftovers": left, "left_by_killed_processes": killed_left,
            "problems": problems, "ok": not problems,
            "reward_server_children_gone_s": [r["children_gone_s"] for r in self.done if "children_gone_s" in r],
            "schedule": self.done, "work": self.work}
        return result


def machine() -> dict:
    info = cpu_info()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return {"cpu_model": info["model"], "cpu_flags": [w for w in wanted if w in info["flags"]],
            "cores": len(os.sched_getaffinity(0))}


def report(result: dict) -> str:
    lines = [f"soak: {result['soak_minutes']:g} min on {result['machine']['cpu_model']} "
             f"({result['machine']['cores']} cores, {' '.join(result['machine']['cpu_flags'])}), seed {result['seed']}",
             f"  faults: {result['faults_total']} ("
             + ", ".join(f"{k} {v}" for k, v in sorted(result["faults"].items())) + ")"
             f"; not fired before the end: {result['faults_not_fired']}",
             f"  steps: {result['steps']}; redone after the trainer's kill: {result['steps_redone_after_trainer_kill']}"
             f"; steps without an update: {result['steps_without_update'] or 'none'}",
             "  prompt groups: " + ", ".join(f"{k} {v}" for k, v in result["groups"].items()) +
             f"; partial groups trained: {result['partial_groups']}; re-sent to the other rollout server: "
             f"{result['resent_groups']:g}; rollout servers rejoined: {result['rollout_servers_rejoined']:g}"]
    for life, growth in enumerate(result["rss_mb"], 1):
        lines.append(f"  trainer life {life}: peak RSS {growth['start_mb']} MiB at start, {growth['end_mb']} MiB at "
                     f"the end (bound {growth.get('bound_mb')} MiB)")
    left = result["leftovers"]
    lines.append(f"  left behind: {len(left['processes'])} processes, {len(left['ports_busy'])} bound ports, "
                 f"{len(left['tmp_entries'])} temporary files; by SIGKILLed processes (removed by the soak): "
                 + (", ".join(f"{k}: {' '.join(v)}" for k, v in result['left_by_killed_processes'].items())
                    or "nothing"))
    lines.append("  OK: every invariant holds" if result["ok"] else "  FAILED:\n    " +
                 "\n    ".join(result["problems"]))
    return "\n".join(lines)


def run_soak(minutes: float, seed: int = 0, interval: Optional[float] = None, prompts: int = 8, save_steps: int = 4,
             keep: bool = False, extra: Optional[dict] = None, log=print) -> dict:
    """The soak in a fresh work folder (removed at the end unless `keep` or a check failed)."""
    interval = interval or min(60.0, max(15.0, minutes * 60.0 / 30.0))
    work = tempfile.mkdtemp(prefix="paddle-rl-soak-")
    soak = Soak(minutes, seed, interval, work, prompts, save_steps, extra, log)
    try:
        result = soak.run()
    except BaseException:
        for proc in [soak.trainer, soak.reward] + soak.rollout:
            proc.kill9()
        raise
    if result["ok"] and not keep:
        shutil.rmtree(work, ignore_errors=True)
        result["work_removed"] = not os.path.exists(work)
    return result


def soak_main(args: argparse.Namespace) -> int:
    result = run_soak(args.soak, seed=args.seed, interval=args.soak_interval, keep=args.soak_keep,
                      log=lambda line: print(line, flush=True))
    print(report(result))
    print(json.dumps(result, sort_keys=True, default=str))
    sys.stdout.flush()
    return 0 if result["ok"] else 1

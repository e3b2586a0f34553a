"""A multi-process run never hangs on a dead or stuck rank: the watchdog of each rank stops it, naming the peer.

Started once per process by `build_topology` (after `init_parallel_env`, when there are several ranks). Every
collective of the project runs inside `watched(name, group)`, which records what this rank waits in. A daemon
thread wakes every POLL_SECONDS and stops the rank (message on stderr, exit status 1) when:

- a collective has not returned after `collective_timeout` seconds (a peer alive but stuck, e.g. stopped with
  SIGSTOP, or waiting in a different collective): the message names the collective, its ranks, the step and
  stage, and the state of the peer processes;
- a peer process on this host has exited (killed, crashed) and this rank, PEER_EXIT_GRACE seconds later, has
  not left the run itself (every rank raising the same error exits on its own, with its own traceback);
- its launcher (`paddle.distributed.launch`, this process's parent) is gone, e.g. killed with SIGKILL.

A collective that raises (gloo: `Connection reset by peer` when a peer died, or gloo's own fixed 30-second
TIMEOUT) stops the rank at once the same way, with the error, and SIGTERM (what `paddle.distributed.launch` sends
every other rank once one has failed) prints the same diagnosis before the process exits (status 143).

Peer states come from /proc/PID/stat of the peers on this host (pids exchanged at start): running, stopped,
exited (with the signal or status while the launcher has not yet collected it), or gone. Peers on other hosts
are named but cannot be inspected from here. Nothing here runs in a single process (`watched` is then a no-op).
"""
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import List, Optional, Sequence

logger = logging.getLogger("paddle_rl")

DEFAULT_TIMEOUT = 1800.0   # seconds; paddle's own NCCL default (PADDLE_PG_TIMEOUT) and Hugging Face's ddp_timeout
POLL_SECONDS = 0.5
PEER_EXIT_GRACE = 5.0      # seconds a rank may take to exit on its own after a peer exited
EXIT_STATUS = 1
PREFIX = "paddle_rl watchdog:"

_WATCHDOG: Optional["Watchdog"] = None


# ------------------------------------------------------------------------------------------ peer processes

def process_state(pid: int) -> str:
    """`running`, `stopped (SIGSTOP or a debugger)`, `exited (killed by SIGKILL)`, `exited (status N)` (a zombie
    its parent has not collected yet) or `gone`."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "gone"
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass
        return "running"
    state = fields[0]
    if state in ("T", "t"):
        return "stopped (SIGSTOP or a debugger)"
    if state in ("Z", "X"):
        code = int(fields[49]) if len(fields) > 49 else None  # field 52, exit_code, as waitpid reports it
        if code is None:
            return "exited"
        if code & 0x7F:
            try:
                name = signal.Signals(code & 0x7F).name
            except ValueError:
                name = f"signal {code & 0x7F}"
            return f"exited (killed by {name})"
        return f"exited (status {code >> 8})"
    return "running"


def _is_launcher(pid: int) -> bool:
    """Whether `pid` runs paddle.distributed.launch (a rank whose launcher is gone stops; a rank started some
    other way may outlive its parent)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"paddle.distributed.launch" in f.read()
    except OSError:
        return False


def _alive(state: str) -> bool:
    return state == "running"


def _exited(state: str) -> bool:
    """A peer's process that is no more (not: running, stopped, or not checked: on another host)."""
    return state == "gone" or state.startswith("exited")


class Watchdog:
    def __init__(self, rank: int, peers: Sequence[tuple], timeout: float, poll: float = POLL_SECONDS):
        """peers: (host, pid, parent pid) of every rank, in rank order."""
        self.rank = rank
        self.peers = list(peers)
        self.timeout = float(timeout)
        self.poll = poll
        self.host = socket.gethostname()
        self.parent = os.getppid() if _is_launcher(os.getppid()) else None
        self.where = "start-up"
        self.pending: Optional[List] = None   # [name, ranks, monotonic start]
        self.depth = 0
        self.left = False                     # this rank finished or is raising: peers exiting are expected
        self.exited_since = {}                # rank -> monotonic time its exit was first seen
        self._lock = threading.RLock()  # a SIGTERM handler may run while the main thread is in _stop
        self._thread = threading.Thread(target=self._run, name="paddle_rl-watchdog", daemon=True)

    # -------------------------------------------------------------------- main thread
    def start(self) -> None:
        self._thread.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def enter(self, name: str, ranks) -> None:
        if self.depth == 0:
            self.pending = [name, ranks, time.monotonic()]
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth <= 0:
            self.depth = 0
            self.pending = None

    def failed(self, name: str, ranks, error: BaseException) -> None:
        """A collective raised: the communicator is broken, this rank stops (does not return)."""
        deadline = time.monotonic() + 2.0  # a peer that closed its sockets is about to show as exited
        while time.monotonic() < deadline and all(_alive(s) for _, s in self._peer_states(ranks)):
            time.sleep(0.1)
        detail = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        self._stop(f"{self._waiting_in(name, ranks)} failed ({self.where}): {type(error).__name__}: "
                   f"{_one_line(error)}", ranks, detail=detail)

    # -------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            time.sleep(self.poll)
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the watchdog must never take a healthy run down by itself
                logger.exception("%s check failed", PREFIX)

    def _check(self) -> None:
        now = time.monotonic()
        pending = self.pending
        if pending is not None and now - pending[2] > self.timeout:
            name, ranks, start = pending
            self._stop(f"{self._waiting_in(name, ranks)} has not returned after {now - start:.0f} s "
                       f"(collective_timeout: {self.timeout:g}) ({self.where})", ranks, stacks=True)
        if self.parent is not None and os.getppid() != self.parent:
            self._stop(f"its launcher (paddle.distributed.launch, pid {self.parent}) is gone ({self.where})", None)
        if self.left:
            return
        for rank, state in self._peer_states(None):
            if not _exited(state):
                continue
            first = self.exited_since.setdefault(rank, now)
            if now - first >= PEER_EXIT_GRACE:
                waiting = f", waiting in {self._waiting_in(*pending[:2])}" if pending else ""
                self._stop(f"rank {rank} {self._pid_text(rank)} {'is gone' if state == 'gone' else state} "
                           f"({self.where}{waiting})", None)

    def _on_sigterm(self, signum, frame) -> None:
        self._stop(f"terminated by SIGTERM ({self.where}); paddle.distributed.launch sends it to every rank once "
                   "one has failed", None, status=128 + signal.SIGTERM)

    # -------------------------------------------------------------------- messages
    def _pid_text(self, rank: int) -> str:
        host, pid, _ = self.peers[rank]
        return f"(pid {pid})" if host == self.host else f"(pid {pid} on {host})"

    def _waiting_in(self, name: str, ranks) -> str:
        return f"{name} over ranks {list(ranks)}" if ranks else name

    def _peer_states(self, ranks):
        out = []
        for rank, (host, pid, _) in enumerate(self.peers):
            if rank == self.rank or (ranks and rank not in ranks):
                continue
            out.append((rank, process_state(pid) if host == self.host else "not checked (another host)"))
        return out

    def describe_peers(self, ranks=None) -> str:
        states = self._peer_states(None)
        shown = [(r, s) for r, s in states if not _alive(s) or (ranks and r in ranks and len(states) <= 8)]
        running = len(states) - len(shown)
        parts = [f"rank {r} {self._pid_text(r)}: {s}" for r, s in shown]
        if running:
            parts.append(f"{running} other rank(s) running" if parts else "every other rank's process is running")
        return "; ".join(parts)

    def _stop(self, what: str, ranks, detail: str = "", stacks: bool = False, status: int = EXIT_STATUS) -> None:
        """Print why this rank stops and exit at once (never returns): the run cannot continue without its peer,
        and an interpreter shutdown could block in the broken communicator."""
        with self._lock:  # the first reason wins; a second caller waits here until the process is gone
            message = (f"{PREFIX} rank {self.rank} stops: {what}. Peers: {self.describe_peers(ranks)}. "
                       f"Exit status {status}.\n")
            try:
                sys.stdout.flush()
                if detail:
                    sys.stderr.write(detail)
                if stacks:
                    sys.stderr.write(f"{PREFIX} Python stacks of rank {self.rank}:\n")
                    sys.stderr.flush()
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.write(message)
                sys.stderr.flush()
            finally:
                os._exit(status)


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# ------------------------------------------------------------------------------------------ module interface

def start(rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> Optional[Watchdog]:
    """Start this process's watchdog (collective: every rank calls it once, after init_parallel_env). A second
    call only sets the timeout."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.timeout = float(timeout)
        return _WATCHDOG
    if world_size <= 1:
        return None
    import paddle.distributed as dist
    peers: list = []
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid(), os.getppid()))
    _WATCHDOG = Watchdog(rank, [tuple(p) for p in peers], timeout)
    _WATCHDOG.start()
    return _WATCHDOG


def note(where: str) -> None:
    """What this rank is doing (`step 3, update`), for the messages."""
    if _WATCHDOG is not None:
        _WATCHDOG.where = where


def leaving() -> None:
    """This rank is done or is raising an error: from now on a peer that exits is expected (collectives stay
    watched)."""
    if _WATCHDOG is not None:
        _WATCHDOG.left = True


class watched:
    """`with watched("all_reduce", group):` around every blocking collective (a no-op in one process)."""
    __slots__ = ("name", "ranks")

    def __init__(self, name: str, group=None, ranks=None):
        self.name = name
        self.ranks = ranks if ranks is not None else getattr(group, "ranks", None)

    def __enter__(self):
        if _WATCHDOG is not None:
            _WATCHDOG.enter(self.name, self.ranks)
        return self

    def __exit__(self, kind, error, tb):
        wd = _WATCHDOG
        if wd is None:
            return False
        wd.leave()
        if error is not None and isinstance(error, Exception):
            wd.failed(self.name, self.ranks, error)
        return False

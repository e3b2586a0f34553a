"""Run an untrusted Python program: a separate process with resource limits, an empty working folder, a scrubbed
environment, no network, and a wall-clock timeout; nothing of it outlives the call.

How (Linux):
- `unshare --net --pid --kill-child --mount-proc` puts the program in a new network namespace (only a loopback
  that is down: no connection leaves it, 127.0.0.1 included) and a new PID namespace with its own /proc (it sees
  no other process, so no other process's environment; when its first process exits, the kernel kills every
  process left in it: a fork bomb dies with it). As root the program then runs as `nobody`
  (`--setuid 65534`), so it cannot write outside its folder (owned by nobody) except into world-writable places,
  cannot read other users' files or processes' environments, and RLIMIT_NPROC applies; otherwise a user
  namespace (`--map-root-user`) gives the same network and PID isolation.
- resource limits (setrlimit, inherited by every child): CPU seconds, address space, file size (stdout and
  stderr go to files, so output past the limit kills the program with SIGXFSZ), processes, no core files.
- the environment holds only PATH, LANG and HOME (the working folder); Python starts isolated (`-I`: no user
  site, no PYTHON* variables, the script's folder not on sys.path beyond itself).
- the whole process group is killed at the end, on success too.

Where no network namespace can be made, `run_program` refuses (SandboxError) unless `allow_network` is set, and
then logs loudly that programs run with the host's network.
"""
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

logger = logging.getLogger("paddle_rl")

NOBODY = 65534
# what a run can end as (`RunResult.status`); a reward counts each
STATUSES = ("ok", "syntax_error", "runtime_error", "timeout", "memory", "output_too_large", "killed")


class SandboxError(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    output_mb: int = 16          # stdout + stderr, and any file the program writes
    processes: int = 32
    allow_network: bool = False


@dataclass
class RunResult:
    status: str                  # one of STATUSES
    stdout: str
    stderr: str
    returncode: Optional[int]
    seconds: float


@lru_cache(maxsize=None)
def isolation() -> Optional[tuple]:
    """(unshare command line, Python interpreter) this machine allows (tried once), or None. As root the program
    runs as nobody, with an interpreter nobody can execute (this one, else /usr/bin/python3)."""
    if shutil.which("unshare") is None:
        return None
    base = ("unshare", "--net", "--pid", "--kill-child", "--mount-proc")
    candidates = []
    if os.geteuid() == 0:
        as_nobody = base + ("--setuid", str(NOBODY), "--setgid", str(NOBODY))
        candidates += [(as_nobody, python) for python in dict.fromkeys((sys.executable, "/usr/bin/python3"))]
    candidates.append((("unshare", "--user", "--map-root-user") + base[1:], sys.executable))
    for prefix, python in candidates:
        try:
            done = subprocess.run([*prefix, python, "-I", "-c", "pass"], capture_output=True, timeout=30, cwd="/")
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            if os.geteuid() == 0 and "--setuid" not in prefix:
                logger.warning("sandbox: programs run as root inside a user namespace (no interpreter runs as "
                               "nobody here): they can write wherever root can")
            return prefix, python
    return None


def _limits(limits: SandboxLimits):
    def apply():
        os.setsid()  # its own process group: killed as a whole
        cpu = max(1, int(limits.cpu_seconds))
        for what, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                            (resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
                            (resource.RLIMIT_FSIZE, (limits.output_mb << 20,) * 2),
                            (resource.RLIMIT_NPROC, (limits.processes,) * 2),
                            (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(what, value)
    return apply


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run Python `code` with `stdin`; its status, output (truncated to the limit) and time."""
    try:
        compile(code, "main.py", "exec")
    except (SyntaxError, ValueError) as e:
        return RunResult("syntax_error", "", f"{type(e).__name__}: {e}", None, 0.0)
    found = isolation()
    if found is None:
        if not limits.allow_network:
            raise SandboxError("cannot create a network namespace here (unshare --net failed): refusing to run "
                               "generated code with network access; set sandbox_allow_network: true to run it anyway")
        logger.warning("sandbox: NO network isolation (sandbox_allow_network: true): generated programs can open "
                       "connections")
        found = ((), sys.executable)
    prefix, python = found
    work = tempfile.mkdtemp(prefix="paddle_rl_sandbox_")   # the program's folder (it runs in it)
    io = tempfile.mkdtemp(prefix="paddle_rl_sandbox_io_")  # its stdin / stdout / stderr files (not its to touch)
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if os.geteuid() == 0 and "--setuid" in prefix:
            os.chown(work, NOBODY, NOBODY)
            os.chmod(work, 0o700)
        with open(os.path.join(io, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work}
        start = time.monotonic()
        with open(os.path.join(io, "stdin"), "rb") as fin, open(os.path.join(io, "stdout"), "wb") as fout, \
                open(os.path.join(io, "stderr"), "wb") as ferr:
            cpu_before = _children_cpu()
            proc = subprocess.Popen([*prefix, python, "-I", "main.py"], cwd=work, env=env, stdin=fin,
                                    stdout=fout, stderr=ferr, preexec_fn=_limits(limits), close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        seconds = time.monotonic() - start
        cpu = _children_cpu() - cpu_before
        stdout, stderr = _read(os.path.join(io, "stdout"), limits), _read(os.path.join(io, "stderr"), limits)
        return RunResult(_status(proc.returncode, timed_out, stderr, cpu, limits), stdout, stderr,
                         proc.returncode, seconds)
    finally:
        shutil.rmtree(io, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: str, limits: SandboxLimits) -> str:
    with open(path, "rb") as f:
        return f.read(limits.output_mb << 20).decode("utf-8", errors="replace")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _status(returncode, timed_out: bool, stderr: str, cpu: float, limits: SandboxLimits) -> str:
    """What a finished run ended as. Python ignores SIGXFSZ: past the file-size limit its write fails with
    "File too large"; past the CPU limit the kernel stops it (SIGXCPU, then SIGKILL)."""
    if timed_out or cpu >= limits.cpu_seconds - 0.05:
        return "timeout"
    if returncode == 0:
        return "ok"
    tail = stderr[-4000:]
    if returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in tail:
        return "output_too_large"
    if "MemoryError" in tail:
        return "memory"
    if returncode < 0 or returncode > 128:
        return "killed"
    return "runtime_error"

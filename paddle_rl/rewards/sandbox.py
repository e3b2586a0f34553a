"""Run an untrusted Python program (from a policy, a dataset, a tool call) in bubblewrap: namespaces and a file
system of its own, a total memory and process bound, a wall-clock timeout; nothing of it outlives the run.

How (Linux, `bwrap` from Debian's `bubblewrap` package, the sandbox Flatpak builds on):
- namespaces: new PID (its own /proc: no other process is visible), network (only a loopback that is down: no
  connection leaves it, 127.0.0.1 and host Unix sockets included), IPC (its own System V / POSIX message queues),
  UTS, and mount namespace. `--die-with-parent`: when the caller dies (SIGKILL included), bwrap and everything in
  the sandbox die with it; when the sandbox's first process ends, the kernel kills the rest.
- files: a read-only view of /usr and of the interpreter's own prefix; a private writable folder (the working
  folder, /sandbox), /tmp and /dev/shm, each a tmpfs of `output_mb` that vanishes with the mount namespace: no
  file of the program is left on disk or in memory. The host's /tmp, /var, /etc, /home, /root, the repository,
  checkpoints and sockets are not in its view.
- user: as root, bwrap sets the sandbox up and the harness (harness.py) drops to `nobody` (65534) before the
  program runs, with no capabilities and no_new_privs; as an ordinary user, bwrap runs in a user namespace as uid
  65534 without capabilities.
- memory and processes: `memory_mb` bounds the whole sandbox (all its processes and its tmpfs files) through a
  cgroup (v2 where writable, else v1's memory and pids controllers) as root; without a writable cgroup, each process
  has `memory_mb` of address space and a watchdog sums the resident memory of the sandbox's processes every 20 ms
  and kills the sandbox past `memory_mb` (a bound checked, not enforced by the kernel: `isolation().memory` says
  which applies). Processes: the pids controller, else RLIMIT_NPROC set inside the sandbox. CPU seconds, file size
  and core files by rlimits.
- the environment holds PATH, LANG and HOME only; Python runs isolated (`-I`).
- outputs: stdout / stderr go to unlinked temporary files of the caller (nothing to clean up if it is killed).

A test's outcome comes only from the harness's verdict line, written after the test with a marker the program is
not given (harness.py): an early exit of any kind is a failure.

Where bubblewrap is missing or cannot make its namespaces, `run_program` refuses (SandboxError naming what is
missing) unless `allow_unisolated` (`sandbox_allow_unisolated: true`) is set: then programs run as the caller,
with rlimits only, and a warning says so once. `allow_network` (`sandbox_allow_network: true`) shares the host's
network namespace and nothing else.
"""
import json
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from itertools import count
from typing import Optional

logger = logging.getLogger("paddle_rl")

NOBODY = 65534
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
# what a run can end as (`RunResult.status`); a reward counts each
STATUSES = ("ok", "syntax_error", "runtime_error", "timeout", "memory", "output_too_large", "killed", "early_exit",
            "bad_type")
CGROUP_PREFIX = "paddle_rl_sandbox_"
WATCH_SECONDS = 0.02


class SandboxError(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024        # all processes of a run together (see the module's docstring for how)
    output_mb: int = 16          # stdout + stderr, any one file, and each of /sandbox, /tmp, /dev/shm
    processes: int = 32
    allow_network: bool = False
    allow_unisolated: bool = False


@dataclass
class RunResult:
    status: str                  # one of STATUSES
    stdout: str
    stderr: str
    returncode: Optional[int]
    seconds: float
    verdict: Optional[dict] = None   # the harness's verdict of a test run (None: none was written)


@dataclass(frozen=True)
class Isolation:
    """How this machine isolates programs (`isolation()`)."""
    bwrap: str
    python: str                  # the interpreter, at the same path inside
    binds: tuple                 # host folders bound read-only at the same path
    as_root: bool                # bwrap set up as root, the harness drops to nobody
    cgroup: Optional[str]        # "v2" | "v1" | None
    memory: str                  # how memory_mb bounds the sandbox, in words


_problem = ""   # why isolation() found none


def isolation_problem() -> str:
    isolation()
    return _problem


def require_isolation(key: str = "sandbox_allow_unisolated") -> Isolation:
    """The machine's isolation, or SandboxError naming what is missing and `key`."""
    found = isolation()
    if found is None:
        raise SandboxError(f"cannot isolate untrusted programs here: {_problem}. Install bubblewrap (Debian / "
                           f"Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), or set {key}: true "
                           f"to run them as this user with rlimits only (no file-system, network or process "
                           f"isolation: only for programs you trust)")
    return found


def _python_binds(python: str) -> tuple:
    """The folders an interpreter needs: its prefix (and a venv's base), unless already under /usr."""
    paths = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(python))))):
        prefix = os.path.realpath(prefix)
        if not prefix.startswith("/usr/") and prefix != "/usr" and os.path.isdir(prefix):
            paths.append(prefix)
    return tuple(dict.fromkeys(paths))


@lru_cache(maxsize=None)
def isolation() -> Optional[Isolation]:
    """This machine's isolation (tried once: a trivial program through the whole command), or None (the reason:
    isolation_problem())."""
    global _problem
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        _problem = "bubblewrap (bwrap) is not installed"
        return None
    as_root = os.geteuid() == 0
    cgroup = _Cgroup.usable() if as_root else None
    memory = (f"cgroup {cgroup}: the kernel bounds all processes and tmpfs files of a run together" if cgroup else
              "no writable cgroup: address space per process, and a watchdog that sums the resident memory of the "
              f"sandbox's processes every {WATCH_SECONDS * 1000:.0f} ms and kills it past the limit")
    tried = []
    for python in dict.fromkeys((os.path.realpath(sys.executable), "/usr/bin/python3")):
        if not os.path.isfile(python):
            continue
        found = Isolation(bwrap, python, _python_binds(python), as_root, cgroup, memory)
        try:
            result = _run(found, "print(6 * 7)", "", SandboxLimits(wall_seconds=30, cpu_seconds=30), None)
        except OSError as e:
            tried.append(f"{python}: {e}")
            continue
        if result.status == "ok" and result.stdout.strip() == "42":
            _problem = ""
            return found
        tried.append(f"{python}: {result.status} {result.stderr.strip()[-300:]}")
    _problem = "bubblewrap cannot start a sandbox here (" + "; ".join(tried) + ")"
    return None


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
                test: Optional[dict] = None) -> RunResult:
    """Run Python `code` with `stdin`; its status, output (truncated to the limit) and time. With `test` (harness.py:
    {"code": test source} or {"call": function name, "args": [...]}) the harness runs it after the program and
    `RunResult.verdict` is its outcome."""
    try:
        compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        return RunResult("syntax_error", "", f"{type(e).__name__}: {e}", None, 0.0)
    found = isolation()
    if found is None:
        if not limits.allow_unisolated:
            require_isolation()
        _warn_unisolated()
    return _run(found, code, stdin, limits, test)


@lru_cache(maxsize=None)
def _warn_unisolated():
    logger.warning("sandbox: programs run WITHOUT isolation (sandbox_allow_unisolated: true; %s): they run as this "
                   "user and can read and write what it can and open connections", _problem)


def _command(found: Optional[Isolation], limits: SandboxLimits, fds: tuple) -> list:
    """The command line; `fds`: the harness's (verdict, marker, spec) descriptors, inherited at these numbers."""
    python = found.python if found else sys.executable
    harness = [python, "-I", "main.py", ",".join(map(str, fds))]
    if found is None:
        return harness
    return view(found, limits) + ["--ro-bind", HARNESS, "/sandbox/main.py", "--chdir", "/sandbox", "--clearenv",
                                  "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
                                  "--setenv", "HOME", "/sandbox", "--", *harness]


def _parents(path: str) -> list:
    """bwrap arguments making the folders above `path` (0755, so that nobody can pass through them)."""
    parents = []
    parent = os.path.dirname(path)
    while parent not in ("/", ""):
        parents.append(parent)
        parent = os.path.dirname(parent)
    out = []
    for parent in reversed(parents):
        out += ["--perms", "0755", "--dir", parent]
    return out


def view(found: Isolation, limits: SandboxLimits, ro_binds=(), sockets=()) -> list:
    """bwrap and its arguments up to the sandbox's own (working folder, environment, command): the namespaces, the
    read-only system and interpreter, /proc, /dev, the private tmpfs folders /tmp, /dev/shm and /sandbox;
    `ro_binds`: more host paths bound read-only at the same path; `sockets`: (host Unix socket, path inside) pairs,
    the only way out of a sandbox without network."""
    size = str(limits.output_mb << 20)
    cmd = [found.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not limits.allow_network:
        cmd.append("--unshare-net")
    if found.as_root:  # the harness switches to nobody before the program runs, then holds no capability
        cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"]
    else:
        cmd += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    cmd += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "lib32", "sbin"):
        path = "/" + top
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    for path in found.binds:
        cmd += _parents(path) + ["--ro-bind", path, path]
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev"]
    for path in ("/tmp", "/dev/shm", "/sandbox"):
        cmd += ["--perms", "01777", "--size", size, "--tmpfs", path]
    for path in ro_binds:   # after the tmpfs folders: a path under /tmp is bound into the private /tmp
        cmd += _parents(path) + ["--ro-bind", path, path]
    for host, inside in sockets:
        cmd += _parents(inside) + ["--ro-bind", host, inside]
    return cmd


_serial = count()


def _run(found: Optional[Isolation], code: str, stdin: str, limits: SandboxLimits, test: Optional[dict]) -> RunResult:
    marker = secrets.token_hex(16)
    spec = {"program": code, "test": test,
            "drop_to": NOBODY if found is not None and found.as_root else None,
            "nproc": None if found is not None and found.cgroup else (limits.processes if found else None)}
    cgroup = _Cgroup.make(found.cgroup, limits) if found is not None and found.cgroup else None
    work = None if found is not None else tempfile.mkdtemp(prefix="paddle_rl_unisolated_")
    if work is not None:
        shutil.copy(HARNESS, os.path.join(work, "main.py"))
    marker_r, marker_w = os.pipe()
    spec_r, spec_w = os.pipe()
    try:
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr, \
                tempfile.TemporaryFile() as fverdict:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            feeder = threading.Thread(target=_feed, args=(marker_w, marker.encode(), spec_w,
                                                          json.dumps(spec).encode()), daemon=True)
            feeder.start()
            start = time.monotonic()
            cpu_before = _children_cpu()
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work or "/sandbox"}
            fds = (fverdict.fileno(), marker_r, spec_r)
            proc = subprocess.Popen(_command(found, limits, fds), cwd=work or "/", env=env, stdin=fin, stdout=fout,
                                    stderr=ferr, close_fds=True, pass_fds=fds, preexec_fn=_child_setup(limits, cgroup))
            os.close(marker_r)
            os.close(spec_r)
            marker_r = spec_r = None
            watchdog = None
            if found is not None and cgroup is None:   # without a cgroup: the sum of its processes' memory
                watchdog = _SHARED_WATCHDOG.watch(proc.pid, limits.memory_mb)
            timer = _Deadline(proc.pid, limits.wall_seconds)   # a blocking wait: no polling delay
            try:
                proc.wait()
            finally:
                timer.cancel()
                _kill(proc, cgroup)
                if watchdog is not None:
                    _SHARED_WATCHDOG.forget(watchdog)
            timed_out = timer.fired
            feeder.join(timeout=5)
            seconds = time.monotonic() - start
            cpu = _children_cpu() - cpu_before
            stdout, stderr = _read(fout, limits), _read(ferr, limits)
            verdict = _verdict(fverdict, marker) if test is not None else None
        over_memory = (cgroup is not None and cgroup.oom_killed()) or (watchdog is not None and watchdog.fired)
        status = _status(proc.returncode, timed_out, stderr, cpu, limits, over_memory)
        if test is not None and status == "ok":
            status = "early_exit" if verdict is None else status
        return RunResult(status, stdout, stderr, proc.returncode, seconds, verdict)
    finally:
        for fd in (marker_r, spec_r):
            if fd is not None:
                os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


class SandboxedProcess:
    """A program started in the sandbox and left running with pipes to it, for a caller that talks to it while it
    runs (the agent environment): `command` is bwrap's whole command line (`view(...)` + the sandbox's own
    arguments). The same bounds as run_program's: the cgroup (or the memory watchdog), rlimits, its own process
    group. `kill()` ends every process of it; `close()` kills, waits and removes the cgroup, and says whether the
    memory bound was reached."""

    def __init__(self, found: Isolation, command: list, limits: SandboxLimits, pass_fds=()):
        self.cgroup = _Cgroup.make(found.cgroup, limits) if found.cgroup else None
        self.watchdog = None
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, cwd="/",
                                            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                                            close_fds=True, pass_fds=tuple(pass_fds),
                                            preexec_fn=_child_setup(limits, self.cgroup))
        except BaseException:
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        # the whole sandbox is killed at the bound: without a cgroup at the sum of its processes' memory; with
        # one at the kernel's first OOM kill (which ends one process only)
        self.watchdog = _SHARED_WATCHDOG.watch(self.process.pid, limits.memory_mb, self.cgroup)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> bool:
        """Kill what is left, wait, remove the cgroup; whether the run reached its memory bound."""
        self.kill()
        self.process.wait()
        if self.watchdog is not None:
            _SHARED_WATCHDOG.forget(self.watchdog)
        over = (self.cgroup is not None and self.cgroup.oom_killed()) or (self.watchdog is not None and
                                                                          self.watchdog.fired)
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()
        return over


class _Deadline:
    """Kills the run's process group at its wall-clock limit."""

    def __init__(self, pgid: int, seconds: float):
        self.pgid, self.fired = pgid, False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self):
        self.fired = True
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cancel(self):
        self.timer.cancel()


def _feed(marker_w: int, marker: bytes, spec_w: int, spec: bytes) -> None:
    """Writes the marker and the spec into their pipes (a spec past the pipe's buffer needs a reader) and closes them."""
    for fd, data in ((marker_w, marker), (spec_w, spec)):
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            pass
        finally:
            os.close(fd)


def _child_setup(limits: SandboxLimits, cgroup):
    """Runs in the child before bwrap: its own session, the cgroup, rlimits."""
    def setup():
        os.setsid()  # its own process group: killed as a whole
        if cgroup is not None:
            cgroup.attach(os.getpid())
        cpu = max(1, int(limits.cpu_seconds))
        for what, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                            (resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
                            (resource.RLIMIT_FSIZE, (limits.output_mb << 20,) * 2),
                            (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(what, value)
    return setup


def _verdict(f, marker: str) -> Optional[dict]:
    """The harness's verdict: the last line of fd 3 that starts with this run's marker."""
    f.seek(0)
    found = None
    for line in f.read(1 << 20).decode("utf-8", errors="replace").splitlines():
        head, _, body = line.partition(" ")
        if head == marker:
            try:
                found = json.loads(body)
            except ValueError:
                return None
    return found if isinstance(found, dict) else None


def _kill(proc, cgroup) -> None:
    """Every process of the run: bwrap's process group (the sandbox's first process dies with bwrap, and the kernel
    kills the rest of its PID namespace), then whatever is left in the cgroup."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if cgroup is not None:
        cgroup.kill()


def _read(f, limits: SandboxLimits) -> str:
    f.seek(0)
    return f.read(limits.output_mb << 20).decode("utf-8", errors="replace")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _status(returncode, timed_out: bool, stderr: str, cpu: float, limits: SandboxLimits, over_memory: bool) -> str:
    """What a finished run ended as. Python ignores SIGXFSZ: past the file-size limit its write fails with
    "File too large"; past the CPU limit the kernel stops it (SIGXCPU, then SIGKILL)."""
    if over_memory:
        return "memory"
    # the CPU limit: SIGXCPU (bwrap reports a child's signal as 128 + its number; the rusage of a grandchild that
    # bwrap's init reaped does not always reach this process)
    if timed_out or cpu >= limits.cpu_seconds - 0.05 or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
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


# ------------------------------------------------------------------------------------------------ memory bounds

def _own_cgroup_paths() -> dict:
    """{controller or "" for v2: this process's cgroup path}."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    paths[c] = path
    except OSError:
        pass
    return paths


def _mounts() -> dict:
    """{"v2": mount point, "memory": v1 mount point, "pids": v1 mount point} of the cgroup file systems."""
    found = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                if parts[2] == "cgroup2":
                    found.setdefault("v2", parts[1])
                elif parts[2] == "cgroup":
                    for c in ("memory", "pids"):
                        if c in parts[3].split(","):
                            found.setdefault(c, parts[1])
    except OSError:
        pass
    return found


class _Cgroup:
    """One run's cgroup(s): v2 (one folder: memory.max, memory.swap.max, pids.max) or v1 (memory and pids)."""
    _serial = count()

    def __init__(self, version: str, folders: dict):
        self.version, self.folders = version, folders

    @staticmethod
    def _parents() -> dict:
        mounts, own = _mounts(), _own_cgroup_paths()
        parents = {}
        if "v2" in mounts:
            parents["v2"] = {"": os.path.join(mounts["v2"], own.get("", "/").lstrip("/"))}
        if "memory" in mounts and "pids" in mounts:
            parents["v1"] = {c: os.path.join(mounts[c], own.get(c, "/").lstrip("/")) for c in ("memory", "pids")}
        return parents

    @classmethod
    def usable(cls) -> Optional[str]:
        for version in ("v2", "v1"):
            try:
                group = cls.make(version, SandboxLimits(memory_mb=64, processes=4))
            except OSError:
                continue
            group.remove()
            return version
        return None

    @classmethod
    def make(cls, version: str, limits: SandboxLimits) -> "_Cgroup":
        parents = cls._parents().get(version)
        if parents is None:
            raise OSError(f"no cgroup {version} hierarchy")
        _sweep_cgroups()
        name = f"{CGROUP_PREFIX}{os.getpid()}_{next(cls._serial)}"
        folders = {c: os.path.join(p, name) for c, p in parents.items()}
        group = cls(version, {})
        try:
            for c, folder in folders.items():
                os.mkdir(folder)
                group.folders[c] = folder
            memory = str(limits.memory_mb << 20)
            if version == "v2":
                folder = folders[""]
                _write(os.path.join(folder, "memory.max"), memory)
                if os.path.exists(os.path.join(folder, "memory.swap.max")):
                    _write(os.path.join(folder, "memory.swap.max"), "0")
                _write(os.path.join(folder, "pids.max"), str(limits.processes))
            else:
                _write(os.path.join(folders["memory"], "memory.limit_in_bytes"), memory)
                memsw = os.path.join(folders["memory"], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, memory)
                _write(os.path.join(folders["pids"], "pids.max"), str(limits.processes))
        except OSError:
            group.remove()
            raise
        return group

    def attach(self, pid: int) -> None:
        for folder in self.folders.values():
            _write(os.path.join(folder, "cgroup.procs"), str(pid))

    def _pids(self) -> list:
        pids = set()
        for folder in self.folders.values():
            try:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    pids.update(int(p) for p in f.read().split())
            except OSError:
                pass
        return sorted(pids)

    def kill(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = self._pids()
            if not pids:
                return
            kill_file = os.path.join(self.folders.get("", ""), "cgroup.kill")
            if self.version == "v2" and os.path.exists(kill_file):
                _write(kill_file, "1")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def oom_kills(self) -> int:
        """Processes the kernel has killed for reaching the memory bound (0 where it cannot be read)."""
        try:
            name = "memory.events" if self.version == "v2" else "memory.oom_control"
            with open(os.path.join(self.folders["" if self.version == "v2" else "memory"], name)) as f:
                return int(dict(line.split() for line in f if line.strip()).get("oom_kill", 0))
        except (OSError, ValueError, KeyError):
            return 0

    def oom_killed(self) -> bool:
        try:
            if self.version == "v2":
                with open(os.path.join(self.folders[""], "memory.events")) as f:
                    events = dict(line.split() for line in f if line.strip())
                return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
            with open(os.path.join(self.folders["memory"], "memory.oom_control")) as f:
                control = dict(line.split() for line in f if line.strip())
            with open(os.path.join(self.folders["memory"], "memory.failcnt")) as f:
                return int(control.get("oom_kill", 0)) > 0 or int(f.read().strip() or 0) > 0
        except (OSError, ValueError, KeyError):
            return False

    def remove(self) -> None:
        for folder in self.folders.values():
            for _ in range(100):
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _sweep_cgroups() -> None:
    """Removes the empty cgroups of runs whose caller died (it was killed before it could remove them); every run
    as root sweeps before it makes its own."""
    if os.geteuid() != 0:
        return
    for parents in _Cgroup._parents().values():
        for parent in parents.values():
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                if not name.startswith(CGROUP_PREFIX):
                    continue
                owner = name[len(CGROUP_PREFIX):].split("_")[0]
                if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                    try:
                        os.rmdir(os.path.join(parent, name))
                    except OSError:
                        pass


class _Watched:
    def __init__(self, root: int, limit: int):
        self.root, self.limit, self.fired, self.cgroup = root, limit, False, None


class _SharedWatchdog:
    """The memory watchdog of this process's sandboxes (run_program's without a cgroup, and the SandboxedProcesses:
    many at once, one agent program per sample): one thread, one reading of /proc every WATCH_SECONDS for all of
    them, each sandbox's processes' resident memory summed and the sandbox killed past its bound (a thread per
    sandbox would read /proc once each); with a cgroup, the whole sandbox killed at the kernel's first OOM kill."""

    def __init__(self):
        self.lock = threading.Lock()
        self.watched = []
        self.thread = None
        self.page = os.sysconf("SC_PAGE_SIZE")

    def watch(self, root: int, memory_mb: int, cgroup=None) -> _Watched:
        entry = _Watched(root, memory_mb << 20)
        entry.cgroup = cgroup
        with self.lock:
            self.watched.append(entry)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="sandbox-memory", daemon=True)
                self.thread.start()
        return entry

    def forget(self, entry: _Watched) -> None:
        with self.lock:
            if entry in self.watched:
                self.watched.remove(entry)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self.lock:
                watched = list(self.watched)
                if not watched:
                    self.thread = None
                    return
            for w in watched:
                if w.cgroup is not None and not w.fired and w.cgroup.oom_kills():
                    w.fired = True
                    try:
                        os.killpg(w.root, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    w.cgroup.kill()
            watched = [w for w in watched if w.cgroup is None]
            if not watched:
                continue
            parents, rss = {}, {}
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parents[int(name)] = int(fields[1])
                rss[int(name)] = int(fields[21]) * self.page
            roots = {w.root: w for w in watched}
            totals = dict.fromkeys(roots, 0)
            for pid, size in rss.items():
                p, depth = pid, 0
                while p and p not in roots and depth < 64:
                    p, depth = parents.get(p, 0), depth + 1
                if p in roots:
                    totals[p] += size
            for root, total in totals.items():
                if total > roots[root].limit and not roots[root].fired:
                    roots[root].fired = True
                    try:
                        os.killpg(root, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass


_SHARED_WATCHDOG = _SharedWatchdog()

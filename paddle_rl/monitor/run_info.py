"""run_info.json: what a run ran on and with: the machine (CPU model, flags, cores), the software (Python, Paddle,
paddle-rl and its git commit) and the effective config's hash, written when the run starts (a resumed run writes
the machine it resumed on)."""
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Optional

from ..config import config_to_dict
from ..env import cpu_info

RUN_INFO_FILE = "run_info.json"
# keys that say where a run writes, not what it computes: left out of the config's hash, so one config run into
# two folders hashes the same
WHERE_KEYS = ("output_dir", "logging_dir", "run_name", "resume_from_checkpoint")
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def paddle_version() -> Optional[str]:
    """The Paddle the process runs (read from the loaded module: this module never imports Paddle), else the
    installed distribution's."""
    paddle = sys.modules.get("paddle")
    if paddle is not None and getattr(paddle, "__version__", None):
        return paddle.__version__
    return _version("paddlepaddle") or _version("paddlepaddle-gpu")


def git_commit(root: str = SOURCE_ROOT) -> Optional[str]:
    """The commit of the git checkout paddle-rl runs from (None outside one), with "-dirty" when files differ."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def config_hash(config) -> str:
    """sha256 of the effective config (every key's value in effect, sorted; WHERE_KEYS left out)."""
    values = {k: v for k, v in config_to_dict(config).items() if k not in WHERE_KEYS}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def run_info(config, started: float) -> dict:
    cpu = cpu_info()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"start_time": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(),
            "host": platform.node(), "cpu_model": cpu["model"], "cpu_flags": cpu["flags"],
            "cpu_cores": os.cpu_count(), "cpu_cores_usable": usable,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "platform": platform.platform(),
            "python": platform.python_version(), "paddle": paddle_version(), "paddle_rl": _version("paddle-rl"),
            "git_commit": git_commit(), "config_sha256": config_hash(config)}


def write_run_info(output_dir: str, config, started: float) -> str:
    """run_info.json in output_dir (replaced at each start); its path."""
    path = os.path.join(output_dir, RUN_INFO_FILE)
    os.makedirs(output_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(run_info(config, started), f, indent=1)
    os.replace(tmp, path)
    return path


def read_run_info(output_dir: str) -> Optional[dict]:
    path = os.path.join(output_dir, RUN_INFO_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)

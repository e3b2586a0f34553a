"""The `.[test]` extra of setup.py (PyTorch, transformers, accelerate, peft: the independent sides of the parity,
GGUF and LoRA-adapter tests). conftest.py refuses to start the suite when one of them is not installed, unless
PADDLE_RL_TESTS_WITHOUT_EXTRA=1 says the run goes without them on purpose; only then do the tests that need them
skip. Without that variable a library that is installed but fails to import fails its tests (never a skip)."""
import ast
import importlib
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITHOUT_EXTRA = "PADDLE_RL_TESTS_WITHOUT_EXTRA"


def without_extra() -> bool:
    return os.environ.get(WITHOUT_EXTRA, "") == "1"


def extra_modules() -> list:
    """The import names of setup.py's extras_require["test"], read from its source (one list to keep)."""
    path = os.path.join(ROOT, "setup.py")
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            requirements = ast.literal_eval(node.value)["test"]
            return [re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in requirements]
    raise RuntimeError(f"{path}: no extras_require keyword")


def missing_extra() -> list:
    """The `.[test]` libraries not installed (found without importing them: PyTorch and peft take seconds)."""
    return [name for name in extra_modules() if importlib.util.find_spec(name) is None]


def extra(name: str):
    """Import `name`, a `.[test]` library: a skip when the suite runs without the extra on purpose, else the
    library itself (an import that fails is an error of the test)."""
    if name not in extra_modules():
        raise ValueError(f"{name} is not in setup.py's extras_require['test']: import it directly")
    if without_extra():
        return pytest.importorskip(name, reason=f"{WITHOUT_EXTRA}=1: running without the .[test] extra")
    return importlib.import_module(name)

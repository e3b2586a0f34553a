import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from extras import WITHOUT_EXTRA, missing_extra, without_extra  # noqa: E402
from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end checks (learning curves, long parallel runs)")
    missing = missing_extra()
    if missing and not without_extra():
        # the parity, GGUF and LoRA-adapter tests check against these: without them they would skip in silence
        raise pytest.UsageError(f"the .[test] extra of setup.py is not installed ({', '.join(missing)} missing): "
                                f"pip install -e '.[test]', or set {WITHOUT_EXTRA}=1 to run without it on purpose "
                                "(the tests that need it then skip)")


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    """A random 2-layer Qwen2 model, its BPE tokenizer and 2-3 people KK data, built in seconds."""
    from micro_model import build_micro
    return build_micro(str(tmp_path_factory.mktemp("micro")))

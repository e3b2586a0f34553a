import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end checks (learning curves, long parallel runs)")


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    """A random 2-layer Qwen2 model, its BPE tokenizer and 2-3 people KK data, built in seconds."""
    from micro_model import build_micro
    return build_micro(str(tmp_path_factory.mktemp("micro")))

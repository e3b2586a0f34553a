"""Checkpoints hold no pickle (safetensors + JSON), so resuming one runs no code from it; checkpoints in the older
format (paddle.save / pickle files) still resume exactly, with one warning naming the files it unpickles.

Each resume here continues an uninterrupted 3-step run from its checkpoint-2 in the same process (the reward draws
from Python's and NumPy's global generators, sampling from Paddle's), and must reproduce its step 3 exactly:
metrics value for value (wall-clock keys left out) and the final weights bit for bit.
"""
import json
import logging
import os
import pickle
import shutil

import numpy as np
import paddle
import pytest

from micro_model import micro_overrides
from paddle_rl.config import load_config
from paddle_rl.model_files.safetensors_io import load_state
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
from paddle_rl.trainer import RLTrainer
from paddle_rl.trainer.state_files import read_state

PLUGIN = '''
import random

import numpy as np


def noisy_length(completions, **kwargs):
    return [float(len(c) % 5) - 2.0 + random.random() + float(np.random.rand()) for c in completions]
'''


def train(micro, plugin, out, **extra):
    values = dict(do_eval=False, report_to="none", reward_plugins=plugin, reward_funcs="noisy_length",
                  max_dec_len=8, max_steps=3, save_steps=2)
    values.update(extra)
    with paddle.utils.unique_name.guard():  # the optimizer's state names as in a process of its own
        trainer = RLTrainer(load_config(None, micro_overrides(micro, str(out), **values)))
        trainer.train()
    return trainer


def rows(out):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
            for r in read_metrics(os.path.join(str(out), "metrics.jsonl"))]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt-plugin") / "noisy_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


@pytest.fixture(scope="module")
def reference(micro, plugin, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt-ref") / "run"
    train(micro, plugin, out)
    return out


def cut_at_step_2(reference, out):
    """The reference run as a kill after checkpoint-2 leaves it (checkpoint-3 and step 3's metrics still there:
    the resume truncates the metrics and rewrites checkpoint-3)."""
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("checkpoint-3"))
    return out / "checkpoint-2"


def assert_reproduces(reference, out):
    assert rows(out) == rows(reference)
    a, b = load_state(str(reference / "checkpoint-3")), load_state(str(out / "checkpoint-3"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def is_pickle(path) -> bool:
    """A pickle stream of protocol 2 or later starts with PROTO (0x80) and its protocol number; paddle.save and
    pickle.dumps write protocol 2 to 5."""
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def test_checkpoint_holds_no_pickle_and_resumes_without_unpickling(micro, plugin, reference, tmp_path,
                                                                    monkeypatch, caplog):
    ckpt = reference / "checkpoint-2"
    files = sorted(os.listdir(ckpt))
    assert {"optimizer.json", "optimizer.safetensors", "rng_state.json", "trainer_state.json"} <= set(files), files
    for name in files:
        path = ckpt / name
        assert not is_pickle(path), name
        if name.endswith(".json"):
            json.loads(path.read_text())
        elif name.endswith(".safetensors"):
            header = int.from_bytes(path.read_bytes()[:8], "little")
            json.loads(path.read_bytes()[8:8 + header])
        else:
            path.read_text(encoding="utf-8")  # tokenizer files: text
    moments = read_state(str(ckpt), "optimizer")
    assert any("moment1" in k for k in moments) and isinstance(moments["LR_Scheduler"], dict)
    rng = json.loads((ckpt / "rng_state.json").read_text())["state"]
    assert set(rng) == {"host", "paddle"} and rng["paddle"][0]["seed"] == paddle.get_rng_state()[0].current_seed()

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(paddle, "load", refuse)
    out = tmp_path / "resumed"
    cut_at_step_2(reference, out)
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        train(micro, plugin, out, resume_from_checkpoint="auto")
    assert not [r for r in caplog.records if "pickle" in r.getMessage()]
    assert_reproduces(reference, out)


def to_old_format(ckpt):
    """checkpoint-2 as an older release wrote it: optimizer.pdopt and rng_state.pdstate through paddle.save."""
    from paddle_rl.trainer.checkpoint import set_paddle_rng_state
    paddle.save(read_state(str(ckpt), "optimizer"), str(ckpt / "optimizer.pdopt"))
    rng = read_state(str(ckpt), "rng_state")
    saved = paddle.get_rng_state()
    set_paddle_rng_state(rng["paddle"], "rng_state.json")
    paddle.save({"host": rng["host"], "paddle": paddle.get_rng_state()}, str(ckpt / "rng_state.pdstate"))
    paddle.set_rng_state(saved)
    for name in ("optimizer.json", "optimizer.safetensors", "rng_state.json"):
        os.remove(ckpt / name)


def test_old_format_checkpoint_resumes_with_one_warning(micro, plugin, reference, tmp_path, caplog):
    out = tmp_path / "old"
    ckpt = cut_at_step_2(reference, out)
    to_old_format(ckpt)
    assert is_pickle(ckpt / "optimizer.pdopt") and is_pickle(ckpt / "rng_state.pdstate")
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        train(micro, plugin, out, resume_from_checkpoint="auto")
    warnings = [r.getMessage() for r in caplog.records if "pickle" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert str(ckpt / "optimizer.pdopt") in warnings[0] and str(ckpt / "rng_state.pdstate") in warnings[0]
    assert "can run code" in warnings[0] and "only resume checkpoints you trust" in warnings[0]
    assert_reproduces(reference, out)
    # the checkpoint the resumed run wrote is in the new format
    assert not [n for n in os.listdir(out / "checkpoint-3") if is_pickle(out / "checkpoint-3" / n)]

"""Faults injected into real training runs of the micro model (docs/reliability.md).

Non-finite numbers: a gradient or a loss poisoned by the test-only hook PADDLE_RL_TEST_POISON
(paddle_rl/trainer/faults.py) makes the update skipped and counted, and too many in a row stop the run naming the
step and the tensor; a non-finite weight never reaches a checkpoint; a reward function returning inf is an error
naming the function and the sample. Checkpoint write errors: PADDLE_RL_TEST_FAIL_SAVE raises ENOSPC inside a
save (and, where mount namespaces are permitted, a real size-limited tmpfs fills up): the partial folder goes, the
earlier checkpoint stays loadable and `resume_from_checkpoint: auto` continues from it.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from micro_model import micro_overrides
from paddle_rl.config import load_config
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = '''
import math


def length_parity(completions, **kwargs):
    """Varies between samples: every group has a non-zero advantage, every update a non-zero gradient."""
    return [float(len(c) % 5) - 2.0 for c in completions]


def inf_third(completions, **kwargs):
    return [math.inf if i == 2 else 1.0 for i in range(len(completions))]
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "fault_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def overrides(micro, out, plugin, **extra):
    values = dict(do_eval=False, save_steps=1, report_to="none", reward_plugins=plugin, reward_funcs="length_parity",
                  max_dec_len=8)
    values.update(extra)
    return micro_overrides(micro, str(out), **values)


def run_cli(args, env=None, prefix=()):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([*prefix, sys.executable, "-m", "paddle_rl", "train", "/dev/null", *args], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=300)


def train_in_process(args, monkeypatch=None, **env):
    from paddle_rl.trainer import RLTrainer
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = RLTrainer(load_config(None, args))
    trainer.train()
    return trainer


def rows_of(out):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
            for r in read_metrics(os.path.join(str(out), "metrics.jsonl"))]


def weights(folder):
    from paddle_rl.model_files.safetensors_io import load_state
    return load_state(str(folder))


def moments(folder, name="optimizer"):
    from paddle_rl.trainer.state_files import read_state
    state = read_state(str(folder), name)
    return {k: v.numpy() for k, v in state.items() if hasattr(v, "numpy")}


def same(a, b):
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def checkpoints(out):
    return sorted(p.name for p in out.iterdir() if "checkpoint-" in p.name)


# --------------------------------------------------------------------------------------------- non-finite numbers

def test_poisoned_gradient_skips_the_update_and_counts_it(micro, plugin, tmp_path, monkeypatch):
    """Step 2's gradient is NaN in both of its updates: neither is applied (weights and Adam state as after step 1),
    both are counted, step 3 trains again, every checkpoint is finite."""
    out = tmp_path / "run"
    trainer = train_in_process(overrides(micro, out, plugin), monkeypatch,
                               PADDLE_RL_TEST_POISON="2:layers.1.mlp.down_proj")
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 2.0, 0.0]
    assert [r["actor/nonfinite_skipped_total"] for r in rows] == [0.0, 2.0, 2.0]
    assert rows[1]["actor/grad_norm"] == "nan" and rows[2]["actor/grad_norm"] > 0  # metrics.jsonl writes NaN as "nan"
    assert same(weights(out / "checkpoint-1"), weights(out / "checkpoint-2"))
    assert same(moments(out / "checkpoint-1"), moments(out / "checkpoint-2"))
    assert not same(weights(out / "checkpoint-2"), weights(out / "checkpoint-3"))
    assert all(np.isfinite(v).all() for v in weights(out / "checkpoint-3").values())
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["nonfinite"] == {"consecutive": 0, "total": 2}
    assert trainer.nonfinite.total == 2


def test_poisoned_gradient_stops_at_once_with_zero_skips(micro, plugin, tmp_path, monkeypatch):
    """max_nonfinite_skips: 0 stops at the first non-finite update, naming the parameter's Hugging Face name."""
    from paddle_rl.trainer.nonfinite import NonFiniteError
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"step 2 \(update 1 of 2\): .*max_nonfinite_skips: 0; first non-finite "
                                             r"tensor: gradient of model\.layers\.1\.mlp\.down_proj\.weight\."):
        train_in_process(overrides(micro, out, plugin, max_nonfinite_skips=0), monkeypatch,
                         PADDLE_RL_TEST_POISON="2:layers.1.mlp.down_proj")
    assert checkpoints(out) == ["checkpoint-1"]


def test_non_finite_loss_stops_the_run_after_max_skips(micro, plugin, tmp_path):
    """A loss that is NaN while its gradient is finite (a detached NaN added) is caught by the loss check alone:
    3 skipped updates are tolerated (step 2's two, step 3's first), the 4th stops the command, naming step and loss."""
    out = tmp_path / "run"
    result = run_cli(overrides(micro, out, plugin, max_steps=4), env={"PADDLE_RL_TEST_POISON": "2-4:loss"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("NonFiniteError: step 3 (update 2 of 2): non-finite loss or gradient norm in 4 consecutive update(s), "
            "max_nonfinite_skips: 3; first non-finite tensor: loss.") in result.stderr
    assert "step 3 (update 1 of 2) skipped: non-finite loss (3 in a row" in result.stderr
    assert [r["step"] for r in rows_of(out)] == [1, 2]
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert same(weights(out / "checkpoint-1"), weights(out / "checkpoint-2"))


def test_checkpoint_refuses_a_non_finite_weight(micro, plugin, tmp_path, monkeypatch):
    """A NaN weight stops the save before anything is written, naming the tensor; checkpoint-2 stays loadable."""
    import paddle
    from paddle_rl.trainer.nonfinite import NonFiniteError
    out = tmp_path / "run"
    trainer = train_in_process(overrides(micro, out, plugin, max_steps=2), monkeypatch)
    before = weights(out / "checkpoint-2")
    param = dict(trainer.actor.named_parameters())["layers.0.post_attention_layernorm.weight"]
    value = param.numpy()
    value[3] = np.nan
    param.set_value(paddle.to_tensor(value))
    trainer.step = 3
    with pytest.raises(NonFiniteError, match=r"checkpoint-3 not written: weight "
                                             r"model\.layers\.0\.post_attention_layernorm\.weight holds NaN or inf"):
        trainer.save()
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert same(weights(out / "checkpoint-2"), before)


def test_infinite_reward_is_an_error_naming_function_and_sample(micro, plugin, tmp_path, monkeypatch):
    """An inf reward would turn its group's advantages into NaN; it stops the run at the reward stage instead."""
    from paddle_rl.rewards import RewardError
    with pytest.raises(RewardError, match=r"reward plugin 'inf_third' \(.*fault_rewards\.py\) returned inf for "
                                          r"sample 2: a reward must be finite"):
        train_in_process(overrides(micro, tmp_path / "run", plugin, reward_funcs="inf_third"), monkeypatch)
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_data_parallel_ranks_skip_together(micro, plugin, tmp_path):
    """DP2, step 2's loss is NaN on rank 1 only (its gradient finite): both ranks skip both updates. Rank 0 logs
    the skips it learned of from rank 1, and the two ranks' Adam states stay equal (unchanged since step 1)."""
    out = tmp_path / "dp"
    env = dict(os.environ, PYTHONPATH=ROOT, PADDLE_RL_TEST_POISON="2:loss@1")
    env.pop("OMP_NUM_THREADS", None)
    args = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
            str(tmp_path / "log"), os.path.join(ROOT, "paddle_rl", "run_rl.py"), "/dev/null",
            *overrides(micro, out, plugin, data_parallel_degree=2)]
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(open(os.path.join(tmp_path / "log", f), errors="replace").read()[-3000:]
                   for f in sorted(os.listdir(tmp_path / "log")))
    assert result.returncode == 0, logs
    rows = rows_of(out)
    assert [r["actor/nonfinite_skipped"] for r in rows] == [0.0, 2.0, 0.0]
    ranks = [f"optimizer.rank0000{r}" for r in (0, 1)]
    for step in (1, 2, 3):
        assert same(moments(out / f"checkpoint-{step}", ranks[0]), moments(out / f"checkpoint-{step}", ranks[1]))
    assert same(moments(out / "checkpoint-1", ranks[1]), moments(out / "checkpoint-2", ranks[1]))
    assert same(weights(out / "checkpoint-1"), weights(out / "checkpoint-2"))


# --------------------------------------------------------------------------------------------- checkpoint writes

@pytest.fixture(scope="module")
def reference(micro, plugin, tmp_path_factory):
    """An undisturbed 3-step command run, saving every step."""
    out = tmp_path_factory.mktemp("faults-ref") / "run"
    result = run_cli(overrides(micro, out, plugin))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def assert_intact(folder):
    from paddle_rl.trainer.checkpoint import load_trainer_state
    assert load_trainer_state(str(folder))["step"] == int(str(folder).rsplit("-", 1)[1])
    assert all(np.isfinite(v).all() for v in weights(folder).values())
    moments(folder)


def test_save_write_error_stops_and_auto_resume_continues(micro, plugin, tmp_path, reference):
    """ENOSPC while checkpoint-2 is written: the command fails naming the folder and the last good checkpoint, the
    partial folder is gone, checkpoint-1 is intact, and auto resume from it reproduces the undisturbed run."""
    out = tmp_path / "run"
    result = run_cli(overrides(micro, out, plugin), env={"PADDLE_RL_TEST_FAIL_SAVE": "2"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert (f"CheckpointError: {out / 'checkpoint-2'} could not be written: OSError: [Errno 28] No space left on "
            f"device (injected by PADDLE_RL_TEST_FAIL_SAVE): '{out / '.tmp-checkpoint-2'}'. The partial folder was "
            f"removed; the last complete checkpoint is {out / 'checkpoint-1'}") in result.stderr
    assert checkpoints(out) == ["checkpoint-1"]
    assert_intact(out / "checkpoint-1")
    assert same(weights(out / "checkpoint-1"), weights(reference / "checkpoint-1"))
    resumed = run_cli(overrides(micro, out, plugin, resume_from_checkpoint="auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in resumed.stderr
    assert rows_of(out) == rows_of(reference)
    assert same(weights(out / "checkpoint-3"), weights(reference / "checkpoint-3"))


def test_save_error_continue_keeps_training(micro, plugin, tmp_path, reference):
    out = tmp_path / "run"
    result = run_cli(overrides(micro, out, plugin, save_error="continue"), env={"PADDLE_RL_TEST_FAIL_SAVE": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not be written: OSError: [Errno 28]" in result.stderr
    assert "training goes on (save_error: continue)" in result.stderr
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-3"]
    assert rows_of(out) == rows_of(reference)
    assert same(weights(out / "checkpoint-3"), weights(reference / "checkpoint-3"))


def _tmpfs_prefix(probe):
    """A command prefix running its command in a private mount namespace (root, or an unprivileged user
    namespace), or None where neither is permitted."""
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        if shutil.which(prefix[0]) is None:
            return None
        probe.mkdir(exist_ok=True)
        check = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                               capture_output=True)
        if check.returncode == 0:
            return prefix
    return None


def test_full_file_system_during_save(micro, plugin, tmp_path, reference):
    """A real full disk: output_dir on a tmpfs with room for one checkpoint and not two (skipped where this
    process may not mount one). The run stops with ENOSPC, the partial checkpoint-2 is removed."""
    prefix = _tmpfs_prefix(tmp_path / "probe")
    if prefix is None:
        pytest.skip("mounting a tmpfs is not permitted here (unshare --mount / user namespaces)")
    ckpt = reference / "checkpoint-1"
    size_kb = (sum(f.stat().st_size for f in ckpt.iterdir()) * 3 // 2) // 1024 + 64
    out, copy = tmp_path / "tmpfs", tmp_path / "copy"
    out.mkdir()
    copy.mkdir()
    train = " ".join(f"'{a}'" for a in ["-m", "paddle_rl", "train", "/dev/null", *overrides(micro, out, plugin)])
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {out} || exit 99; {sys.executable} {train}; rc=$?; "
              f"cp -a {out}/. {copy}/; exit $rc")
    result = subprocess.run([*prefix, "sh", "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"CheckpointError: {out / 'checkpoint-2'} could not be written" in result.stderr
    assert "No space left on device" in result.stderr or "StorageFull" in result.stderr, result.stderr[-3000:]
    assert checkpoints(copy) == ["checkpoint-1"]
    assert_intact(copy / "checkpoint-1")


def test_the_step_faults_wrap_layout_and_rollout_only_under_a_test_variable(monkeypatch):
    """Outside fault tests the run trains on the layout and rollout source themselves; a PADDLE_RL_TEST_* variable
    wraps them."""
    from paddle_rl.trainer import faults
    for variable in (faults.POISON, faults.DIE, faults.HANG, faults.FAIL_SAVE):
        monkeypatch.delenv(variable, raising=False)
    layout, rollout = object(), object()
    assert faults.wrap_layout(layout, lambda: 1) is layout and faults.wrap_rollout(rollout, 0) is rollout
    monkeypatch.setenv(faults.HANG, "3:update")
    assert isinstance(faults.wrap_layout(layout, lambda: 1), faults.InjectingLayout)
    assert isinstance(faults.wrap_rollout(rollout, 0), faults.InjectingRollout)

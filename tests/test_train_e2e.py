"""End-to-end training on the micro model: metrics, dashboards, checkpoints, exact resume after kill -9."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from micro_model import kill_after_checkpoint, micro_overrides
from paddle_rl.config import load_config
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_KEYS = ["reward/mean", "reward/std", "reward/kk_mean", "reward/accuracy", "actor/entropy", "actor/pg_loss",
             "actor/clipfrac_low", "actor/clipfrac_high", "actor/approx_kl", "actor/grad_norm", "actor/lr",
             "response_length/mean", "response_length/max", "response_length/clipped_share",
             "batch/zero_variance_group_share", "time/rollout", "time/reward", "time/old_logprob", "time/update",
             "time/step", "perf/tokens_per_s", "perf/generated_tokens_per_s"]


def run_cli(args, env=None, **kw):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "paddle_rl", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, **kw)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def train_in_process(overrides):
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, overrides))
    trainer.train()
    return trainer


def test_grpo_run_writes_every_metric_checkpoint_and_dashboard(micro, tmp_path):
    out = tmp_path / "run"
    trainer = train_in_process(micro_overrides(micro, str(out), kl_loss_coeff=0.05))
    assert trainer.reference is not None
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/reward_mean" in rows[0] and "reward/mean" not in rows[0]
    for row in rows[1:]:
        for key in STEP_KEYS + ["actor/ref_kl", "actor/kl_loss", "time/ref_logprob"]:
            assert key in row, key
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row[key])
        assert -3.0 <= row["reward/mean"] <= 3.0 and 1 <= row["response_length/max"] <= 12
        assert row["actor/lr"] == pytest.approx(1e-3)
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    ckpt = out / "checkpoint-2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "optimizer.json",
                 "optimizer.safetensors", "rng_state.json", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["position"] == 8
    from visualdl import LogReader
    logdir = out / "logs"
    files = [f for f in os.listdir(logdir) if f.startswith("vdlrecords")]
    reader = LogReader(file_path=str(logdir / files[0]))
    assert "reward/mean" in reader.get_tags()["scalar"]
    values = reader.get_data("scalar", "reward/mean")
    assert [v.id for v in values] == [1, 2, 3]
    assert values[-1].value == pytest.approx(rows[3]["reward/mean"], rel=1e-6)


def test_save_strategy_epoch_saves_at_each_epoch_end(micro, tmp_path):
    """64 training prompts in batches of 32: epochs end after steps 2 and 4; the run's end (step 3) saves too."""
    out = tmp_path / "epochs"
    train_in_process(micro_overrides(micro, str(out), save_strategy="epoch", save_steps=1, global_batch_size=32,
                                     global_mini_batch_size=32, rollout_n=2, max_steps=3, do_eval=False,
                                     max_dec_len=4))
    saved = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert saved == ["checkpoint-2", "checkpoint-3"]


def test_resume_refuses_optimizer_state_of_other_parameters(micro, tmp_path):
    """Optimizer moments saved under other parameter names (another release's layout) stop the resume with a
    clear error instead of being skipped silently."""
    from paddle_rl.trainer.state_files import read_state, write_state
    out = tmp_path / "run"
    train_in_process(micro_overrides(micro, str(out), max_steps=2, do_eval=False))
    path = str(out / "checkpoint-2")
    saved = read_state(path, "optimizer")
    write_state(path, "optimizer", {k.replace("actor_", "old_", 1) if isinstance(k, str) else k: v
                                    for k, v in saved.items()})
    with pytest.raises(ValueError, match="no optimizer state for .* parameter"):
        train_in_process(micro_overrides(micro, str(out), max_steps=3, do_eval=False,
                                         resume_from_checkpoint=str(out / "checkpoint-2")))


def test_no_reference_model_without_kl(micro, tmp_path):
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path), max_steps=1, do_eval=False)))
    assert trainer.reference is None
    metrics = trainer.train_step()
    assert "actor/ref_kl" not in metrics and "time/ref_logprob" not in metrics


def test_reinforce_pp_run(micro, tmp_path):
    trainer = train_in_process(micro_overrides(micro, str(tmp_path), rl_algorithm="reinforce_plus_plus",
                                               kl_coeff=0.01, do_eval=False))
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert trainer.reference is not None and len(rows) == 3
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and "actor/ref_kl" in row
        # REINFORCE++ whitens advantages over all valid tokens of the batch
        assert abs(row["advantage/mean"]) < 1e-4


def test_kill_9_and_resume_reproduces_metrics(micro, tmp_path):
    base = micro_overrides(micro, str(tmp_path / "a"), max_steps=6, save_steps=2, eval_steps=3)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("\n".join(f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}" for o in base) + "\n")
    ref = run_cli(["train", str(cfg)])
    assert ref.returncode == 0, ref.stderr[-2000:]
    expected = comparable(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))
    assert [r["step"] for r in expected] == list(range(7))

    out_b = tmp_path / "b"
    kill_after_checkpoint(str(cfg), out_b)
    assert not (out_b / "checkpoint-6").exists()
    resumed = run_cli(["train", str(cfg), f"output_dir={out_b}", "resume_from_checkpoint=auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = comparable(read_metrics(str(out_b / "metrics.jsonl")))
    assert got == expected
    from paddle_rl.model_files.safetensors_io import load_state
    wa, wb = load_state(str(tmp_path / "a" / "checkpoint-6")), load_state(str(out_b / "checkpoint-6"))
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_auto_resume_skips_incomplete_checkpoints(tmp_path):
    from paddle_rl.trainer.checkpoint import resolve_resume
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()              # no state file: an older, interrupted layout
    (tmp_path / ".tmp-checkpoint-6").mkdir()          # a save cut short
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        resolve_resume(str(tmp_path / "checkpoint-4"), str(tmp_path))


def test_bad_dataset_line_is_named(micro, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = open(micro["train"], encoding="utf-8").read().splitlines()[:5]
    lines.insert(3, '{"src": "unterminated')
    bad.write_text("\n".join(lines) + "\n")
    result = run_cli(["train", "/dev/null", *micro_overrides(micro, str(tmp_path / "o"), train_datasets=str(bad))])
    assert result.returncode == 2
    assert f"{bad}:4: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_config_fails_before_loading(micro, tmp_path):
    result = run_cli(["train", "/dev/null", *micro_overrides(micro, str(tmp_path), rollout_nn=3)])
    assert result.returncode == 2 and "did you mean 'rollout_n'" in result.stderr
    result = run_cli(["train", "/dev/null", *micro_overrides(micro, str(tmp_path),
                                                             actor_model_name_or_path=str(tmp_path / "nope"))])
    assert result.returncode == 2 and "actor_model_name_or_path: folder not found" in result.stderr


def test_eval_command_reports_accuracy(micro, tmp_path):
    result = run_cli(["eval", "/dev/null", f"actor_model_name_or_path={micro['model']}",
                      f"eval_datasets={micro['test']}", "max_dec_len=8", "min_dec_len=1", "max_prompt_len=128"])
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["eval/num_samples"] == 16.0 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert -3.0 <= metrics["eval/reward_mean"] <= 3.0


def test_eval_reports_each_eval_file(micro, tmp_path):
    """Several eval files: the overall figures plus one set per file, each equal to that file evaluated alone."""
    few = tmp_path / "test_few.jsonl"
    few.write_text("".join(open(micro["test"]).readlines()[:5]))
    common = ["max_dec_len=8", "min_dec_len=1", "max_prompt_len=128", f"actor_model_name_or_path={micro['model']}"]

    def run(files):
        result = run_cli(["eval", "/dev/null", f"eval_datasets={files}", *common])
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    both, alone, few_alone = run(f"{micro['test']},{few}"), run(micro["test"]), run(str(few))
    assert both["eval/num_samples"] == 21.0
    assert both["eval/test/num_samples"] == 16.0 and both["eval/test_few/num_samples"] == 5.0
    assert both["eval/test/reward_mean"] == pytest.approx(alone["eval/reward_mean"], abs=1e-9)
    assert both["eval/test_few/reward_mean"] == pytest.approx(few_alone["eval/reward_mean"], abs=1e-9)
    assert both["eval/reward_mean"] == pytest.approx(
        (16 * alone["eval/reward_mean"] + 5 * few_alone["eval/reward_mean"]) / 21, abs=1e-9)
    assert "eval/test/num_samples" not in alone


def test_step_summary_shows_each_eval_files_accuracy():
    from paddle_rl.trainer.loop import summary_line
    line = summary_line({"reward/mean": 1.0, "reward/accuracy": 0.5, "eval/accuracy": 0.2,
                         "eval/test/accuracy": 0.4, "eval/test_4p/accuracy": 0.0, "eval/test/reward_mean": 1.0,
                         "time/step": 2.0})
    assert line == ("reward/mean=1 reward/accuracy=0.5 eval/accuracy=0.2 eval/test/accuracy=0.4 "
                    "eval/test_4p/accuracy=0 time/step=2")


def test_do_train_false_evaluates_the_starting_model_only(micro, tmp_path):
    """do_train: false (PaddleNLP's key): the step-0 evaluation and nothing else: no update, no checkpoint; without
    an evaluation to run it is a configuration error."""
    out = tmp_path / "eval_only"
    result = run_cli(["train", "/dev/null", *micro_overrides(micro, str(out), do_train=False)])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0] and "eval/accuracy" in rows[0]
    assert not list(out.glob("checkpoint-*"))
    trained = tmp_path / "trained"
    assert run_cli(["train", "/dev/null", *micro_overrides(micro, str(trained))]).returncode == 0
    first = read_metrics(str(trained / "metrics.jsonl"))[0]
    assert comparable([rows[0]]) == comparable([first])  # the same evaluation as a training run's step 0
    bad = run_cli(["train", "/dev/null", *micro_overrides(micro, str(tmp_path / "bad"), do_train=False,
                                                          do_eval=False)])
    assert bad.returncode == 2 and "do_train: false leaves nothing to run" in bad.stderr


def _summary_lines(stderr: str) -> list:
    """The run summary's lines (the last lines logged from trainer/loop.py), without the log prefix."""
    lines = [line.split(" - ", 1)[1] for line in stderr.splitlines() if "loop.py" in line and " - " in line]
    start = max(i for i, line in enumerate(lines) if line.startswith("run "))
    return lines[start:]


TINY_SHORT = ["max_steps=2", "eval_steps=2", "save_steps=2", "global_batch_size=4", "global_mini_batch_size=4",
              "rollout_n=4", "max_eval_samples=32", "disable_tqdm=true"]


def test_run_ends_with_a_summary(tmp_path):
    """A short real run of the tiny config: first and last evaluation with their change, steps, wall time, the
    last checkpoint, metrics.jsonl and the dashboards' commands on this run's log folder."""
    out, logs = tmp_path / "run", tmp_path / "my logs"
    result = run_cli(["train", "configs/tiny_arith_grpo.yaml", *TINY_SHORT, f"output_dir={out}",
                      f"logging_dir={logs}", "report_to=visualdl,tensorboard"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = _summary_lines(result.stderr)
    rows = read_metrics(str(out / "metrics.jsonl"))
    first, last = rows[0], rows[-1]
    assert lines[0].startswith("run finished: 2/2 steps, wall time ")
    assert lines[1] == (f"evaluation (step 0 -> step 2): accuracy {first['eval/accuracy']:.4g} -> "
                        f"{last['eval/accuracy']:.4g} ({last['eval/accuracy'] - first['eval/accuracy']:+.4g}), "
                        f"reward {first['eval/reward_mean']:.4g} -> {last['eval/reward_mean']:.4g} "
                        f"({last['eval/reward_mean'] - first['eval/reward_mean']:+.4g})")
    assert lines[2] == f"last checkpoint: {out / 'checkpoint-2'}"
    assert lines[3] == f"metrics: {out / 'metrics.jsonl'} (through step 2)"
    assert lines[4] == f"VisualDL: visualdl --logdir '{logs}'"  # quoted: the folder name has a space
    assert lines[5] == f"TensorBoard: tensorboard --logdir '{logs}'"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logs))  # what tensorboard reads


def test_failed_run_says_what_was_saved_last(tmp_path):
    out = tmp_path / "run"
    result = run_cli(["train", "configs/tiny_arith_grpo.yaml", *TINY_SHORT, "max_steps=4", "eval_steps=10",
                      f"output_dir={out}", f"logging_dir={out / 'logs'}", "report_to=tensorboard"],
                     env={"PADDLE_RL_TEST_FAIL_SAVE": "4"})  # checkpoint-4's save fails: the run stops there
    assert result.returncode != 0 and "Traceback" in result.stderr
    lines = _summary_lines(result.stderr)
    assert lines[0].startswith("run failed at step 4/4, wall time ") and "OSError" in lines[0]
    assert lines[0].endswith("saved last:")
    assert lines[1].startswith("evaluation (step 0 -> step 4): accuracy ")  # the last step evaluates, then saves
    assert lines[2] == f"last checkpoint: {out / 'checkpoint-2'}"
    assert lines[3] == f"metrics: {out / 'metrics.jsonl'} (through step 4)"
    assert lines[4] == "VisualDL: not written (add visualdl to report_to)"
    assert lines[5] == f"TensorBoard: tensorboard --logdir {out / 'logs'}"

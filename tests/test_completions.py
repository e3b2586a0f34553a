"""What the model wrote: log_completions (completions.jsonl and the dashboards' text), every evaluation's responses
(eval_completions/step-N.jsonl, one on the terminal) and `paddle-rl eval --write-responses`, on real runs of the
bundled tiny config."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from extras import extra
from paddle_rl.monitor import read_metrics
from paddle_rl.monitor.completions import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 steps of 4 prompts x 4 samples, evaluations at steps 0 and 2 on 32 held-out prompts
TINY = ["max_steps=2", "eval_steps=2", "save_steps=2", "global_batch_size=4", "global_mini_batch_size=4",
        "rollout_n=4", "max_eval_samples=32", "disable_tqdm=true"]


def run_cli(args):
    return subprocess.run([sys.executable, "-m", "paddle_rl", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """The tiny config for 2 steps with log_completions on and both dashboards: (output folder, stderr)."""
    out = tmp_path_factory.mktemp("completions") / "run"
    result = run_cli(["train", "configs/tiny_arith_grpo.yaml", *TINY, f"output_dir={out}",
                      f"logging_dir={out / 'logs'}", "report_to=visualdl,tensorboard", "log_completions=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stderr


def _accumulator(logdir):
    """TensorBoard's own reader of the event files in `logdir`, loaded."""
    extra("tensorboard")  # the reading side: in the test extra
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def _by_step(records):
    steps = {}
    for r in records:
        steps.setdefault(r["step"], []).append(r)
    return steps


def test_completions_jsonl_holds_each_step_s_samples_with_its_scores(logged_run):
    out, _ = logged_run
    rows = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    steps = _by_step(read_records(str(out / "completions.jsonl")))
    assert sorted(steps) == [1, 2]
    for step, records in steps.items():
        m = rows[step]
        assert len(records) == 16  # every completion the step trained on (num_completions_to_print unset)
        rewards = np.array([r["reward"] for r in records])
        assert rewards.mean() == pytest.approx(m["reward/mean"], abs=1e-6)
        assert rewards.std() == pytest.approx(m["reward/std"], abs=1e-6)
        for name in ("math", "format"):
            assert np.mean([r["rewards"][name] for r in records]) == pytest.approx(m[f"reward/{name}_mean"], abs=1e-6)
        assert all(r["reward"] == pytest.approx(sum(r["rewards"].values())) for r in records)
        assert np.mean([r["correct"] for r in records]) == pytest.approx(m["reward/accuracy"], abs=1e-9)
        lengths = np.array([r["response_length"] for r in records])
        assert lengths.mean() == pytest.approx(m["response_length/mean"]) and lengths.max() == m["response_length/max"]
        finished = [r["finish_reason"] for r in records]
        assert np.mean([f == "length" for f in finished]) == pytest.approx(m["response_length/clipped_share"])
        assert set(finished) <= {"stop", "length"}
        advantages = np.array([r["advantage"] for r in records])
        assert advantages.max() == pytest.approx(m["advantage/max"], abs=1e-5)
        assert advantages.min() == pytest.approx(m["advantage/min"], abs=1e-5)
        # GRPO: within each prompt's 4 samples, (reward - mean) / (std + eps)
        for g in range(4):
            group = records[4 * g:4 * g + 4]
            assert len({r["prompt"] for r in group}) == 1 and [r["sample"] for r in group] == [0, 1, 2, 3]
            scores = np.array([r["reward"] for r in group])
            expected = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6) if scores.std() > 0 else 0 * scores
            assert [r["advantage"] for r in group] == pytest.approx(expected, abs=1e-4)
        assert all(r["prompt"].rstrip().endswith("<think>") and "What is" in r["prompt"] for r in records)
        assert all(isinstance(r["response"], str) and r["ground_truth"] for r in records)


def _dashboard_rewards(values):
    """The `reward:` lines of a plain-text table (VisualDL's entry), as numbers."""
    return [float(line.split(": ", 1)[1]) for line in values.splitlines() if line.startswith("reward: ")]


def test_completions_reach_visualdl_and_tensorboard(logged_run):
    out, _ = logged_run
    steps = _by_step(read_records(str(out / "completions.jsonl")))
    from visualdl import LogReader
    reader = LogReader(file_path=glob.glob(str(out / "logs" / "vdlrecords*"))[0])
    assert reader.get_tags()["text"] == ["completions"]
    entries = reader.get_data("text", "completions")
    assert [e.id for e in entries] == [1, 2]
    for entry in entries:
        text = entry.text.encoded_text_string
        assert _dashboard_rewards(text) == pytest.approx([r["reward"] for r in steps[entry.id]], rel=1e-3)
        assert text.count("finish_reason: ") == 16
    acc = _accumulator(out / "logs")
    tensors = acc.Tensors("completions")
    assert [t.step for t in tensors] == [1, 2]
    for t in tensors:
        table = t.tensor_proto.string_val[0].decode("utf-8").splitlines()
        header = [c.strip() for c in table[0].strip("|").split(" | ")]
        assert header == ["prompt", "response", "reward", "reward/math", "reward/format", "advantage",
                          "response_length", "finish_reason"]
        cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in table[2:]]
        assert len(cells) == 16
        records = steps[t.step]
        assert [float(c[2]) for c in cells] == pytest.approx([r["reward"] for r in records], rel=1e-3)
        assert [float(c[5]) for c in cells] == pytest.approx([r["advantage"] for r in records], rel=1e-3, abs=1e-4)
        assert [int(c[6]) for c in cells] == [r["response_length"] for r in records]
        assert "&lt;\\|im_start\\|&gt;user<br>What is" in cells[0][0]  # a chat template's tags show as text


def test_every_evaluation_writes_its_responses(logged_run):
    out, stderr = logged_run
    rows = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    assert sorted(os.listdir(out / "eval_completions")) == ["step-0.jsonl", "step-2.jsonl"]
    for step in (0, 2):
        records = read_records(str(out / "eval_completions" / f"step-{step}.jsonl"))
        assert len(records) == 32 == rows[step]["eval/num_samples"]
        assert np.mean([r["reward"] for r in records]) == pytest.approx(rows[step]["eval/reward_mean"], abs=1e-6)
        assert np.mean([r["correct"] for r in records]) == pytest.approx(rows[step]["eval/accuracy"], abs=1e-9)
        assert np.mean([r["response_length"] for r in records]) == pytest.approx(
            rows[step]["eval/response_length_mean"])
        assert all("advantage" not in r and r["file"] == "test.jsonl" for r in records)
        first = records[0]
        shown = [line for line in stderr.splitlines() if f"step {step} eval: 32 responses in " in line]
        assert len(shown) == 1 and f"(reward {first['reward']:.4g}, " in shown[0]
        assert shown[0].split(" -> ")[1].startswith(repr(" ".join(first["response"].split())[:20])[:-1])


def test_eval_command_writes_the_same_responses(logged_run, tmp_path):
    """`paddle-rl eval --write-responses` on the run's last checkpoint: the records of the run's own evaluation
    after that step (greedy, the same weights)."""
    out, _ = logged_run
    target = tmp_path / "new" / "responses.jsonl"
    result = run_cli(["eval", "configs/tiny_arith_grpo.yaml", f"actor_model_name_or_path={out / 'checkpoint-2'}",
                      "max_eval_samples=32", "--write-responses", str(target)])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    written = read_records(str(target))
    assert written == read_records(str(out / "eval_completions" / "step-2.jsonl"))
    assert np.mean([r["reward"] for r in written]) == pytest.approx(metrics["eval/reward_mean"], abs=1e-6)
    folder = run_cli(["eval", "configs/tiny_arith_grpo.yaml", "--write-responses", str(tmp_path)])
    assert folder.returncode == 2 and f"--write-responses: {tmp_path} is a folder" in folder.stderr


def test_log_completions_off_writes_none(tmp_path):
    """The default (log_completions false): no completions.jsonl and no text on the dashboards; the evaluations
    still write their responses."""
    out = tmp_path / "run"
    result = run_cli(["train", "configs/tiny_arith_grpo.yaml", *TINY, "max_steps=1", "eval_steps=1",
                      f"output_dir={out}", f"logging_dir={out / 'logs'}", "report_to=tensorboard"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "completions.jsonl").exists()
    assert sorted(os.listdir(out / "eval_completions")) == ["step-0.jsonl", "step-1.jsonl"]
    acc = _accumulator(out / "logs")
    assert acc.Tags()["tensors"] == [] and "reward/mean" in acc.Tags()["scalars"]


def test_num_completions_and_steps_choose_what_is_logged(micro, tmp_path):
    """log_completions_steps 2 of 3 steps, num_completions_to_print 6 of 16: step 2 only, its first prompt group
    whole and two samples of the second."""
    from micro_model import micro_overrides
    from paddle_rl.config import load_config
    from paddle_rl.trainer import RLTrainer

    out = tmp_path / "run"
    RLTrainer(load_config(None, micro_overrides(micro, str(out), do_eval=False, report_to="none",
                                                global_mini_batch_size=4, log_completions=True,
                                                log_completions_steps=2, num_completions_to_print=6))).train()
    records = read_records(str(out / "completions.jsonl"))
    assert [(r["step"], r["sample"]) for r in records] == [(2, s) for s in (0, 1, 2, 3, 0, 1)]
    assert len({r["prompt"] for r in records[:4]}) == 1 and records[4]["prompt"] != records[0]["prompt"]


def test_every_metric_sits_in_a_section(logged_run):
    """Every name of the step records is `<section>/...` (monitor/metrics_log.py SECTIONS); training accuracy is
    reward/accuracy beside eval/accuracy."""
    from paddle_rl.monitor.metrics_log import unsectioned
    out, stderr = logged_run
    rows = read_metrics(str(out / "metrics.jsonl"))
    names = {k for r in rows for k in r if k != "step"}
    assert unsectioned(names) == [] and "metrics outside the sections" not in stderr
    assert {"reward/accuracy", "eval/accuracy", "training/epoch", "batch/gen_rounds", "batch/kept_share",
            "score/clip_share", "actor/reward_kl_coeff"} <= names
    assert unsectioned(["accuracy", "kl", "actor/pg_loss", "foo/bar"]) == ["accuracy", "foo/bar", "kl"]


def test_run_info_names_the_machine_and_the_software(logged_run):
    """run_info.json: this machine's CPU model and flags (as /proc/cpuinfo says), its cores, the versions, the git
    commit of this checkout and the effective config's hash (the same for the same config in another folder)."""
    import datetime

    import paddle

    import paddle_rl.trainer  # noqa: F401 - registers every piece's keys, as in the run (config_to_dict lists them)
    from paddle_rl.config import load_config
    from paddle_rl.monitor.run_info import config_hash

    out, _ = logged_run
    info = json.loads((out / "run_info.json").read_text())
    cpuinfo = open("/proc/cpuinfo").read()
    model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags"))
    assert info["cpu_model"] == model and info["cpu_flags"] == flags and info["cpu_cores"] == os.cpu_count()
    assert info["paddle"] == paddle.__version__ and info["paddle_rl"] == "0.1.0"
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert info["git_commit"].split("-")[0] == head
    started = datetime.datetime.fromisoformat(info["start_time"])
    assert 0 < (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() < 3600
    same = ["configs/tiny_arith_grpo.yaml", [*TINY, "report_to=visualdl,tensorboard", "log_completions=true"]]
    assert info["config_sha256"] == config_hash(load_config(same[0], same[1] + ["output_dir=/elsewhere"]))
    assert info["config_sha256"] != config_hash(load_config(same[0], same[1] + ["seed=1"]))


def test_smoothing_is_tensorboards_debiased_ema():
    from paddle_rl.plot import PlotError, smooth
    # w 0.6: ema 0.4, 1.04, 1.824 over debias 0.4, 0.64, 0.784
    assert smooth([1.0, 2.0, 3.0], 0.6) == pytest.approx([1.0, 1.625, 1.824 / 0.784])
    got = smooth([1.0, float("nan"), 3.0], 0.6)  # a NaN stays and does not count
    assert got[0] == 1.0 and np.isnan(got[1]) and got[2] == pytest.approx(1.44 / 0.64)
    assert smooth([5.0, 5.0, 5.0], 0.9) == [5.0, 5.0, 5.0] and smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    with pytest.raises(PlotError, match=r"--smoothing: must be in \[0, 1\), got 1.0"):
        smooth([1.0], 1.0)


def test_plot_draws_runs_side_by_side(logged_run, tmp_path, monkeypatch):
    """The command the run summary names writes a PNG of the run; two runs in an SVG, each named with its machine;
    bad input names the option or file; without matplotlib one line says what to install."""
    import shlex

    from paddle_rl.plot import PlotError, plot
    extra("matplotlib")
    out, stderr = logged_run
    line = next(line.split(" - ", 1)[1] for line in stderr.splitlines() if " - plot: paddle-rl plot " in line)
    words = shlex.split(line[len("plot: paddle-rl "):])
    assert words[:2] == ["plot", str(out)] and words[-1] == str(out / "plot.png")
    assert run_cli(words).returncode == 0
    png = (out / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    machine = json.loads((out / "run_info.json").read_text())["cpu_model"]
    svg = plot([str(out), str(out)], ["eval/accuracy", "reward/accuracy"], str(tmp_path / "two.svg"), 0.5)
    text = open(svg).read()
    assert text.count(f"run ({machine})") == 4 and "eval/accuracy" in text and "reward/accuracy" in text
    with pytest.raises(PlotError, match="--metrics: nope in none of the runs' metrics.jsonl"):
        plot([str(out)], ["nope"], str(tmp_path / "x.png"))
    with pytest.raises(PlotError, match="--out: .* must end in .png or .svg"):
        plot([str(out)], ["reward/mean"], str(tmp_path / "x.jpg"))
    with pytest.raises(PlotError, match="metrics.jsonl: not found"):
        plot([str(tmp_path)], ["reward/mean"], str(tmp_path / "x.png"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(PlotError, match=r"needs matplotlib: pip install 'paddle-rl\[plot\]'"):
        plot([str(out)], ["reward/mean"], str(tmp_path / "y.png"))

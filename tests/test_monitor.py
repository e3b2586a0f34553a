"""report_to: each named dashboard writes, or the run stops naming report_to and the missing package."""
import glob
import os
import resource
import sys
import types

import pytest

from paddle_rl.config import ConfigError
from paddle_rl.monitor import MetricsLog, read_metrics
from extras import extra


def _event_file(logdir) -> str:
    files = glob.glob(os.path.join(str(logdir), "events.out.tfevents.*"))
    assert len(files) == 1, files
    return files[0]


def _scalars(path):
    """(step, tag, value) of every scalar TensorBoard reads from the event file or folder `path`, by step."""
    extra("tensorboard")  # the reading side: in the test extra
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(str(path))
    acc.Reload()
    assert acc.file_version == 2.0  # "brain.Event:2", the first record of every file
    got = [(e.step, tag, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    return sorted(got, key=lambda s: (s[0], s[1]))


def test_tensorboard_event_file_round_trip(tmp_path):
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "tb"), report_to="tensorboard", logging_steps=2)
    for step in range(5):
        log.log(step, {"reward/mean": 0.5 * step, "actor/lr": 1e-3, "note": float("nan"), "odd key (x)": 7.0})
    log.close()
    path = _event_file(tmp_path / "tb")
    assert path.endswith(f".{os.getpid()}")
    got = _scalars(path)
    # steps 0, 2, 4 (logging_steps 2); a NaN is written to metrics.jsonl as a string, not to the dashboard;
    # tags are written as given
    assert [(s, t) for s, t, _ in got] == [(s, t) for s in (0, 2, 4) for t in ("actor/lr", "odd key (x)",
                                                                             "reward/mean")]
    assert [v for _, t, v in got if t == "reward/mean"] == [0.0, 1.0, 2.0]
    assert [v for _, t, v in got if t == "actor/lr"] == [pytest.approx(1e-3)] * 3
    assert [r["step"] for r in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))] == [0, 1, 2, 3, 4]


def test_tensorboard_scalars_are_on_disk_after_each_step(tmp_path):
    """A run that ends without closing its log (the watchdog's os._exit) keeps every logged step."""
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "tb"), report_to="tensorboard")
    for step in range(3):
        log.log(step, {"x": float(step) + 0.5})
        assert _scalars(_event_file(tmp_path / "tb")) == [(s, "x", s + 0.5) for s in range(step + 1)]
    log.close()


def test_resume_marks_a_restart_for_tensorboard(tmp_path):
    out, tb = str(tmp_path / "out"), str(tmp_path / "tb")
    first = MetricsLog(out, tb, report_to="tensorboard")
    for step in range(4):
        first.log(step, {"x": float(step)})
    first.close()
    os.rename(_event_file(tb), os.path.join(tb, "events.out.tfevents.0000000001.old"))
    resumed = MetricsLog(out, tb, report_to="tensorboard")
    resumed.truncate_after(2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    # TensorBoard reads the folder's files in order; the restart marker at step 3 drops the old file's step 3
    assert _scalars(tb) == [(0, "x", 0.0), (1, "x", 1.0), (2, "x", 2.0), (3, "x", 30.0)]


@pytest.mark.parametrize("report_to,package", [("wandb", "wandb"), ("tensorboard,visualdl", "visualdl"),
                                               ("visualdl,tensorboard", "tensorboardX")])
def test_missing_dashboard_package_stops_with_its_name(tmp_path, monkeypatch, report_to, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(ConfigError) as err:
        MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to=report_to)
    text = str(err.value)
    assert text.startswith("report_to:") and f"Python package(s) {package}" in text
    assert not os.path.isdir(tmp_path / "logs") or not os.listdir(tmp_path / "logs")  # nothing written instead


def test_wandb_runs_offline(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, dict(data)))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="wandb", run_name="r1")
    log.log(1, {"reward/mean": 2.0})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline" and calls[0][1]["name"] == "r1"
    assert calls[0][1]["dir"] == str(tmp_path / "logs")
    assert calls[1:] == [("log", 1, {"reward/mean": 2.0}), ("finish",)]


def test_report_to_all_opens_what_is_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="all")
    log.log(0, {"a": 1.0})
    log.close()
    assert _scalars(_event_file(tmp_path / "logs")) == [(0, "a", 1.0)]
    assert any(f.startswith("vdlrecords") for f in os.listdir(tmp_path / "logs"))


def test_report_to_none_writes_no_dashboard(tmp_path):
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="none")
    log.log(0, {"a": 1.0})
    log.close()
    assert not os.path.exists(tmp_path / "logs")


def test_stage_timer_records_each_stage_s_own_memory_peaks():
    """StageTimer's memory peaks belong to their stage: a stage that held 256 MB of tensors reports them (RSS and
    Paddle's live tensors), the next stage, which held 32 MB, does not inherit them (the high-water marks are
    reset between stages), a part reports its own, and the process's peak survives the resets. The page faults too
    are each stage's own."""
    import paddle

    from paddle_rl.monitor import StageTimer, memory

    timer = StageTimer()
    start = memory.rss_mb()
    with timer.stage("big"):
        big = paddle.ones([64, 1024, 1024])  # 256 MB, touched
        del big
    with timer.stage("small"):
        small = paddle.ones([8, 1024, 1024])  # 32 MB
        with timer.part("small_part"):
            part = paddle.ones([4, 1024, 1024])
            del part
        del small
    m = timer.metrics()
    print({k: round(v) for k, v in m.items() if k.startswith("memory/")}, "start", round(start))
    assert memory.per_stage()
    assert m["memory/big_peak_tensor_mb"] >= 256 and m["memory/big_peak_rss_mb"] >= start + 200
    assert 32 <= m["memory/small_peak_tensor_mb"] < 100
    assert 16 <= m["memory/small_part_peak_tensor_mb"] <= m["memory/small_peak_tensor_mb"]
    assert m["memory/small_peak_rss_mb"] < m["memory/big_peak_rss_mb"] - 150
    assert memory.process_peak_mb() >= m["memory/big_peak_rss_mb"]
    # the page faults each stage took: the 256 MB first touched in `big`, fewer in `small` and its part
    pages = (256 << 20) // resource.getpagesize()
    assert 0.9 * pages <= m["memory/big_page_faults"] < 3 * pages
    assert m["memory/small_part_page_faults"] <= m["memory/small_page_faults"] < m["memory/big_page_faults"] / 2


def test_wandb_gets_the_completions_as_a_table(tmp_path, monkeypatch):
    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    fake = types.ModuleType("wandb")
    fake.Table = Table
    fake.init = lambda **kw: types.SimpleNamespace(log=lambda data, step: logged.append((step, data)),
                                                   finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="wandb")
    log.log_completions(3, [{"prompt": "1+1?", "response": "2", "reward": 1.5, "rewards": {"math": 1.0, "fmt": 0.5},
                             "advantage": 0.25, "response_length": 1, "finish_reason": "stop"}])
    log.close()
    (step, data), = logged
    assert step == 3 and data["completions"].columns == ["prompt", "response", "reward", "reward/math",
                                                           "reward/fmt", "advantage", "response_length",
                                                           "finish_reason"]
    assert data["completions"].data == [["1+1?", "2", "1.5", "1", "0.5", "0.25", "1", "stop"]]


def test_resume_drops_later_completions(tmp_path):
    """An interrupted run resumed at step 2 keeps the completions and evaluation responses of steps <= 2."""
    from paddle_rl.monitor.completions import read_records
    out = tmp_path / "out"
    first = MetricsLog(str(out), None, report_to="none")
    for step in range(1, 5):
        first.log_completions(step, [{"prompt": "p", "response": str(step), "reward": float(step)}])
        first.log_eval_completions(step, [{"prompt": "q", "response": str(step), "reward": 0.0}])
    first.close()
    MetricsLog(str(out), None, report_to="none").truncate_after(2)
    assert [r["step"] for r in read_records(str(out / "completions.jsonl"))] == [1, 2]
    assert sorted(os.listdir(out / "eval_completions")) == ["step-1.jsonl", "step-2.jsonl"]

"""report_to: each named dashboard writes, or the run stops naming report_to and the missing package."""
import glob
import os
import sys
import types

import pytest

from paddle_rl.config import ConfigError
from paddle_rl.monitor import MetricsLog, read_metrics
from paddle_rl.monitor.tb_events import (EventFileError, EventFileWriter, crc32c, masked_crc32c, read_events,
                                         read_records)


def _event_file(logdir) -> str:
    files = glob.glob(os.path.join(str(logdir), "events.out.tfevents.*"))
    assert len(files) == 1, files
    return files[0]


def _scalars(path):
    return [(s.step, s.tag, s.value) for e in read_events(path) for s in e.scalars]


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0
    try:
        import crc32c as reference
    except ImportError:
        return
    data = bytes(range(256)) * 7
    assert crc32c(data) == reference.crc32c(data)


def test_tensorboard_event_file_round_trip(tmp_path):
    log = MetricsLog(str(tmp_path / "out"), str(tmp_path / "tb"), report_to="tensorboard", logging_steps=2)
    for step in range(5):
        log.log(step, {"reward/mean": 0.5 * step, "actor/lr": 1e-3, "note": float("nan")})
    log.close()
    path = _event_file(tmp_path / "tb")
    events = read_events(path)
    assert events[0].file_version == "brain.Event:2"
    got = _scalars(path)
    # steps 0, 2, 4 (logging_steps 2); a NaN is written to metrics.jsonl as a string, not to the dashboard
    assert [(s, t) for s, t, _ in got] == [(0, "actor/lr"), (0, "reward/mean"), (2, "actor/lr"), (2, "reward/mean"),
                                           (4, "actor/lr"), (4, "reward/mean")]
    assert got[-1][2] == 2.0 and got[0][2] == pytest.approx(1e-3)
    assert [r["step"] for r in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))] == [0, 1, 2, 3, 4]


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
    new = [f for f in glob.glob(os.path.join(tb, "events.out.tfevents.*")) if not f.endswith(".old")][0]
    events = read_events(new)
    assert events[1].session_start and events[1].step == 3
    assert _scalars(new) == [(3, "x", 30.0)]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return
    acc = EventAccumulator(tb)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_reader_rejects_a_corrupt_record(tmp_path):
    writer = EventFileWriter(str(tmp_path))
    writer.add_scalar("a", 1.0, 1)
    writer.close()
    blob = bytearray(open(writer.path, "rb").read())
    blob[-6] ^= 0xFF
    open(writer.path, "wb").write(bytes(blob))
    with pytest.raises(EventFileError, match="bad data checksum"):
        list(read_records(writer.path))
    assert masked_crc32c(b"") != crc32c(b"")


@pytest.mark.parametrize("report_to,package", [("wandb", "wandb"), ("tensorboard,visualdl", "visualdl")])
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

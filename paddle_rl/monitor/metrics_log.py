"""metrics.jsonl (every step) and the dashboards of report_to (every logging_steps; dashboards.py)."""
import json
import math
import os
from typing import Optional

from .dashboards import OPENERS, open_dashboards

METRICS_FILE = "metrics.jsonl"
# Wall-clock and memory figures: they differ between two runs of the same computation.
TIMING_PREFIXES = ("time/", "perf/", "memory/")


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsLog:
    def __init__(self, output_dir: str, logging_dir: Optional[str], report_to: str = "visualdl",
                 logging_steps: int = 1, run_name: Optional[str] = None, enabled: bool = True):
        """`logging_dir` (default <output_dir>/logs) holds the dashboards' files; `enabled` is false on every
        rank but the logging one. A dashboard named in report_to that cannot be opened raises ConfigError."""
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.logging_steps = logging_steps
        self.dashboards, self.dashboard_names = [], []
        self.logging_dir = logging_dir or os.path.join(output_dir, "logs")
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.dashboards = open_dashboards(report_to, self.logging_dir, run_name)
        # the report_to names of the dashboards written (visualdl, tensorboard, wandb), kept after close
        self.dashboard_names = [name for name, cls in OPENERS.items() if any(isinstance(d, cls) for d in self.dashboards)]

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (written by an interrupted run that is being resumed)."""
        if not self.enabled:
            return
        for dashboard in self.dashboards:
            dashboard.restart(step)
        if not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.dashboards and (step % self.logging_steps == 0 or step == 0):
            scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
            for dashboard in self.dashboards:
                dashboard.add_scalars(step, scalars)

    def close(self) -> None:
        for dashboard in self.dashboards:
            dashboard.close()
        self.dashboards = []


def read_metrics(path: str):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

"""metrics.jsonl (every step), VisualDL scalars and a console line (every logging_steps)."""
import json
import logging
import math
import os
from typing import Optional

logger = logging.getLogger("paddle_rl")

METRICS_FILE = "metrics.jsonl"
# Wall-clock figures: they differ between two runs of the same computation.
TIMING_PREFIXES = ("time/", "perf/")


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsLog:
    def __init__(self, output_dir: str, logging_dir: Optional[str], report_to: str = "visualdl",
                 logging_steps: int = 1, run_name: Optional[str] = None, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.logging_steps = logging_steps
        self.writer = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if report_to not in ("none", "") and logging_dir:
            try:
                from visualdl import LogWriter
                os.makedirs(logging_dir, exist_ok=True)
                self.writer = LogWriter(logdir=logging_dir, display_name=run_name or "")
            except ImportError:
                logger.warning("visualdl is not installed: dashboard scalars are off (metrics.jsonl still written)")

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (written by an interrupted run that is being resumed)."""
        if not self.enabled or not os.path.isfile(self.path):
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
        if self.writer is not None and (step % self.logging_steps == 0 or step == 0):
            for key, value in record.items():
                if key != "step" and isinstance(value, float):
                    self.writer.add_scalar(tag=key, value=value, step=step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_metrics(path: str):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

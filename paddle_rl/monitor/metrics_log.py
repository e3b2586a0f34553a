"""metrics.jsonl (every step) and the dashboards of report_to (every logging_steps; dashboards.py); the sampled
completions and evaluation responses beside them (completions.py)."""
import json
import logging
import math
import os
from typing import List, Optional

from .completions import COMPLETIONS_FILE, EVAL_COMPLETIONS_DIR, drop_steps_after, eval_completions_path, table, \
    write_records
from .dashboards import OPENERS, open_dashboards

METRICS_FILE = "metrics.jsonl"
# Wall-clock and memory figures: they differ between two runs of the same computation.
TIMING_PREFIXES = ("time/", "perf/", "memory/")
# The sections of a step record: every metric is named `<section>/...` (docs/metrics.md lists the names).
SECTIONS = ("actor", "critic", "reward", "score", "advantage", "batch", "training", "response_length",
            "prompt_length", "episode", "rollout_corr", "async", "rollout_server", "eval", "time", "perf", "memory")

logger = logging.getLogger("paddle_rl")


def unsectioned(names) -> list:
    """The metric names outside every section of SECTIONS."""
    return sorted(n for n in names if n.split("/", 1)[0] not in SECTIONS or "/" not in n)


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsLog:
    def __init__(self, output_dir: str, logging_dir: Optional[str], report_to: str = "visualdl",
                 logging_steps: int = 1, run_name: Optional[str] = None, enabled: bool = True, wandb_proxy: str = ""):
        """`logging_dir` (default <output_dir>/logs) holds the dashboards' files; `enabled` is false on every
        rank but the logging one; `wandb_proxy` the wandb dashboard's proxy (wandb_http_proxy). A dashboard named in
        report_to that cannot be opened raises ConfigError."""
        self.enabled = enabled
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.completions_path = os.path.join(output_dir, COMPLETIONS_FILE)
        self.logging_steps = logging_steps
        self._warned = set()
        self.dashboards, self.dashboard_names = [], []
        self.logging_dir = logging_dir or os.path.join(output_dir, "logs")
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.dashboards = open_dashboards(report_to, self.logging_dir, run_name, wandb_proxy)
        # the report_to names of the dashboards written (visualdl, tensorboard, wandb), kept after close
        self.dashboard_names = [name for name, cls in OPENERS.items() if any(isinstance(d, cls) for d in self.dashboards)]

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (written by an interrupted run that is being resumed)."""
        if not self.enabled:
            return
        for dashboard in self.dashboards:
            dashboard.restart(step)
        drop_steps_after(self.completions_path, step)
        evals = os.path.join(self.output_dir, EVAL_COMPLETIONS_DIR)
        for name in os.listdir(evals) if os.path.isdir(evals) else []:
            if name.startswith("step-") and name.endswith(".jsonl") and name[5:-6].isdigit() and int(name[5:-6]) > step:
                os.remove(os.path.join(evals, name))
        drop_steps_after(self.path, step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        stray = [n for n in unsectioned(metrics) if n not in self._warned]
        if stray:  # written as given, named once: a metric's producer names it in a section
            self._warned.update(stray)
            logger.warning("metrics outside the sections of monitor/metrics_log.py SECTIONS: %s", ", ".join(stray))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.dashboards and (step % self.logging_steps == 0 or step == 0):
            scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
            for dashboard in self.dashboards:
                dashboard.add_scalars(step, scalars)

    def log_completions(self, step: int, records: List[dict], tag: str = "completions") -> None:
        """A training step's sampled completions: appended to completions.jsonl (each with its step) and a table
        on every dashboard."""
        if not self.enabled or not records:
            return
        write_records(self.completions_path, [{"step": step, **r} for r in records], append=True)
        self._table(step, tag, records)

    def log_eval_completions(self, step: int, records: List[dict]) -> str:
        """Every response of the evaluation after step `step`: eval_completions/step-<step>.jsonl (its path)."""
        path = eval_completions_path(self.output_dir, step)
        if self.enabled:
            write_records(path, records)
        return path

    def _table(self, step: int, tag: str, records: List[dict]) -> None:
        columns, rows = table(records)
        for dashboard in self.dashboards:
            dashboard.add_table(step, tag, columns, rows)

    def close(self) -> None:
        for dashboard in self.dashboards:
            dashboard.close()
        self.dashboards = []


def read_metrics(path: str):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

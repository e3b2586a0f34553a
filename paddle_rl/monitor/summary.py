"""The lines a run ends with, finished or failed: what it learned (first and last evaluation, their change), how
long it ran, what it saved last, the commands that open its dashboards and the one that plots it.

Built from the files the run wrote (metrics.jsonl, the checkpoints, the dashboards' log folder), so a failed run
reports what is on disk, not what it meant to write.
"""
import os
import shlex
from typing import List, Optional

from .metrics_log import read_metrics

# dashboard -> the command that serves a log folder (TensorBoard reads the event files `tensorboard` writes;
# VisualDL reads its own record files, not those)
DASHBOARD_COMMANDS = {"visualdl": "visualdl --logdir {}", "tensorboard": "tensorboard --logdir {}"}
DASHBOARD_TITLES = {"visualdl": "VisualDL", "tensorboard": "TensorBoard"}
EVAL_KEYS = (("accuracy", "eval/accuracy"), ("reward", "eval/reward_mean"))
PLOT_METRICS = ("eval/accuracy", "reward/mean")  # what `paddle-rl plot` draws unless told


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _evaluations(rows: list) -> List[str]:
    evals = [r for r in rows if any(key in r for _, key in EVAL_KEYS)]
    if not evals:
        return ["evaluation: none logged (do_eval / eval_datasets / evaluation_strategy)"]
    first, last = evals[0], evals[-1]
    parts = []
    for name, key in EVAL_KEYS:
        if key in first and key in last:
            parts.append(f"{name} {first[key]:.4g} -> {last[key]:.4g} ({last[key] - first[key]:+.4g})")
    return [f"evaluation (step {first['step']} -> step {last['step']}): " + ", ".join(parts)]


def run_summary(metrics_path: str, logging_dir: str, dashboards: List[str], step: int, total_steps: int,
                seconds: float, checkpoint: Optional[str], error: Optional[BaseException] = None) -> List[str]:
    """The summary's lines. `dashboards`: those the run wrote (report_to, resolved); `checkpoint`: the last one
    on disk (None: none); `error`: what ended a failed run."""
    rows = read_metrics(metrics_path) if os.path.isfile(metrics_path) else []
    if error is None:
        head = f"run finished: {step}/{total_steps} steps, wall time {_duration(seconds)}"
    else:
        text = str(error).splitlines()[0] if str(error) else ""
        head = (f"run failed at step {step}/{total_steps}, wall time {_duration(seconds)} "
                f"({type(error).__name__}{': ' + text if text else ''}); saved last:")
    lines = [head] + _evaluations(rows)
    lines.append(f"last checkpoint: {checkpoint}" if checkpoint else "last checkpoint: none saved")
    logged = f" (through step {rows[-1]['step']})" if rows else " (no step logged)"
    lines.append(f"metrics: {os.path.abspath(metrics_path)}{logged}")
    folder = shlex.quote(os.path.abspath(logging_dir))
    for name, command in DASHBOARD_COMMANDS.items():
        if name in dashboards:
            lines.append(f"{DASHBOARD_TITLES[name]}: {command.format(folder)}")
        else:
            lines.append(f"{DASHBOARD_TITLES[name]}: not written (add {name} to report_to)")
    output_dir = os.path.dirname(os.path.abspath(metrics_path))
    lines.append(f"plot: paddle-rl plot {shlex.quote(output_dir)} --metrics {' '.join(PLOT_METRICS)} --out "
                 f"{shlex.quote(os.path.join(output_dir, 'plot.png'))}")
    return lines

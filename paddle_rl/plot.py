"""`paddle-rl plot OUTPUT_DIR [OUTPUT_DIR ...] --metrics NAME ... --out FILE.png|.svg`: runs side by side.

Each metric is one panel over the step axis; each run one line, read from its metrics.jsonl, smoothed as
TensorBoard smooths (a debiased exponential moving average, `--smoothing`, the raw points drawn faintly behind)
and named by its folder and the machine its run_info.json names. matplotlib is the extra `plot`
(pip install 'paddle-rl[plot]'); without it the command stops with one line saying so.
"""
import argparse
import json
import math
import os
import sys
from typing import List

from .monitor import METRICS_FILE, read_metrics
from .monitor.run_info import read_run_info
from .monitor.summary import PLOT_METRICS as DEFAULT_METRICS
FORMATS = (".png", ".svg")


class PlotError(Exception):
    """Bad input: a message naming the option or file."""


def smooth(values: List[float], weight: float) -> List[float]:
    """TensorBoard's scalar smoothing: an exponential moving average, debiased (divided by 1 - weight^n, n the
    finite points so far, so the first point is itself); non-finite points stay as they are and do not enter the
    average; weight 0, or a constant series, is left unsmoothed."""
    if not 0.0 <= weight < 1.0:
        raise PlotError(f"--smoothing: must be in [0, 1), got {weight}")
    finite = [v for v in values if math.isfinite(v)]
    if weight == 0.0 or all(v == finite[0] for v in finite):
        return list(values)
    out, last, count = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        count += 1
        out.append(last / (1.0 - weight ** count))
    return out


def _value(v) -> float:
    """A metrics.jsonl value as a float (non-finite values are written as strings: "nan", "inf")."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def load_run(folder: str) -> dict:
    """{"name", "machine", "rows"} of one run folder; PlotError naming what is missing."""
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        raise PlotError(f"{path}: not found (OUTPUT_DIR is a run's output_dir, holding {METRICS_FILE})")
    try:
        rows = read_metrics(path)
    except (json.JSONDecodeError, OSError) as e:
        raise PlotError(f"{path}: cannot be read ({e})") from None
    info = read_run_info(folder) or {}
    return {"name": os.path.basename(os.path.normpath(folder)) or folder, "machine": info.get("cpu_model"),
            "rows": rows}


def series(run: dict, metric: str):
    """(steps, values) of `metric` in a run, steps in order."""
    points = sorted((r["step"], _value(r[metric])) for r in run["rows"] if metric in r)
    return [s for s, _ in points], [v for _, v in points]


def plot(folders: List[str], metrics: List[str], out: str, smoothing: float = 0.6) -> str:
    """Draws the runs' metrics into `out` (.png or .svg); returns its path."""
    if os.path.splitext(out)[1].lower() not in FORMATS:
        raise PlotError(f"--out: {out} must end in {' or '.join(FORMATS)}")
    smooth([], smoothing)  # checks the weight before anything is read
    runs = [load_run(f) for f in folders]
    missing = [m for m in metrics if not any(series(r, m)[0] for r in runs)]
    if missing:
        names = sorted({k for r in runs for row in r["rows"] for k in row if k != "step"})
        raise PlotError(f"--metrics: {', '.join(missing)} in none of the runs' {METRICS_FILE} (they hold: "
                        f"{', '.join(names)})")
    try:
        # deferred: matplotlib is the optional extra `plot`, and `paddle-rl --help` loads nothing of it
        import matplotlib
        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # an SVG's text stays text
        from matplotlib import pyplot
    except ImportError:
        raise PlotError("paddle-rl plot needs matplotlib: pip install 'paddle-rl[plot]' (or pip install "
                        "matplotlib)") from None
    figure, axes = pyplot.subplots(len(metrics), 1, figsize=(8, 3.2 * len(metrics)), squeeze=False)
    colors = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes[:, 0], metrics):
        for i, run in enumerate(runs):
            steps, values = series(run, metric)
            if not steps:
                continue
            color = colors[i % len(colors)]
            label = run["name"] + (f" ({run['machine']})" if run["machine"] else "")
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(values, smoothing), color=color, linewidth=1.8, label=label)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.suptitle(f"smoothing {smoothing:g} (TensorBoard's debiased EMA; raw points faint)", fontsize="small")
    figure.tight_layout()
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    figure.savefig(out)
    pyplot.close(figure)
    return out


def _main(args) -> int:
    try:
        path = plot(args.runs, args.metrics, args.out, args.smoothing)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_plot_subparser(subparsers) -> None:
    p = subparsers.add_parser("plot", help="plot metrics of one or more runs side by side (needs matplotlib)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="OUTPUT_DIR", help="run folders (each with its metrics.jsonl)")
    p.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), metavar="NAME",
                   help=f"metric names, one panel each (default: {' '.join(DEFAULT_METRICS)})")
    p.add_argument("--out", required=True, metavar="FILE", help="the figure to write: .png or .svg")
    p.add_argument("--smoothing", type=float, default=0.6,
                   help="TensorBoard's smoothing weight in [0, 1) (debiased EMA; 0: none; default 0.6)")
    p.set_defaults(func=_main)

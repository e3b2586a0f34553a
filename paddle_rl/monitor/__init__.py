from .dashboards import resolve_dashboards
from .metrics_log import METRICS_FILE, TIMING_PREFIXES, MetricsLog, read_metrics
from .summary import run_summary
from .timer import StageTimer

__all__ = ["MetricsLog", "read_metrics", "METRICS_FILE", "TIMING_PREFIXES", "StageTimer", "resolve_dashboards",
           "run_summary"]

from dataclasses import dataclass
from typing import Optional

from .fields import arg


@dataclass
class LoggingArgs:
    logging_dir: Optional[str] = arg(None, "VisualDL log folder (default: <output_dir>/logs).")
    logging_steps: int = arg(1, "Print and write dashboard scalars every this many steps (metrics.jsonl gets every step).")
    report_to: str = arg("visualdl", "visualdl | none (wandb/tensorboard fall back to visualdl).")
    run_name: Optional[str] = arg(None, "Name of the run in dashboards.")
    disable_tqdm: bool = arg(False, "No progress bar.")
    skip_profile_timer: bool = arg(True, acted=False)
    wandb_http_proxy: str = arg("", acted=False)

    def _validate_logging(self, errors):
        if self.logging_steps < 1:
            errors.append(f"logging_steps: must be >= 1, got {self.logging_steps}")

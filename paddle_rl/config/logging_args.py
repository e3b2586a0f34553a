from dataclasses import dataclass
from typing import Optional

from .fields import arg, at_least

DASHBOARDS = ("visualdl", "tensorboard", "wandb")
REPORT_TO_WORDS = DASHBOARDS + ("all", "none")


def report_to_words(value) -> tuple:
    """The words of a report_to value, lower case (a YAML list arrives space separated)."""
    return tuple(w.lower() for w in str(value or "").replace(",", " ").split())


@dataclass
class LoggingArgs:
    logging_dir: Optional[str] = arg(None, "Dashboard log folder (default: <output_dir>/logs).")
    logging_steps: int = arg(1, "Print and write dashboard scalars every this many steps (metrics.jsonl gets every step).")
    report_to: str = arg("visualdl", "Dashboards, comma separated: visualdl | tensorboard (event files written "
                                     "with tensorboardX, no TensorFlow needed) | wandb (offline unless $WANDB_MODE "
                                     "says otherwise; needs the wandb package) | all (every one whose package is "
                                     "installed) | none (also an empty value or list). A named dashboard whose "
                                     "package is missing stops the run.")
    run_name: Optional[str] = arg(None, "Name of the run in dashboards.")
    log_completions: bool = arg(False, "Every log_completions_steps steps, write a sample of the step's prompts "
                                       "with their responses, each reward function's score, the advantage, the "
                                       "response length and the finish reason to <output_dir>/completions.jsonl "
                                       "and as a table to the report_to dashboards (evaluations write all their "
                                       "responses to <output_dir>/eval_completions/ whatever this says).")
    log_completions_steps: Optional[int] = arg(None, "Steps between two logs of completions (default: "
                                                     "logging_steps).", check=at_least(1))
    num_completions_to_print: Optional[int] = arg(None, "Completions logged per such step, whole prompt groups "
                                                        "first (default: every completion the step trained on).",
                                                  check=at_least(1))
    disable_tqdm: bool = arg(False, "No progress bar.")
    skip_profile_timer: bool = arg(True, "false: every logged step also prints its seconds per stage (the time/* "
                                         "metrics: rollout, reward, log-probs, update, ...) on a line of its own; "
                                         "true: they are recorded in metrics.jsonl and the dashboards only.")
    wandb_http_proxy: str = arg("", "Proxy URL through which the wandb dashboard reaches its server (its http and "
                                    "https requests; wandb.Settings http_proxy / https_proxy); with no wandb "
                                    "dashboard in report_to a warning says it is not used.")

    def _validate_logging(self, errors):
        if self.logging_steps < 1:
            errors.append(f"logging_steps: must be >= 1, got {self.logging_steps}")
        words = self.report_targets
        unknown = [w for w in words if w not in REPORT_TO_WORDS]
        if unknown:
            errors.append(f"report_to: {', '.join(map(repr, unknown))} not one of {', '.join(REPORT_TO_WORDS)}")
        elif len(words) > 1 and ("none" in words or "all" in words):
            errors.append(f"report_to: none and all stand alone, got {self.report_to!r}")
        if self.wandb_http_proxy and not str(self.wandb_http_proxy).startswith(("http://", "https://", "socks")):
            errors.append(f"wandb_http_proxy: expected a proxy URL (http://host:port), got {self.wandb_http_proxy!r}")

    @property
    def report_targets(self) -> tuple:
        return report_to_words(self.report_to)

"""Non-finite numbers in training: updates with a non-finite loss or gradient norm are skipped (up to
max_nonfinite_skips in a row), and a checkpoint never holds a non-finite weight.

The trainer decides per optimizer update, and every rank decides the same (the flag is reduced over all ranks,
Layout.any_rank): an update whose loss (any micro-batch's, on any rank) or global gradient norm is NaN or inf is
not applied (no optimizer step, optimizer state and learning-rate schedule untouched, gradients cleared).
"""
import logging
from typing import Optional

import numpy as np
import paddle

logger = logging.getLogger("paddle_rl")


class NonFiniteError(RuntimeError):
    """Training met non-finite numbers it may not go past (too many skipped updates, a non-finite weight to save)."""


def param_label(param) -> str:
    """A parameter's Hugging Face name(s) (fused projections list each part), else its Paddle name."""
    spec = getattr(param, "spec", None)
    return ", ".join(spec.hf_names) if spec is not None else param.name


def first_nonfinite_grad(params) -> Optional[str]:
    """Label of the first parameter (in model order) whose gradient holds a NaN or inf, or None."""
    for p in params:
        g = p.grad
        if g is not None and not bool(paddle.isfinite(g).all()):
            return param_label(p)
    return None


def first_nonfinite_array(state: dict) -> Optional[str]:
    """Name of the first array of {name: array} holding a NaN or inf, or None."""
    for name, value in state.items():
        if not np.isfinite(np.asarray(value)).all():
            return name
    return None


class NonFiniteGuard:
    """Counts skipped updates: `consecutive` (reset by every applied update) and `total` (the run's, resumed
    from checkpoints). max_skips: consecutive skipped updates tolerated; the next non-finite update stops the run
    (0: the first one stops it; -1: never stop)."""

    def __init__(self, max_skips: int):
        self.max_skips = max_skips
        self.consecutive = 0
        self.total = 0

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def set_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))

    def applied(self) -> None:
        self.consecutive = 0

    def skip(self, step: int, update: int, updates: int, culprit: str) -> None:
        """Record a non-finite update (`culprit`: the first non-finite tensor) or raise NonFiniteError when it is one
        too many."""
        self.consecutive += 1
        where = f"step {step} (update {update} of {updates})"
        if 0 <= self.max_skips < self.consecutive:
            raise NonFiniteError(
                f"{where}: non-finite loss or gradient norm in {self.consecutive} consecutive update(s), "
                f"max_nonfinite_skips: {self.max_skips}; first non-finite tensor: {culprit}. The update was not "
                "applied and no checkpoint holds a non-finite weight (lower the learning rate, check the rewards and "
                "the data, or raise max_nonfinite_skips)")
        self.total += 1
        logger.warning("%s skipped: non-finite %s (%d in a row, %d in this run; max_nonfinite_skips: %s)", where,
                       culprit, self.consecutive, self.total, self.max_skips)

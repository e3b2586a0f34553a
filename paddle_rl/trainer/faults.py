"""Test-only fault injection (tests/test_faults.py, test_dead_rank.py, test_resume_layouts.py). A run reads these
environment variables here and nowhere else; nothing in a configuration sets them, and unset (always, outside
tests) nothing is installed and every function is a no-op. The step's faults are wrappers, not calls of the step:
with one of the variables set, the loop's layout is wrapped in `InjectingLayout` (`wrap_layout`: the update's
`loss`, gradient and `update` points in its forward_backward and clip_grad_norm_) and the trainer's rollout source in
`InjectingRollout` (`wrap_rollout`: the `rollout` point as it takes a batch). The save's points sit inside
checkpoint.py's save, once the model files are written (`die` / `fail_save` calls there).

PADDLE_RL_TEST_POISON=STEPS:TARGET[@RANK]
    In the updates of the listed steps: TARGET `loss` adds a detached NaN to every micro-batch loss (the loss is
    non-finite, its gradient is not); any other TARGET fills with NaN the gradient of the first parameter whose
    Hugging Face name contains it (after backward, before gradients are summed over ranks).
PADDLE_RL_TEST_FAIL_SAVE=STEPS[@RANK]
    Saving checkpoint-STEP raises OSError(ENOSPC) once the model files are in the temporary folder.
PADDLE_RL_TEST_DIE=STEPS:STAGE[@RANK]
    The process prints one line with the time and kills itself with SIGKILL at STAGE of the listed steps,
    DIE_DELAY seconds after reaching it (so that its peers already wait in their next collective). STAGE: `rollout`
    (the start of the step's rollout), `update` (after the first mini-batch's forward / backward, before its
    gradients are summed over the ranks) or `save` (once its part of checkpoint-STEP is in the temporary folder).
PADDLE_RL_TEST_HANG=STEPS:STAGE[@RANK]
    The same points, with SIGSTOP: the process stays alive and makes no progress (a stuck rank).

STEPS: steps (1-based) and ranges, comma-separated: `3`, `2-4`, `2,5`. @RANK: only on that global rank (default:
every rank; a save fails on rank 0, the rank that writes the model).
"""
import errno
import os
import signal
import sys
import time
from typing import Callable, Optional, Tuple

import paddle

POISON = "PADDLE_RL_TEST_POISON"
FAIL_SAVE = "PADDLE_RL_TEST_FAIL_SAVE"
DIE = "PADDLE_RL_TEST_DIE"
HANG = "PADDLE_RL_TEST_HANG"
DIE_DELAY = 1.0


def _spec(variable: str, step: int, rank: int, default_rank: Optional[int] = None) -> Optional[str]:
    """The TARGET of `variable` ("" without one) when it names this step and rank, else None."""
    value, _, only = os.environ.get(variable, "").partition("@")
    if not value or rank != (int(only) if only else rank if default_rank is None else default_rank):
        return None
    steps, _, target = value.partition(":")
    return target if step in _steps(steps) else None


def _steps(text: str) -> Tuple[int, ...]:
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return tuple(out)


def poison_loss(step: int, rank: int, loss):
    if _spec(POISON, step, rank) != "loss":
        return loss
    return loss + paddle.to_tensor(float("nan"), dtype=loss.dtype)


@paddle.no_grad()
def poison_grads(step: int, rank: int, model) -> None:
    target = _spec(POISON, step, rank)
    if not target or target == "loss":
        return
    for p in model.parameters():
        spec = getattr(p, "spec", None)
        if p.grad is not None and spec is not None and any(target in n for n in spec.hf_names):
            paddle.assign(p.grad + paddle.to_tensor(float("nan"), dtype=p.grad.dtype), output=p.grad)
            return


def fail_save(step: int, rank: int, folder: str) -> None:
    if _spec(FAIL_SAVE, step, rank, default_rank=0) is not None:
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAIL_SAVE})", folder)


def die(stage: str, step: int, rank: int) -> None:
    """SIGKILL (PADDLE_RL_TEST_DIE) or SIGSTOP (PADDLE_RL_TEST_HANG) this process at `stage` of `step`."""
    for variable, sig in ((DIE, signal.SIGKILL), (HANG, signal.SIGSTOP)):
        if _spec(variable, step, rank) == stage:
            time.sleep(DIE_DELAY)
            print(f"{variable}: rank {rank} (pid {os.getpid()}) sends itself {sig.name} at step {step} {stage}, "
                  f"time {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)


class InjectingLayout:
    """The run's layout with the update's faults: every micro-batch loss poisoned (`loss`), a gradient poisoned and
    the `update` stage's SIGKILL / SIGSTOP after the mini-batch's forward / backward, before clip_grad_norm_ sums
    the gradients over the ranks. Everything else is the layout's own."""

    def __init__(self, layout, step: Callable[[], int]):
        self._layout, self._step = layout, step

    def __getattr__(self, name):
        return getattr(self._layout, name)

    def forward_backward(self, model, mini, keys, micro, temperature, loss_fn, *args, **kwargs):
        step, rank = self._step(), self._layout.rank

        def poisoned(part, logp, entropy):
            out = loss_fn(part, logp, entropy)
            out.loss = poison_loss(step, rank, out.loss)
            return out
        return self._layout.forward_backward(model, mini, keys, micro, temperature, poisoned, *args, **kwargs)

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        step, rank = self._step(), self._layout.rank
        poison_grads(step, rank, model)
        die("update", step, rank)
        return self._layout.clip_grad_norm_(model, max_norm)


def wrap_layout(layout, step: Callable[[], int]):
    """The layout the update loop uses: `layout` itself, or wrapped (InjectingLayout) when a test set POISON, DIE or
    HANG; `step()` the step being trained (1-based)."""
    if any(os.environ.get(variable) for variable in (POISON, DIE, HANG)):
        return InjectingLayout(layout, step)
    return layout


class InjectingRollout:
    """The run's rollout source with the `rollout` stage's SIGKILL / SIGSTOP as a step's batch is taken (before it
    is generated). Everything else is the source's own."""

    def __init__(self, rollout, rank: int):
        self._rollout, self._rank = rollout, rank

    def __getattr__(self, name):
        return getattr(self._rollout, name)

    def take(self, step: int, draw):
        die("rollout", step, self._rank)
        return self._rollout.take(step, draw)


def wrap_rollout(rollout, rank: int):
    """The rollout source the trainer uses: `rollout` itself, or wrapped (InjectingRollout) when a test set DIE or
    HANG."""
    if any(os.environ.get(variable) for variable in (DIE, HANG)):
        return InjectingRollout(rollout, rank)
    return rollout

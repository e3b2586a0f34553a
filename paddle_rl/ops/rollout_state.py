"""The rollout's per-step bookkeeping: stop flags, lengths, padding of finished rows, seen tokens (for the
repetition penalty) and the min-length stop-token ban of the next step."""
from typing import NamedTuple, Optional

import paddle

from . import build


class StepState(NamedTuple):
    tokens: paddle.Tensor      # [B] int64, pad_id on rows that had already finished
    logprob: paddle.Tensor     # [B] float32, 0 on those rows
    finished: paddle.Tensor    # [B] bool
    lengths: paddle.Tensor     # [B] int64, response tokens so far (stop token included)
    ban: paddle.Tensor         # [B] bool, rows still under min_len (stop tokens banned at the next step)
    done: paddle.Tensor        # [1] bool, every row finished
    seen: Optional[paddle.Tensor]


def step_update_reference(tokens, logprob, finished, lengths, stop_ids, seen, pad_id: int, min_len: int) -> StepState:
    alive = paddle.logical_not(finished)
    tokens = paddle.where(alive, tokens, paddle.full_like(tokens, pad_id))
    logprob = paddle.where(alive, logprob, paddle.zeros_like(logprob))
    lengths = lengths + alive.astype("int64")
    if stop_ids.shape[0] > 0:
        is_stop = paddle.any(tokens.unsqueeze(-1) == stop_ids.unsqueeze(0), axis=-1)
        finished = paddle.logical_or(finished, paddle.logical_and(alive, is_stop))
    if seen is not None:
        index = paddle.clip(tokens, 0, seen.shape[-1] - 1).unsqueeze(-1)
        old = paddle.take_along_axis(seen, index, axis=-1)
        new = paddle.where(alive.unsqueeze(-1), paddle.ones_like(old), old)
        seen = paddle.put_along_axis(seen, index, new, axis=-1)
    ban = lengths < min_len
    return StepState(tokens, logprob, finished, lengths, ban, paddle.all(finished).reshape([1]), seen)


def step_update_fused(tokens, logprob, finished, lengths, stop_ids, seen, pad_id: int, min_len: int) -> StepState:
    outs = build.run("prl_step_update", tokens, logprob, finished, lengths, stop_ids, seen, int(pad_id), int(min_len))
    return StepState(*outs[:6], seen)


def step_update(tokens, logprob, finished, lengths, stop_ids, seen=None, pad_id: int = 0,
                min_len: int = 0) -> StepState:
    if (seen is None or seen.dtype == paddle.float32) and build.available():
        return step_update_fused(tokens, logprob, finished, lengths, stop_ids, seen, pad_id, min_len)
    return step_update_reference(tokens, logprob, finished, lengths, stop_ids, seen, pad_id, min_len)

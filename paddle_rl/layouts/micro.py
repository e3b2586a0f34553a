"""Micro-batches of the log-prob and update passes: which rows run together, and how one micro-batch runs.

- `max_tokens` 0: consecutive slices of a fixed number of rows (per_device_train_batch_size /
  per_device_logprob_batch_size);
- `max_tokens` > 0 (max_tokens_per_micro_batch): micro-batches by a token budget. Padded: rows sorted by length
  (longest first; a prompt group's rows of equal length stay together), each micro-batch filled while
  rows x (longest prompt + longest response) stays within the budget. Packed: a prompt group's rows stay
  together (its prompt is packed once), filled while the packed tokens stay within it. A row over the budget
  alone runs as its own micro-batch (logged once).

Each micro-batch is padded only to its own longest prompt and response (`StepBatch.micro`), or packed into one
row of real tokens (`remove_padding`: models/packing.py). The loss normalizers are mini-batch totals, so the split
changes neither the loss nor the gradients; outputs come back in the batch's row order.
"""
import logging
from typing import List

import numpy as np

from ..batch import StepBatch
from ..models.critic import packed_token_values, token_values
from ..models.logprobs import packed_token_logprobs, token_logprobs
from ..models.packing import Packing

logger = logging.getLogger("paddle_rl")


class MicroBatching:
    def __init__(self, share_prompts: bool = True, max_tokens: int = 0, remove_padding: bool = False):
        self.share_prompts = share_prompts
        self.max_tokens = max_tokens
        self.remove_padding = remove_padding
        self._told = False

    # ---------------------------------------------------------------- which rows
    def plan(self, batch: StepBatch, rows: int) -> List[np.ndarray]:
        """Row indices of each micro-batch (every row once)."""
        if not self.max_tokens:
            return [np.arange(s, min(s + rows, batch.size)) for s in range(0, batch.size, rows)]
        prompt = np.array([len(p) for p in batch["prompt_ids"]], dtype=np.int64)
        response = _used_width(batch.token_mask())
        groups = self._groups(batch)
        if self.remove_padding:
            order = np.lexsort((-response, groups))     # by group, its longest rows first
        else:
            order = np.lexsort((groups, -(prompt + response)))
        plans, current = [], []
        for i in order:
            if current and self._tokens(prompt, response, groups, current + [i]) > self.max_tokens:
                plans.append(np.array(current))
                current = []
            current.append(i)
            if len(current) == 1 and self._tokens(prompt, response, groups, current) > self.max_tokens:
                self._tell(int(prompt[i] + response[i]))
        plans.append(np.array(current))
        return [p.astype(np.int64) for p in plans if len(p)]

    def _groups(self, batch: StepBatch) -> np.ndarray:
        if self.share_prompts and "group" in batch:
            return batch.prompt_group_ids()
        return np.arange(batch.size)

    def _tokens(self, prompt, response, groups, rows) -> int:
        """Tokens the forward of `rows` holds: padded, rows x (longest prompt + longest response); packed, each
        distinct prompt once (with prompt sharing) and every response (an upper bound: see packing.py)."""
        rows = np.asarray(rows)
        if self.remove_padding:
            _, first = np.unique(groups[rows], return_index=True)
            return int(prompt[rows][first].sum() + response[rows].sum())
        return int(len(rows) * (prompt[rows].max() + response[rows].max()))

    def tokens(self, part: StepBatch) -> int:
        """The tokens a micro-batch's forward holds (`_tokens` of its rows)."""
        prompt = np.array([len(p) for p in part["prompt_ids"]], dtype=np.int64)
        return self._tokens(prompt, _used_width(part.token_mask()), self._groups(part), np.arange(part.size))

    def _tell(self, tokens: int) -> None:
        if not self._told:
            logger.warning("max_tokens_per_micro_batch %d: a sequence of %d tokens is longer; it runs as a "
                           "micro-batch of its own (said once)", self.max_tokens, tokens)
            self._told = True

    # ---------------------------------------------------------------- one micro-batch
    def logprobs(self, model, part: StepBatch, temperature: float, with_entropy: bool, with_greedy: bool = False):
        """Log-probs [b, W] (and entropy, else None; and with `with_greedy` the argmax of the logits [b, W]) of a
        micro-batch made by StepBatch.micro, as Paddle tensors (with their graph when gradients are on)."""
        if self.remove_padding:
            return packed_token_logprobs(model, self.packing(part), temperature, with_entropy, with_greedy)
        t = part.tensors()
        shared = part.shared_prompts() if self.share_prompts else None
        return token_logprobs(model, t["input_ids"], t["attention_mask"], part.prompt_width, t["response_ids"],
                              temperature, with_entropy, shared, with_greedy)

    def values(self, model, part: StepBatch):
        """A critic's values [b, W] of a micro-batch made by StepBatch.micro (a Paddle tensor, with its graph when
        gradients are on): the same positions, padding and packing as `logprobs`."""
        if self.remove_padding:
            return packed_token_values(model, self.packing(part))
        t = part.tensors()
        shared = part.shared_prompts() if self.share_prompts else None
        return token_values(model, t["input_ids"], t["attention_mask"], part.prompt_width, t["response_ids"].shape[1],
                            shared)

    def packing(self, part: StepBatch) -> Packing:
        """The micro-batch packed into one row: each distinct prompt once (with prompt sharing), then its rows'
        responses up to their masks."""
        lengths = part.token_mask().sum(1)  # real tokens; the loss mask inside them may have gaps
        groups = self._groups(part)
        _, first, prompt_of_row = np.unique(groups, return_index=True, return_inverse=True)
        prompts = [list(part["prompt_ids"][i]) for i in first]
        return Packing(prompts, prompt_of_row.reshape(-1), part["response_ids"], lengths)


def _used_width(token_mask) -> np.ndarray:
    """Per row: the last real response column, plus one (at least 1: a micro-batch keeps one column)."""
    mask = np.asarray(token_mask) > 0
    width = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(1), width, 1).astype(np.int64)

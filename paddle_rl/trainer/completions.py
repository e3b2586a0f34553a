"""Samples of a StepBatch as completion records (monitor/completions.py writes them): a training step's sampled
completions (`log_completions`) and every response of an evaluation."""
from typing import List, Optional

import numpy as np

from ..batch import StepBatch
from ..monitor.completions import pick
from .scoring import per_function_scores

# the columns a record reads (those a batch has; `advantages` only after the advantage stage)
RECORD_COLUMNS = ("item", "response_ids", "response_mask", "lengths", "truncated", "group", "sample", "reward",
                  "correct", "advantages", "turns", "tool_calls")


def record_columns(batch: StepBatch) -> list:
    return [k for k in batch.columns if k in RECORD_COLUMNS or k.startswith("reward/")]


def sample_rows(batch: StepBatch, count: Optional[int]) -> StepBatch:
    """The first `count` rows (None: all) in prompt-group order, each group's samples in order."""
    order = np.lexsort((batch["sample"], batch["group"]))
    return batch.select(order[:pick(count, batch.size)])


def completion_records(batch: StepBatch, tokenizer) -> List[dict]:
    """One record per row: prompt, response, reward, rewards (per function), correct, advantage (the mean of its
    loss tokens' advantages, one value under GRPO; None where no token entered the update), response_length,
    finish_reason (stop / length), the row's sample index and, where the dataset gives them, its ground truth and
    file."""
    texts = tokenizer.decode_batch(batch.responses())
    functions = per_function_scores(batch)
    advantages = None
    if batch.has("advantages"):
        mask = np.asarray(batch["response_mask"], dtype=np.float64) > 0
        adv = np.asarray(batch["advantages"], dtype=np.float64)
        tokens = mask.sum(1)
        advantages = np.where(tokens > 0, (adv * mask).sum(1) / np.maximum(tokens, 1), np.nan)
    correct = batch.get("correct")
    records = []
    for i, item in enumerate(batch["item"]):
        record = {"prompt": item["prompt"], "response": texts[i], "reward": float(batch["reward"][i]),
                  "rewards": {name: float(values[i]) for name, values in functions.items()}}
        if correct is not None:
            record["correct"] = bool(correct[i])
        if advantages is not None:
            record["advantage"] = float(advantages[i])
        record["response_length"] = int(batch["lengths"][i])
        record["finish_reason"] = "length" if batch["truncated"][i] else "stop"
        if batch.has("turns"):
            record["turns"], record["tool_calls"] = int(batch["turns"][i]), int(batch["tool_calls"][i])
        record["sample"] = int(batch["sample"][i])
        if item.get("ground_truth") is not None:
            record["ground_truth"] = item["ground_truth"]
        if item.get("file"):
            record["file"] = item["file"]
        records.append(record)
    return records

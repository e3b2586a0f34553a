"""Rewards on a StepBatch: each row's decoded response scored with its dataset record; the result as columns
(reward, reward/<function>, correct, skipped) and back as a RewardResult for metrics."""
import numpy as np

from ..batch import StepBatch
from ..data.records import reward_record
from ..rewards import RewardResult, RewardSample


def score(batch: StepBatch, tokenizer, reward_fn) -> None:
    """Adds the reward columns; rows need the column `item` (their dataset item). A multi-turn rollout's
    episode reward (column env_reward) reaches the reward functions as the record's `env_reward`; a failed agent
    program's sample (column agent_failed, env_plugin agent) scores 0 in every function."""
    batch.require(["item", "response_ids", "lengths", "truncated"], by="the reward")
    texts = tokenizer.decode_batch(batch.responses())
    records = [reward_record(it) for it in batch["item"]]
    if batch.has("env_reward"):
        for record, value in zip(records, batch["env_reward"]):
            record["env_reward"] = None if np.isnan(value) else float(value)
    samples = [RewardSample(it["prompt"], text, record, int(length), bool(truncated))
               for it, text, record, length, truncated in zip(batch["item"], texts, records, batch["lengths"],
                                                                batch["truncated"])]
    result = reward_fn(samples)
    if batch.has("agent_failed") and batch["agent_failed"].any():   # env_plugin agent, agent_on_failure: zero
        failed = np.asarray(batch["agent_failed"], dtype=bool)
        result.scores = np.where(failed, 0.0, result.scores).astype(np.float32)
        for name, values in result.per_function.items():
            result.per_function[name] = np.where(failed, 0.0, values).astype(np.float32)
        if result.correct is not None:
            result.correct = np.asarray(result.correct, dtype=bool) & ~failed
    add_reward_columns(batch, result)


def add_reward_columns(batch: StepBatch, result: RewardResult) -> None:
    batch["reward"] = np.asarray(result.scores, dtype=np.float32)
    for name, values in result.per_function.items():
        batch[f"reward/{name}"] = np.asarray(values, dtype=np.float32)
    if result.correct is not None:
        batch["correct"] = np.asarray(result.correct, dtype=bool)
    if result.skipped is not None:
        batch["skipped"] = np.asarray(result.skipped, dtype=bool)
    for name, counts in result.outcomes.items():
        batch[f"outcome/{name}"] = np.asarray(counts, dtype=np.float32)


def per_function_scores(batch: StepBatch) -> dict:
    return {k.split("/", 1)[1]: v for k, v in batch.columns.items() if k.startswith("reward/")}


def reward_result(batch: StepBatch) -> RewardResult:
    outcomes = {k.split("/", 1)[1]: v for k, v in batch.columns.items() if k.startswith("outcome/")}
    return RewardResult(batch["reward"], per_function_scores(batch), batch.get("correct"), batch.get("skipped"),
                        outcomes)


# columns the step-wide metrics read (reward, accuracy, lengths)
METRIC_COLUMNS = ("reward", "correct", "skipped", "lengths", "truncated", "turns", "tool_calls", "tool_errors",
                  "policy_tokens", "agent_failed")


def metric_columns(batch: StepBatch) -> list:
    return [k for k in batch.columns if k in METRIC_COLUMNS or k.startswith(("reward/", "outcome/"))]

"""Greedy evaluation on held-out prompts: accuracy and mean reward."""

from typing import Optional

import numpy as np

from ..batch import StepBatch, object_column
from ..data.loader import load_prompt_dataset
from ..models import Tokenizer, load_model
from ..monitor.completions import write_records
from ..rewards import build_reward
from ..rollout import EngineSettings, RolloutEngine, SamplingParams
from ..rollout.episodes import episode_maker as environment_episodes
from .completions import completion_records
from .preflight import preflight
from .scoring import reward_record, reward_result, score


def evaluate(engine, tokenizer, dataset, reward_fn, config, stop_ids, episodes_for=None,
             records: Optional[list] = None) -> dict:
    """`episodes_for(items, n)`: the multi-turn episodes of a chunk (None: single-turn); `records`: a list that
    receives every response's completion record (trainer/completions.py), in the dataset's order."""
    params = SamplingParams.from_config(config, stop_ids, greedy=True,
                                        max_dec_len=config.eval_max_dec_len or config.max_dec_len)
    items = dataset.items
    parts = []
    for start in range(0, len(items), config.per_device_eval_batch_size):
        chunk = items[start:start + config.per_device_eval_batch_size]
        episodes = None if episodes_for is None else episodes_for(chunk, 1)
        batch = engine.generate([it["prompt_ids"] for it in chunk], 1, params, None, episodes)
        batch["item"] = object_column(chunk)
        score(batch, tokenizer, reward_fn)
        parts.append(batch)
    batch = StepBatch.concat(parts)
    if records is not None:
        records.extend(completion_records(batch, tokenizer))
    metrics = eval_metrics(batch, "eval")
    files = np.array([it["file"] for it in items])
    names = sorted(set(files.tolist()))
    if len(names) > 1:  # one set per eval file as well (e.g. the people counts trained on and one that was not)
        for name in names:
            metrics.update(eval_metrics(batch.select(files == name), f"eval/{file_label(name)}"))
    return metrics


def eval_metrics(batch: StepBatch, prefix: str) -> dict:
    result = reward_result(batch)
    metrics = {f"{prefix}/reward_mean": float(result.scores.mean()),
               f"{prefix}/response_length_mean": float(batch["lengths"].mean()),
               f"{prefix}/num_samples": float(len(batch))}
    if result.correct is not None:
        metrics[f"{prefix}/accuracy"] = float(result.correct.mean())
    if batch.has("tool_calls"):
        metrics[f"{prefix}/tool_calls_mean"] = float(batch["tool_calls"].mean())
        metrics[f"{prefix}/tool_use_share"] = float((batch["tool_calls"] > 0).mean())
        metrics[f"{prefix}/turns_mean"] = float(batch["turns"].mean())
    if batch.has("agent_failed"):
        metrics[f"{prefix}/agent_failed_share"] = float(batch["agent_failed"].mean())
    return metrics


def file_label(name: str) -> str:
    """The metric name of an eval file: its base name without the data extension ("test_4p.jsonl" -> "test_4p")."""
    for ext in (".jsonl", ".json", ".parquet"):
        if name.endswith(ext):
            name = name[:-len(ext)]
    return name.replace("/", "_")


def run_eval(config, write_responses: Optional[str] = None) -> dict:
    """Greedy evaluation of config.actor_model_name_or_path on config.eval_datasets (no training data needed);
    `write_responses`: a JSONL file that receives every response's record, as a training run's
    eval_completions/step-N.jsonl."""
    preflight(config, train=False)  # every missing prerequisite (model, data, reward) at once, before it loads
    model_dir = config.actor_model_name_or_path  # a fetchable model's name resolved to its folder by preflight
    tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path or model_dir)
    model = load_model(model_dir, adapter=config.lora_path or None)
    dataset = load_prompt_dataset(config.eval_datasets, tokenizer, config.prompt_key, config.response_key,
                                  config.max_prompt_len, config.prompt_overflow, limit=config.max_eval_samples,
                                  apply_chat_template=config.apply_chat_template,
                                  system_prompt=config.system_prompt)
    stop_ids = sorted(set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids))
    engine = RolloutEngine(model, settings=EngineSettings.from_config(config, tokenizer.pad_token_id, stop_ids))
    records = None if write_responses is None else []
    metrics = evaluate(engine, tokenizer, dataset, build_reward(config), config, stop_ids,
                       episode_maker(config, tokenizer, stop_ids), records)  # multi-turn, as in training
    if write_responses is not None:
        write_records(write_responses, records)
    return metrics


def episode_maker(config, tokenizer, stop_ids):
    """`make(items, n)`: the multi-turn episodes of a rollout of `items`, n samples each, in the environment that
    `env_plugin` names (None without one); training and evaluation both build theirs here."""
    episodes = environment_episodes(config, tokenizer, stop_ids)
    if episodes is None:
        return None
    return lambda items, n: episodes([reward_record(it) for it in items], [it["prompt"] for it in items],
                                     [it.get("uid") for it in items], n)

"""Greedy evaluation on held-out prompts: accuracy and mean reward."""
import numpy as np

from ..rewards import RewardSample, concat_results
from ..rollout import SamplingParams


def evaluate(engine, tokenizer, dataset, reward_fn, config, stop_ids) -> dict:
    params = SamplingParams.from_config(config, stop_ids, greedy=True,
                                        max_dec_len=config.eval_max_dec_len or config.max_dec_len)
    items = dataset.items
    results, lengths = [], []
    for start in range(0, len(items), config.per_device_eval_batch_size):
        chunk = items[start:start + config.per_device_eval_batch_size]
        out = engine.generate([it["prompt_ids"] for it in chunk], 1, params)
        texts = tokenizer.decode_batch(out.responses())
        samples = [RewardSample(it["prompt"], text, _reward_record(it), int(n), bool(tr))
                   for it, text, n, tr in zip(chunk, texts, out.lengths, out.truncated)]
        results.append(reward_fn(samples))
        lengths.append(out.lengths)
    result = concat_results(results)
    metrics = {"eval/reward_mean": float(result.scores.mean()),
               "eval/response_length_mean": float(np.concatenate(lengths).mean()),
               "eval/num_samples": float(len(items))}
    if result.correct is not None:
        metrics["eval/accuracy"] = float(result.correct.mean())
    return metrics


def _reward_record(item) -> dict:
    record = dict(item["record"]) if isinstance(item["record"], dict) else {}
    if item.get("ground_truth") is not None:
        record.setdefault("ground_truth", item["ground_truth"])
    if item.get("data_source"):
        record.setdefault("data_source", item["data_source"])
    return record


def run_eval(config) -> dict:
    """Greedy evaluation of config.actor_model_name_or_path on config.eval_datasets (no training data needed)."""
    import os

    from ..data.loader import load_prompt_dataset
    from ..models import Tokenizer, load_model
    from ..rewards import build_reward
    from ..rollout import RolloutEngine

    model_dir = config.actor_model_name_or_path
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"actor_model_name_or_path: folder not found: {model_dir}")
    if not config.eval_datasets:
        raise ValueError("eval_datasets: required for evaluation")
    tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path or model_dir)
    model = load_model(model_dir)
    dataset = load_prompt_dataset(config.eval_datasets, tokenizer, config.prompt_key, config.response_key,
                                  config.max_prompt_len, config.prompt_overflow, limit=config.max_eval_samples)
    stop_ids = sorted(set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids))
    engine = RolloutEngine(model, tokenizer.pad_token_id, stop_ids, config.rollout_max_num_seqs)
    return evaluate(engine, tokenizer, dataset, build_reward(config), config, stop_ids)

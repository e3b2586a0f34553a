"""Prompt datasets: read files, name every bad line, tokenize, enforce max_prompt_len; a resumable sampler."""
import json
import logging
import os
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from .records import RecordError, to_prompt_record

logger = logging.getLogger("paddle_rl")


class DatasetError(ValueError):
    pass


def read_records(path: str) -> List[dict]:
    """Raw records of a .jsonl / .json / .parquet file; a malformed line fails with path:line and the reason."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        try:
            import pandas as pd
            return pd.read_parquet(path).to_dict(orient="records")
        except ImportError as e:
            raise DatasetError(f"{path}: reading parquet needs pandas and pyarrow ({e})") from None
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(data, list):
                raise DatasetError(f"{path}: expected a JSON list of records")
            return data
        records = []
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            records[-1] = (records[-1], lineno)
        return records


@dataclass
class PromptDataset:
    items: List[dict]                           # prompt, ground_truth, data_source, record, prompt_ids, uid
    stats: dict = field(default_factory=dict)   # truncated / dropped counts

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def load_prompt_dataset(paths: str, tokenizer, prompt_key: str = "src", response_key: str = "tgt",
                        max_prompt_len: int = 512, overflow: str = "truncate", limit: int = -1) -> PromptDataset:
    render = None
    if getattr(tokenizer, "chat_template", None):
        def render(messages):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    items, truncated, dropped = [], 0, 0
    for path in [p.strip() for p in paths.split(",") if p.strip()]:
        for index, entry in enumerate(read_records(path)):
            raw, lineno = entry if isinstance(entry, tuple) else (entry, index + 1)
            try:
                item = to_prompt_record(raw, prompt_key, response_key, render)
            except RecordError as e:
                raise DatasetError(f"{path}:{lineno}: {e}") from None
            items.append((item, path, lineno))
    texts = [it[0]["prompt"] for it in items]
    encoded = tokenizer.encode_batch(texts) if texts else []
    kept = []
    for (item, path, lineno), ids in zip(items, encoded):
        if not ids:
            raise DatasetError(f"{path}:{lineno}: empty prompt")
        if len(ids) > max_prompt_len:
            if overflow == "drop":
                dropped += 1
                continue
            ids = ids[-max_prompt_len:]
            truncated += 1
        item["prompt_ids"] = ids
        item["uid"] = f"{os.path.basename(path)}:{lineno}"
        kept.append(item)
        if 0 < limit <= len(kept):
            break
    if truncated or dropped:
        logger.warning("%s: %d prompts over max_prompt_len=%d %s", paths, truncated or dropped, max_prompt_len,
                       "truncated (kept the end)" if truncated else "dropped")
    if not kept:
        raise DatasetError(f"{paths}: no usable prompts")
    return PromptDataset(kept, {"truncated": truncated, "dropped": dropped})


class PromptSampler:
    """Batches of dataset indices; seeded shuffle per epoch; (epoch, position) is the whole state."""

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if batch_size > size:
            raise DatasetError(f"global_batch_size {batch_size} exceeds the {size} training prompts")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def next_batch(self) -> List[int]:
        if self.position >= self.size or (self.drop_last and self.position + self.batch_size > self.size):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        batch = order[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def set_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

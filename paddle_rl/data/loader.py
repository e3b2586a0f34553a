"""Prompt datasets: read files, name every bad line, tokenize, enforce max_prompt_len; a resumable sampler."""
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence, Tuple, Union

import numpy as np

from .records import TEMPLATED, ChatForm, RecordError, record_tools, sft_conversation, sft_response, to_prompt_record

logger = logging.getLogger("paddle_rl")

OVERFLOW_MODES = ("truncate", "drop")
_CHUNK = 512


class DatasetError(ValueError):
    pass


def _read_parquet(path: str) -> Iterator[Tuple[str, int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet files needs the pyarrow package (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - any reader failure names the file
        raise DatasetError(f"{path}: cannot read parquet: {e}") from None
    for row, record in enumerate(table.to_pylist(), 1):
        yield f"{path}: row {row}", row, record


def _read_json(path: str) -> Iterator[Tuple[str, int, dict]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":          # JSON lines under a .json name
            yield from _read_jsonl(path)
            return
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    for index, record in enumerate(data, 1):
        yield f"{path}: record {index}", index, record


def _read_jsonl(path: str) -> Iterator[Tuple[str, int, dict]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            yield f"{path}:{lineno}", lineno, record


def iter_records(path: str) -> Iterator[Tuple[str, int, dict]]:
    """(location, number, record) for each record of a .jsonl / .json / .parquet file.

    location is "path:LINE" for JSON lines, "path: row N" for parquet, "path: record N" for a JSON list;
    a malformed line fails with its location and the reason."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(".json"):
        return _read_json(path)
    return _read_jsonl(path)


def read_records(path: str) -> List[dict]:
    """Raw records of a .jsonl / .json / .parquet file; a malformed line fails with path:line and the reason."""
    return [record for _, _, record in iter_records(path)]


def split_paths(paths: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(paths, str):
        paths = paths.split(",")
    return [p.strip() for p in paths if p and p.strip()]


@dataclass
class PromptDataset:
    items: List[dict]                           # prompt, ground_truth, data_source, record, prompt_ids, file, uid
    stats: dict = field(default_factory=dict)   # records, kept, truncated, dropped, longest_prompt, max_prompt_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _uid_names(paths: List[str]) -> dict:
    """The file part of each uid: the base name, or the whole path where two base names coincide."""
    names = [os.path.basename(p) for p in paths]
    return {p: (n if names.count(n) == 1 else p) for p, n in zip(paths, names)}


def load_prompt_dataset(paths: Union[str, Sequence[str]], tokenizer, prompt_key: str = "src",
                        response_key: str = "tgt", max_prompt_len: int = 512, overflow: str = "truncate",
                        limit: int = -1, require_ground_truth: bool = True,
                        apply_chat_template: str = "auto", system_prompt: str = "") -> PromptDataset:
    """Prompts of every file in `paths` (comma separated), as the model sees them (records.ChatForm's rule, with
    `apply_chat_template` auto | true | false, and `system_prompt` put first where the template renders),
    tokenized.

    A prompt over `max_prompt_len` tokens is truncated (the end is kept: the generation prompt lives there)
    or dropped, per `overflow`; the counts land in `stats` and in a log line. `limit` > 0 keeps at most that
    many prompts. Every problem names the file and line."""
    if overflow not in OVERFLOW_MODES:
        raise DatasetError(f"prompt_overflow: must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    if max_prompt_len < 1:
        raise DatasetError(f"max_prompt_len: must be > 0, got {max_prompt_len}")
    files = split_paths(paths)
    if not files:
        raise DatasetError("no dataset files given")
    try:
        chat = ChatForm(tokenizer, apply_chat_template, system_prompt)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    uid_name = _uid_names(files)
    stats = {"files": len(files), "records": 0, "kept": 0, "truncated": 0, "dropped": 0, "longest_prompt": 0,
             "max_prompt_len": max_prompt_len, "overflow": overflow}
    kept: List[dict] = []

    def records():
        for path in files:
            for location, number, raw in iter_records(path):
                try:
                    item = to_prompt_record(raw, prompt_key, response_key, chat, require_ground_truth)
                except RecordError as e:
                    raise DatasetError(f"{location}: {e}") from None
                except Exception as e:  # noqa: BLE001 - e.g. a chat template that rejects the messages
                    raise DatasetError(f"{location}: cannot build the prompt: {type(e).__name__}: {e}") from None
                item["file"] = uid_name[path]
                item["uid"] = f"{item['file']}:{number}"
                yield location, item

    def take(chunk) -> bool:
        """Tokenize a chunk and keep what fits; True once `limit` prompts are kept."""
        encoded = tokenizer.encode_batch([item["prompt"] for _, item in chunk])
        for (location, item), ids in zip(chunk, encoded):
            ids = list(ids)
            stats["records"] += 1
            if not ids:
                raise DatasetError(f"{location}: the prompt has no tokens")
            stats["longest_prompt"] = max(stats["longest_prompt"], len(ids))
            if len(ids) > max_prompt_len:
                if overflow == "drop":
                    stats["dropped"] += 1
                    continue
                ids = ids[-max_prompt_len:]
                stats["truncated"] += 1
            item["prompt_ids"] = ids
            kept.append(item)
            if 0 < limit <= len(kept):
                return True
        return False

    chunk = []
    for entry in records():
        chunk.append(entry)
        if len(chunk) >= _CHUNK:
            if take(chunk):
                chunk = []
                break
            chunk = []
    if chunk:
        take(chunk)
    stats["kept"] = len(kept)
    where = ",".join(files)
    if not kept:
        raise DatasetError(f"{where}: no usable prompts ({stats['records']} records, {stats['dropped']} dropped "
                           f"over max_prompt_len={max_prompt_len})")
    logger.info("%s: %d prompts from %d records (longest %d tokens; %d truncated, %d dropped over "
                "max_prompt_len=%d)", where, stats["kept"], stats["records"], stats["longest_prompt"],
                stats["truncated"], stats["dropped"], max_prompt_len)
    if stats["truncated"]:
        logger.warning("%s: %d prompts over max_prompt_len=%d truncated (their first tokens removed); "
                       "raise max_prompt_len or set prompt_overflow: drop", where, stats["truncated"], max_prompt_len)
    if stats["dropped"]:
        logger.warning("%s: %d prompts over max_prompt_len=%d dropped", where, stats["dropped"], max_prompt_len)
    return PromptDataset(kept, stats)


def load_sft_dataset(paths, tokenizer, prompt_key: str = "src", response_key: str = "tgt",
                     max_prompt_len: int = 512, overflow: str = "truncate", max_response_len: int = 512,
                     stop_ids: Sequence[int] = (), apply_chat_template: str = "auto",
                     system_prompt: str = "") -> PromptDataset:
    """Prompt / response pairs for supervised fine-tuning: the prompts as `load_prompt_dataset` reads them (no
    ground truth needed), each item's `response_ids` its target (`records.sft_response`) tokenized, ending in a
    stop token (the first of `stop_ids` appended unless the text already ends in one), cut at `max_response_len`
    tokens (counted in `stats["responses_truncated"]`, with a warning)."""
    data = load_prompt_dataset(paths, tokenizer, prompt_key, response_key, max_prompt_len, overflow,
                               require_ground_truth=False, apply_chat_template=apply_chat_template,
                               system_prompt=system_prompt)
    texts = []
    for item in data.items:
        try:
            texts.append(sft_response(item["record"], prompt_key, response_key))
        except RecordError as e:
            raise DatasetError(f"{item['uid']}: {e}") from None
    stops = set(stop_ids)
    truncated = 0
    for item, ids in zip(data.items, tokenizer.encode_batch(texts)):
        ids = list(ids)
        # several assistant turns are learned where the template made the prompt (turns used or joined as written
        # cannot be located in a rendering: only their last answer is learned)
        conversation = (sft_conversation(item["record"], prompt_key, response_key)
                        if item["prompt_form"] == TEMPLATED else None)
        if conversation is not None:  # several assistant turns: learn each, the turns between are context
            item["prompt_ids"], ids, item["loss_mask"] = _conversation_ids(
                conversation, record_tools(item["record"]), tokenizer, stops, item["uid"], max_prompt_len)
        elif stop_ids and (not ids or ids[-1] not in stops):
            ids.append(stop_ids[0])
        if len(ids) > max_response_len:
            ids, truncated = ids[:max_response_len], truncated + 1
            if "loss_mask" in item:
                item["loss_mask"] = item["loss_mask"][:max_response_len]
        item["response_ids"] = ids
    data.stats["responses_truncated"] = truncated
    if truncated:
        logger.warning("%s: %d responses over max_dec_len=%d truncated (their ends removed; no stop token is "
                       "learned for them)", ",".join(split_paths(paths)), truncated, max_response_len)
    return data


def _conversation_ids(messages, tools, tokenizer, stops, uid, max_prompt_len):
    """A multi-turn record as (prompt ids, response ids, loss mask): the prompt is the conversation up to the first
    assistant turn (with the generation prompt), the response everything after it up to the last assistant turn's
    stop token, learned (mask 1) inside the assistant turns only (each through its stop token). A prompt over
    `max_prompt_len` keeps its end. Each turn's span is where the chat template's
    rendering up to that turn ends; a template whose renderings are not prefixes of one another is an error."""
    def ids(upto, generation):
        extra = {"tools": tools} if tools else {}
        return list(tokenizer.encode(tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation,
                                                                   **extra)))
    full = ids(len(messages), False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompt = ids(turns[0], True)
    mask = np.zeros(len(full), dtype=np.int64)
    for i in turns:
        before, through = ids(i, True), ids(i + 1, False)
        start, end = len(before), len(through)
        if full[:start] != before or full[:end] != through or end <= start:
            raise DatasetError(f"{uid}: messages[{i}] (assistant) cannot be located: the chat template's rendering "
                               "up to it (with the generation prompt) or through it is not a prefix of the whole "
                               "conversation's (a template that adds to the generation prompt what the turn itself "
                               "does not start with, or that rewrites earlier turns)")
        stop = [j for j in range(start, end) if full[j] in stops]
        mask[start:stop[-1] + 1 if stop else end] = 1  # the turn through its stop token (not the newline after)
    last = max((j for j in range(len(full)) if full[j] in stops and mask[j]), default=len(full) - 1)
    return prompt[-max_prompt_len:], full[len(prompt):last + 1], mask[len(prompt):last + 1].tolist()


class PromptSampler:
    """Batches of dataset indices; seeded shuffle per epoch; (epoch, position) is the whole state.

    Epoch e visits the permutation drawn from (seed, e), so a sampler restored with set_state_dict
    yields exactly the batches the original would have, across epoch boundaries too."""

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if size < 1:
            raise DatasetError("no training prompts")
        if batch_size < 1:
            raise DatasetError(f"global_batch_size must be >= 1, got {batch_size}")
        if batch_size > size:
            raise DatasetError(f"global_batch_size {batch_size} exceeds the {size} training prompts")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._cached = (None, None)

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached[0] == epoch:
            return self._cached[1]
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.size) if self.shuffle
                 else np.arange(self.size))
        self._cached = (epoch, order)
        return order

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def epoch_done(self) -> bool:
        """True when the next batch starts a new epoch (this epoch's batches are all taken)."""
        return self.position >= self.size or (self.drop_last and self.position + self.batch_size > self.size)

    def next_batch(self) -> List[int]:
        if self.epoch_done:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        batch = order[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "batch_size": self.batch_size,
                "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def set_state_dict(self, state: dict) -> None:
        changed = [f"{key} {state[key]!r} -> {getattr(self, key)!r}"
                   for key in ("size", "batch_size", "seed", "shuffle", "drop_last")
                   if key in state and state[key] != getattr(self, key)]
        if changed:
            logger.warning("resuming the prompt sampler with different settings (%s): the order of prompts "
                           "will not continue the checkpointed run exactly", ", ".join(changed))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

"""StepBatch: one RL step's samples as columns, one row per response; every stage reads it and adds columns.

The rollout writes prompt_ids (each row's prompt, unpadded), response_ids / response_mask / rollout_logp
([B, T], right-padded), lengths and truncated; rewards add score columns, the objective shaped scores and
advantages, the log-prob passes old_logp / ref_logp. One `select` (rows by index) and one `concat` (rows
of several batches, response columns padded to the widest) serve the engine's chunks, generation rounds,
dynamic sampling, the rollout group and the update's mini- and micro-batches.

Columns are numpy arrays whose first axis is the row; ragged per-row values (prompt token lists, dataset
records) are object arrays. Every column is declared below (`COLUMNS`: its name, whether it holds one value per
row, per response token or per prompt token, its dtype, its pad value, the stage that adds it and whether every
step has it); writing an undeclared column, or one of the wrong shape or dtype, is an error naming it. A column
whose second axis is the response (`shape` "token") is padded on concatenation with its pad value (the batch's
`pads` entry where the value depends on the model: the pad id of response_ids).
"""
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import paddle


@dataclass(frozen=True)
class Column:
    """One declared StepBatch column. shape: "row" ([B], or object values), "token" ([B, T], aligned with the
    response, padded with `pad` on concatenation) or "prompt" ([B, P], the left-padded prompt layout); dtype: the
    numpy kind it holds ("int", "float", "bool", "object"); added_by: the stage that writes it; optional: some
    steps lack it (a reader that needs it says so with `StepBatch.require`)."""
    name: str
    shape: str
    dtype: str
    added_by: str
    optional: bool = False
    pad: object = 0


_KINDS = {"int": "iu", "float": "f", "bool": "b", "object": "O"}


def _columns(*columns: Column) -> Dict[str, Column]:
    return {c.name: c for c in columns}


ROLLOUT, EPISODES, REWARD, TRAINER, LAYOUT = ("rollout (rollout/engine.py)", "multi-turn episodes (rollout/episodes.py)",
                                              "rewards (trainer/scoring.py)", "the step (trainer/trainer.py, sft.py)",
                                              "the layout (layouts/base.py)")
COLUMNS: Dict[str, Column] = _columns(
    Column("prompt_ids", "row", "object", ROLLOUT),              # each row's prompt, unpadded token lists
    Column("response_ids", "token", "int", ROLLOUT),             # padded with the batch's pads["response_ids"]
    Column("response_mask", "token", "float", ROLLOUT),          # the loss mask (policy tokens kept, not rejected)
    Column("rollout_logp", "token", "float", ROLLOUT, optional=True),  # the sampler's log-probs, until consumed
    # the argmax of the rollout's logits at each response token (-1: fed in), until rollout_corr/greedy_differs
    Column("rollout_greedy", "token", "int", ROLLOUT, optional=True, pad=-1),
    Column("lengths", "row", "int", ROLLOUT),                    # real response tokens
    Column("truncated", "row", "bool", ROLLOUT),                 # ended at max_dec_len, not at a stop token
    Column("group", "row", "int", ROLLOUT),                      # the row's prompt (global id once placed)
    Column("sample", "row", "int", ROLLOUT),                     # which of its prompt's samples
    Column("decode_steps", "row", "int", ROLLOUT, optional=True),
    Column("policy_version", "row", "int", "the asynchronous / server rollout (trainer/rollouts.py)", optional=True),
    Column("token_version", "token", "int", "partial rollout (rollout/engine.py)", optional=True, pad=-1),
    Column("turns", "row", "int", EPISODES, optional=True),
    Column("tool_calls", "row", "int", EPISODES, optional=True),
    Column("tool_errors", "row", "int", EPISODES, optional=True),
    Column("env_reward", "row", "float", EPISODES, optional=True),   # NaN: the environment gave none
    Column("policy_tokens", "row", "int", EPISODES, optional=True),
    Column("agent_failed", "row", "bool", "agent programs (rollout/agents.py)", optional=True),
    Column("prompt_variant", "row", "int", "agent programs (rollout/agents.py)", optional=True),  # within a group
    Column("item", "row", "object", TRAINER),                    # the row's dataset record
    Column("reward", "row", "float", REWARD),
    Column("correct", "row", "bool", REWARD, optional=True),
    Column("skipped", "row", "bool", REWARD, optional=True),     # the reward server skipped it (on_failure skip)
    Column("scores", "row", "float", TRAINER),                   # the shaped scores advantages are computed from
    Column("mini_batch", "row", "int", LAYOUT),
    # the row's index in the step's placed batch: the update's own old log-probs go back to it (old_logprob_pass)
    Column("row_index", "row", "int", TRAINER, optional=True),
    Column("prompt_tokens", "prompt", "int", "StepBatch.with_prompt_layout"),
    Column("prompt_mask", "prompt", "int", "StepBatch.with_prompt_layout"),
    Column("ref_logp", "token", "float", "the reference pass", optional=True),
    Column("old_logp", "token", "float", "the old-policy pass (or the rollout's log-probs, or the update's own)"),
    Column("is_weight", "token", "float", "rollout correction (rollout_is / rollout_rs)", optional=True),
    Column("values", "token", "float", "the critic's value pass (rl_algorithm ppo)", optional=True),
    Column("returns", "token", "float", "the advantage estimator, with a critic", optional=True),
    Column("advantages", "token", "float", "the advantage estimator"),
)
# families of columns named by a prefix: one per reward function / sandbox outcome
PREFIXED: Dict[str, Column] = {"reward/": Column("reward/<function>", "row", "float", REWARD, optional=True),
                               "outcome/": Column("outcome/<name>", "row", "float", REWARD, optional=True)}
RESPONSE_COLUMNS = tuple(name for name, c in COLUMNS.items() if c.shape == "token")


def column_spec(key: str) -> Column:
    """The declaration of column `key`; an undeclared name is an error naming it."""
    spec = COLUMNS.get(key)
    if spec is None:
        spec = next((c for prefix, c in PREFIXED.items() if key.startswith(prefix)), None)
    if spec is None:
        raise KeyError(f"step batch column {key!r} is not declared (paddle_rl/batch.py COLUMNS names every column, "
                       "its shape, dtype and the stage that adds it)")
    return spec


def _check_column(key: str, value: np.ndarray) -> None:
    spec = column_spec(key)
    ndim = 1 if spec.shape == "row" else 2
    if value.ndim != ndim or value.dtype.kind not in _KINDS[spec.dtype]:
        raise ValueError(f"step batch column {key!r}: {value.dtype} of {value.ndim} dimensions; declared "
                         f"{spec.dtype} per {spec.shape} ({'[B]' if ndim == 1 else '[B, width]'})")


def object_column(values: Iterable) -> np.ndarray:
    """A 1-D object array holding arbitrary per-row values (lists, dicts) without numpy broadcasting them."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int):
    """Token lists -> ids, mask [len, longest] (int64), padded on the left."""
    width = max((len(s) for s in seqs), default=0)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = s
            mask[i, width - len(s):] = 1
    return ids, mask


class StepBatch:
    def __init__(self, columns: Optional[Dict[str, np.ndarray]] = None, pads: Optional[Dict[str, object]] = None,
                 meta: Optional[dict] = None):
        self.columns: Dict[str, np.ndarray] = {}
        self.pads: Dict[str, object] = dict(pads or {})
        self.meta: dict = dict(meta or {})   # batch-wide values (prompt_width of the token layout, ...)
        for key, value in (columns or {}).items():
            self[key] = value

    # ---------------------------------------------------------------- columns
    @property
    def size(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: str) -> bool:
        return key in self.columns

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.columns:
            raise KeyError(f"step batch has no column {key!r} (columns: {', '.join(sorted(self.columns))})")
        return self.columns[key]

    def __setitem__(self, key: str, value) -> None:
        value = value if isinstance(value, np.ndarray) else np.asarray(value)
        _check_column(key, value)
        if self.columns and len(value) != self.size:
            raise ValueError(f"column {key!r} has {len(value)} rows, the batch {self.size}")
        self.columns[key] = value

    def __getattr__(self, key: str):
        columns = self.__dict__.get("columns")
        if columns is not None and key in columns:
            return columns[key]
        raise AttributeError(key)

    def group_order(self):
        """(the batch's prompt groups, column `group`, in order of first appearance; each row's position in that
        order)."""
        groups = np.asarray(self["group"])
        unique, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        position = np.empty(len(unique), dtype=np.int64)
        position[order] = np.arange(len(unique))
        return unique[order], position[inverse.reshape(-1)]

    def get(self, key: str, default=None):
        return self.columns.get(key, default)

    def has(self, key: str) -> bool:
        """Whether the batch holds optional column `key` (a declared one: a misspelt name is an error)."""
        column_spec(key)
        return key in self.columns

    def require(self, keys: Iterable[str], by: str) -> None:
        """Stage `by` needs columns `keys`: an error naming the missing ones and the stages that add them."""
        missing = [k for k in keys if k not in self.columns]
        if missing:
            raise KeyError(f"{by} needs step batch column(s) {', '.join(missing)}, added by "
                           f"{'; '.join(column_spec(k).added_by for k in missing)}; the batch has "
                           f"{', '.join(sorted(self.columns))}")

    def pop(self, key: str, *default):
        """The column, removed from the batch (`default` when given and the batch has none)."""
        return self.columns.pop(key, *default)

    # ---------------------------------------------------------------- rows
    def select(self, index) -> "StepBatch":
        """Rows by index (an int array, a boolean mask or a slice), every column."""
        if isinstance(index, slice):
            return StepBatch({k: v[index] for k, v in self.columns.items()}, self.pads, self.meta)
        index = np.asarray(index)
        if index.dtype == bool:
            index = np.flatnonzero(index)
        return StepBatch({k: v[index.astype(np.int64)] for k, v in self.columns.items()}, self.pads, self.meta)

    @staticmethod
    def concat(parts: List["StepBatch"]) -> "StepBatch":
        """Rows of several batches in order; response columns right-padded to the widest. Every part has the
        same columns."""
        parts = [p for p in parts if p.size] or parts[:1]
        if len(parts) == 1:
            return parts[0]
        keys = list(parts[0].columns)
        for p in parts[1:]:
            if list(p.columns) != keys:
                raise ValueError(f"concat: columns differ ({sorted(keys)} vs {sorted(p.columns)})")
        pads = dict(parts[0].pads)
        out = {}
        for key in keys:
            arrays = [p.columns[key] for p in parts]
            if key in RESPONSE_COLUMNS:
                width = max(a.shape[1] for a in arrays)
                value = pads.get(key, COLUMNS[key].pad)
                arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value) for a in arrays]
            out[key] = np.concatenate(arrays)
        return StepBatch(out, pads, parts[0].meta)

    def trim(self) -> "StepBatch":
        """Response columns cut to the longest response (at least one token)."""
        width = max(int(self["lengths"].max()) if self.size else 1, 1)
        columns = {k: (v[:, :width].copy() if k in RESPONSE_COLUMNS else v)
                   for k, v in self.columns.items()}
        return StepBatch(columns, self.pads, self.meta)

    # ---------------------------------------------------------------- views the stages use
    def responses(self) -> List[List[int]]:
        return [row[:n].tolist() for row, n in zip(self["response_ids"], self["lengths"])]

    def with_prompt_layout(self, pad_id: int) -> "StepBatch":
        """Adds prompt_tokens / prompt_mask [B, P], the prompts left-padded to the batch's longest (the
        [prompt | response] layout of the log-prob and update passes)."""
        ids, mask = left_pad(list(self["prompt_ids"]), pad_id)
        self["prompt_tokens"], self["prompt_mask"] = ids, mask
        self.meta["prompt_width"] = ids.shape[1]
        return self

    @property
    def prompt_width(self) -> int:
        return self.meta["prompt_width"]

    def token_mask(self, rows=slice(None)) -> np.ndarray:
        """[b, T] 1 on each row's real response tokens (its first `lengths` columns), the tokens every pass
        attends to. `response_mask` is the loss mask inside them: tokens it leaves out (a rejected token of
        rollout_rs, an environment's observation) are still part of the sequence."""
        if "lengths" not in self:
            return (np.asarray(self["response_mask"][rows]) > 0).astype(np.int64)
        width = self["response_ids"].shape[1]
        return (np.arange(width)[None, :] < np.asarray(self["lengths"][rows])[:, None]).astype(np.int64)

    def micro(self, rows) -> "StepBatch":
        """`rows` as a batch of their own in the [prompt | response] layout, padded only to their own longest
        prompt and to their last real response token (a micro-batch of the log-prob and update passes; the cut
        columns are padding, so log-probs and gradients are those of the wider layout)."""
        part = self.select(rows)
        used = np.flatnonzero(part.token_mask().any(0))
        width = int(used[-1]) + 1 if used.size else 1
        prompt_width = max(int(part["prompt_mask"].sum(1).max()) if part.size else 1, 1)
        cut = self.prompt_width - prompt_width
        columns = {}
        for key, value in part.columns.items():
            if key in ("prompt_tokens", "prompt_mask"):
                value = value[:, cut:]
            elif key in RESPONSE_COLUMNS:
                value = value[:, :width]
            columns[key] = value
        return StepBatch(columns, self.pads, dict(self.meta, prompt_width=prompt_width))

    def tensors(self, rows=slice(None), keys: Optional[List[str]] = None) -> Dict[str, paddle.Tensor]:
        """The [prompt | response] layout of `rows` as Paddle tensors, plus the named per-token columns."""
        prompt_ids, prompt_mask = self["prompt_tokens"][rows], self["prompt_mask"][rows]
        response_ids, response_mask = self["response_ids"][rows], self["response_mask"][rows]
        out = {
            "input_ids": paddle.to_tensor(np.concatenate([prompt_ids, response_ids], axis=1)),
            "attention_mask": paddle.to_tensor(np.concatenate([prompt_mask, self.token_mask(rows)], axis=1)),
            "response_ids": paddle.to_tensor(response_ids),
            "response_mask": paddle.to_tensor(np.asarray(response_mask, dtype=np.float32)),
        }
        for key in keys or []:
            out[key] = paddle.to_tensor(self[key][rows])
        return out

    def prompt_group_ids(self, rows=slice(None)) -> np.ndarray:
        """Ids of the distinct prompts of `rows`: their `group`, split by `prompt_variant` where a rollout wrote
        that column (an agent program may start the samples of one prompt group from different prompt tokens,
        rollout/agents.py); rows with the same id have the same prompt."""
        groups = np.asarray(self["group"][rows], dtype=np.int64)
        if not self.has("prompt_variant"):
            return groups
        pairs = np.stack([groups, np.asarray(self["prompt_variant"][rows], dtype=np.int64)], 1)
        return np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)

    def shared_prompts(self, rows=slice(None)):
        """(prompt_first [U], prompt_rows [b]) of `rows`: the first row of each distinct group and each row's
        group, as positions within `rows` (see CausalLM.shared_prompt_hidden_states); None when every row
        has its own group."""
        groups = self.prompt_group_ids(rows)
        _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        if len(first) == len(groups):
            return None
        return paddle.to_tensor(first.astype(np.int64)), paddle.to_tensor(inverse.reshape(-1).astype(np.int64))


def rollout_batch(prompt_ids, response_ids, response_mask, logprobs, lengths, truncated, pad_id: int, group,
                  sample) -> StepBatch:
    """The columns a rollout writes; each row carries who it is: `group` (its prompt) and `sample` (which of that
    prompt's samples)."""
    return StepBatch({"prompt_ids": object_column(list(p) for p in prompt_ids), "response_ids": response_ids,
                      "response_mask": response_mask, "rollout_logp": logprobs, "lengths": lengths,
                      "truncated": truncated, "group": np.asarray(group, dtype=np.int64),
                      "sample": np.asarray(sample, dtype=np.int64)}, pads={"response_ids": pad_id})

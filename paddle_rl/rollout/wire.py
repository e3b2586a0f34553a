"""The rollout server's wire format: what POST /v1/generate carries, both ways, and a model's identity.

Request (JSON):
    {"prompts": [[token id, ...], ...], "n": samples per prompt,
     "params": {"max_dec_len", "min_dec_len", "temperature", "top_p", "top_k", "repetition_penalty",
                "stop_token_ids"},
     "keys": [32 hex digits per sample (the two uint64 words of `sample_key`), row i * n + j: sample j of prompt i]
             (required unless temperature is 0),
     "groups": [each prompt's id in the answer's column `group`] (optional; default 0, 1, ...),
     "format": "json" (default) | "safetensors"}
Answer, format json: {"version": the policy version that generated the batch (null: the weights the server loaded),
    "rows": [{"group", "sample", "response_ids" (the response's own tokens, no padding), "logprobs" (one per
              token, float32 values written as the shortest decimal that reads back to them), "policy"
              (1 where the policy sampled the token), "finish_reason": "stop" | "length", "length",
              "decode_steps", "policy_version", "token_version" (only where the server applies weights
              mid-generation), "greedy" (the argmax of the rollout's logits at each token, -1 where fed in)}],
    "stats": the engine's counters and the seconds it generated}
A row's response columns are sent unpadded and padded again by `batch_from_rows` exactly as the engine pads them
(its pad id, log-prob 0, mask 0, width = the longest response, at least 1), so the StepBatch a client rebuilds
equals the engine's own, bit for bit.
Answer, format safetensors (Content-Type application/octet-stream): a safetensors file of the engine's padded
columns (response_ids, rollout_logp, response_mask, lengths, truncated as uint8, group, sample, decode_steps,
policy_version, token_version and rollout_greedy when present), its metadata {"version", "stats"} as JSON strings; `batch_from_parts`
places the parts of several servers. The trainer asks for it: at 512 x 2048 tokens JSON takes 0.9 s to encode and
0.5 s to decode (30 MiB), safetensors 3 ms and 1.4 ms (16 MiB; tools/rollout_wire_probe.py, docs/rollout_server.md).
"""
import hashlib
import json
from typing import List, Optional

import numpy as np
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from ..batch import StepBatch, rollout_batch
from .sampling import SamplingParams

PARAM_FIELDS = {"max_dec_len": int, "min_dec_len": int, "temperature": float, "top_p": float, "top_k": int,
                "repetition_penalty": float}


class WireError(ValueError):
    """A request or an answer that does not follow the format (the message names the field)."""


# ---------------------------------------------------------------- keys and sampling parameters
def keys_to_wire(keys) -> Optional[List[str]]:
    return None if keys is None else [np.asarray(k, dtype=np.uint64).tobytes().hex() for k in keys]


def keys_from_wire(keys, rows: int) -> Optional[np.ndarray]:
    if keys is None:
        return None
    if not isinstance(keys, list) or len(keys) != rows:
        raise WireError(f"keys: expected a list of {rows} keys (one per sample), got "
                        f"{len(keys) if isinstance(keys, list) else type(keys).__name__}")
    out = np.empty((rows, 2), dtype=np.uint64)
    for i, key in enumerate(keys):
        try:
            raw = bytes.fromhex(key)
        except (TypeError, ValueError):
            raw = b""
        if len(raw) != 16:
            raise WireError(f"keys[{i}]: expected 32 hex digits, got {str(key)[:40]!r}")
        out[i] = np.frombuffer(raw, dtype=np.uint64)
    return out


def params_to_wire(params: SamplingParams) -> dict:
    out = {name: kind(getattr(params, name)) for name, kind in PARAM_FIELDS.items()}
    out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    return out


def params_from_wire(values) -> SamplingParams:
    if not isinstance(values, dict):
        raise WireError(f"params: expected an object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(PARAM_FIELDS) - {"stop_token_ids"})
    if unknown:
        raise WireError(f"params: unknown field(s) {', '.join(unknown)} (known: {', '.join(PARAM_FIELDS)}, "
                        "stop_token_ids)")
    kwargs = {}
    for name, kind in PARAM_FIELDS.items():
        if name in values:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise WireError(f"params.{name}: expected {kind.__name__}, got {value!r}")
            kwargs[name] = kind(value)
    stops = values.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise WireError(f"params.stop_token_ids: expected a list of token ids, got {stops!r}")
    params = SamplingParams(stop_token_ids=list(stops), **kwargs)
    problems = check_params(params)
    if problems:
        raise WireError("params: " + "; ".join(problems))
    return params


def check_params(params: SamplingParams) -> List[str]:
    problems = []
    if params.max_dec_len < 1:
        problems.append(f"max_dec_len must be >= 1, got {params.max_dec_len}")
    if not 0 <= params.min_dec_len <= params.max_dec_len:
        problems.append(f"min_dec_len must be in [0, max_dec_len], got {params.min_dec_len}")
    if params.temperature < 0:
        problems.append(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        problems.append(f"top_k must be >= 0, got {params.top_k}")
    if params.repetition_penalty <= 0:
        problems.append(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    return problems


FORMATS = ("json", "safetensors")
PART_COLUMNS = ("response_ids", "rollout_logp", "response_mask", "lengths", "truncated", "group", "sample",
                "decode_steps", "policy_version")
OPTIONAL_PART_COLUMNS = ("token_version", "rollout_greedy")   # where the engine wrote them


def generate_request(prompts, n: int, params: SamplingParams, keys=None, groups=None, fmt: str = "json") -> dict:
    body = {"prompts": [[int(t) for t in p] for p in prompts], "n": int(n), "params": params_to_wire(params),
            "keys": keys_to_wire(keys), "format": fmt}
    if groups is not None:
        body["groups"] = [int(g) for g in groups]
    return body


# ---------------------------------------------------------------- the answer
def batch_to_rows(batch: StepBatch) -> List[dict]:
    """The engine's StepBatch as rows of unpadded lists (prompt ids stay with the client)."""
    rows = []
    lengths = batch["lengths"]
    for r in range(batch.size):
        k = int(lengths[r])
        row = {"group": int(batch["group"][r]), "sample": int(batch["sample"][r]),
               "response_ids": batch["response_ids"][r, :k].tolist(),
               "logprobs": [float(v) for v in batch["rollout_logp"][r, :k]],
               "policy": [int(v) for v in batch["response_mask"][r, :k]],
               "finish_reason": "length" if bool(batch["truncated"][r]) else "stop", "length": k,
               "decode_steps": int(batch["decode_steps"][r])}
        if batch.has("policy_version"):
            row["policy_version"] = int(batch["policy_version"][r])
        if batch.has("token_version"):
            row["token_version"] = batch["token_version"][r, :k].tolist()
        if batch.has("rollout_greedy"):
            row["greedy"] = batch["rollout_greedy"][r, :k].tolist()
        rows.append(row)
    return rows


def batch_from_rows(rows: List[dict], prompts, n: int, pad_id: int) -> StepBatch:
    """The StepBatch of a whole rollout from answer rows (from one server or several): row g * n + j is sample j
    of prompt g (`prompts[g]`, its `group` in the request), padded as the engine pads."""
    total = len(prompts) * n
    placed = [None] * total
    for row in rows:
        g, j = int(row["group"]), int(row["sample"])
        if not (0 <= g < len(prompts) and 0 <= j < n) or placed[g * n + j] is not None:
            raise WireError(f"answer row (group {g}, sample {j}): not a sample of this request, or sent twice")
        if not (len(row["response_ids"]) == len(row["logprobs"]) == len(row["policy"]) == int(row["length"])):
            raise WireError(f"answer row (group {g}, sample {j}): response_ids, logprobs and policy differ in length")
        placed[g * n + j] = row
    missing = [i for i, row in enumerate(placed) if row is None]
    if missing:
        raise WireError(f"answer lacks {len(missing)} samples (first: group {missing[0] // n}, "
                        f"sample {missing[0] % n})")
    width = max(1, max(int(r["length"]) for r in placed))
    response = np.full((total, width), pad_id, dtype=np.int64)
    logprobs = np.zeros((total, width), dtype=np.float32)
    mask = np.zeros((total, width), dtype=np.float32)
    for i, row in enumerate(placed):
        k = int(row["length"])
        response[i, :k] = row["response_ids"]
        logprobs[i, :k] = np.asarray(row["logprobs"], dtype=np.float64).astype(np.float32)
        mask[i, :k] = row["policy"]
    lengths = np.array([int(r["length"]) for r in placed], dtype=np.int64)
    truncated = np.array([r["finish_reason"] == "length" for r in placed])
    out = rollout_batch([prompts[i // n] for i in range(total)], response, mask, logprobs, lengths, truncated,
                        pad_id, [i // n for i in range(total)], [i % n for i in range(total)])
    out["decode_steps"] = np.array([int(r["decode_steps"]) for r in placed], dtype=np.int64)
    out["policy_version"] = np.array([int(r.get("policy_version", -1)) for r in placed], dtype=np.int64)
    if any("token_version" in r for r in placed):
        versions = np.full((total, width), -1, dtype=np.int64)
        for i, row in enumerate(placed):
            versions[i, :len(row.get("token_version", []))] = row.get("token_version", [])
        out["token_version"] = versions
    if all("greedy" in r for r in placed):
        greedy = np.full((total, width), -1, dtype=np.int64)
        for i, row in enumerate(placed):
            greedy[i, :int(row["length"])] = row["greedy"]
        out["rollout_greedy"] = greedy
    return out


def batch_to_safetensors(batch: StepBatch, version, stats: dict) -> bytes:
    columns = {k: np.ascontiguousarray(batch[k]) for k in PART_COLUMNS + OPTIONAL_PART_COLUMNS if k in batch}
    columns["truncated"] = columns["truncated"].astype(np.uint8)
    return save_safetensors(columns, metadata={"version": json.dumps(version), "stats": json.dumps(stats)})


def part_from_safetensors(blob: bytes) -> dict:
    """{"version", "stats", "columns"} of a safetensors answer (the metadata read from the file's header: 8 bytes
    of header length, little-endian, then the JSON header with its "__metadata__")."""
    try:
        size = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8:8 + size]).get("__metadata__") or {}
        columns = load_safetensors(blob)
    except Exception as e:  # noqa: BLE001 - the server's bytes: a WireError naming why
        raise WireError(f"the answer is not a safetensors file ({e})") from None
    missing = [k for k in PART_COLUMNS if k not in columns]
    if missing:
        raise WireError(f"safetensors answer lacks column(s) {', '.join(missing)}")
    return {"version": json.loads(meta.get("version", "null")), "stats": json.loads(meta.get("stats", "{}")),
            "columns": columns}


def batch_from_parts(parts: List[dict], prompts, n: int, pad_id: int) -> StepBatch:
    """The StepBatch of a whole rollout from the padded columns of one or more answers (`part_from_safetensors`):
    row g * n + j is sample j of prompt g, padded as the engine pads."""
    total = len(prompts) * n
    index = [p["group"].astype(np.int64) * n + p["sample"].astype(np.int64) for p in parts]
    flat = np.concatenate(index) if index else np.zeros(0, np.int64)
    if len(flat) != total or (flat < 0).any() or (flat >= total).any() or len(np.unique(flat)) != total:
        raise WireError(f"the answers hold {len(flat)} samples, not each of the request's {total} once")
    width = max(1, max(int(p["lengths"].max()) for p in parts))
    response = np.full((total, width), pad_id, dtype=np.int64)
    logprobs = np.zeros((total, width), dtype=np.float32)
    mask = np.zeros((total, width), dtype=np.float32)
    lengths, truncated = np.zeros(total, np.int64), np.zeros(total, bool)
    decode_steps, versions = np.zeros(total, np.int64), np.full(total, -1, np.int64)
    token_versions = np.full((total, width), -1, np.int64) if any("token_version" in p for p in parts) else None
    greedy = np.full((total, width), -1, np.int64) if all("rollout_greedy" in p for p in parts) else None
    for rows, part in zip(index, parts):
        w = min(width, part["response_ids"].shape[1])
        response[rows, :w] = part["response_ids"][:, :w]
        logprobs[rows, :w] = part["rollout_logp"][:, :w]
        mask[rows, :w] = part["response_mask"][:, :w]
        lengths[rows], truncated[rows] = part["lengths"], part["truncated"].astype(bool)
        decode_steps[rows], versions[rows] = part["decode_steps"], part["policy_version"]
        if token_versions is not None and "token_version" in part:
            token_versions[rows, :w] = part["token_version"][:, :w]
        if greedy is not None:
            greedy[rows, :w] = part["rollout_greedy"][:, :w]
    out = rollout_batch([prompts[i // n] for i in range(total)], response, mask, logprobs, lengths, truncated,
                        pad_id, [i // n for i in range(total)], [i % n for i in range(total)])
    out["decode_steps"], out["policy_version"] = decode_steps, versions
    if token_versions is not None:
        out["token_version"] = token_versions
    if greedy is not None:
        out["rollout_greedy"] = greedy
    return out


# ---------------------------------------------------------------- identity
def vocabulary_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (every token and its id, added tokens included): two tokenizers with
    the same hash map ids to the same text."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()


def model_identity(model_config, tokenizer) -> dict:
    """What a trainer and a rollout server must agree on before weights and token ids travel between them."""
    return {"architecture": model_config.family.architecture, "model_type": model_config.model_type,
            "vocab_size": int(model_config.vocab_size), "hidden_size": int(model_config.hidden_size),
            "num_hidden_layers": int(model_config.num_hidden_layers),
            "tokenizer_vocab_sha256": vocabulary_hash(tokenizer), "pad_token_id": int(tokenizer.pad_token_id)}


def identity_differences(mine: dict, theirs: dict) -> List[str]:
    """`key: here X, server Y` for each identity field that differs (a field the server lacks counts)."""
    return [f"{key}: trainer {mine[key]!r}, server {theirs.get(key)!r}" for key in mine if theirs.get(key) != mine[key]]

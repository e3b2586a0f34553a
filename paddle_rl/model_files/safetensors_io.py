"""Read and write model.safetensors (single file or sharded with an index), bf16 included."""
import json
import os
from typing import Dict

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file as _save_f32_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


def _save_bf16_file(tensors: Dict[str, np.ndarray], path: str, metadata: dict) -> None:
    """A safetensors file of BF16 tensors (safetensors' numpy backend has no bfloat16: the layout written by
    hand, a little-endian u64 header length, the JSON header padded to 8 bytes, then the raw data)."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        blob = f32_to_bf16(tensors[name]).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def _read_bf16_tensors(path: str, names) -> Dict[str, np.ndarray]:
    """safetensors' numpy backend has no bfloat16: read those tensors from the raw layout."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        out = {}
        for name in names:
            meta = header[name]
            start, end = meta["data_offsets"]
            f.seek(base + start)
            raw = np.frombuffer(f.read(end - start), dtype=np.uint16).reshape(meta["shape"])
            out[name] = _bf16_to_f32(raw)
        return out


def read_file(path: str) -> Dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    tensors, bf16 = {}, []
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    for name, meta in header.items():
        if name != "__metadata__" and meta["dtype"] == "BF16":
            bf16.append(name)
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            if name not in bf16:
                tensors[name] = f.get_tensor(name)
    tensors.update(_read_bf16_tensors(path, bf16))
    return {k: v.astype(np.float32) if v.dtype != np.float32 else v for k, v in tensors.items()}


def load_state(folder: str) -> Dict[str, np.ndarray]:
    """All tensors of a checkpoint folder as float32 numpy arrays."""
    index_path = os.path.join(folder, INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        state = {}
        for shard in sorted(set(weight_map.values())):
            state.update(read_file(os.path.join(folder, shard)))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise KeyError(f"{index_path}: tensors listed but not found in shards: {missing[:5]}")
        return state
    single = os.path.join(folder, SINGLE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"checkpoint file not found: {single} (nor {INDEX})")
    return read_file(single)


SAVE_DTYPES = ("float32", "bfloat16")


def save_state(folder: str, state: Dict[str, np.ndarray], max_shard_bytes: int = 5 * 1024**3,
               dtype: str = "float32") -> None:
    """Write one model.safetensors, or shards plus an index when larger than max_shard_bytes; `dtype` float32 or
    bfloat16 (rounded to nearest even)."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_dtype: must be float32 or bfloat16, got {dtype!r}")
    os.makedirs(folder, exist_ok=True)
    names = sorted(state)
    itemsize = 2 if dtype == "bfloat16" else 4
    save_file = _save_f32_file if dtype == "float32" else _save_bf16_file
    shards, current, size = [], {}, 0
    for name in names:
        nbytes = state[name].size * itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(state[name])
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, SINGLE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(v.size * itemsize for v in state.values())
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)

"""Checkpoint state without pickle: tensors into a safetensors file, everything else into JSON.

`write_state(folder, stem, tree)` writes `<stem>.json` and, when the tree holds arrays, `<stem>.safetensors`;
`read_state(folder, stem)` gives the tree back with the same types: dicts (any hashable JSON keys: str, int,
float, bool, None, tuples of those), lists, tuples, str / int / float (NaN and inf included) / bool / None, NumPy
arrays (numbers, booleans; 1-D object arrays of such values) and scalars, Paddle tensors (bfloat16 and float16
included) and step batches. Reading either file runs no code: safetensors holds a JSON header and raw
little-endian numbers, and the JSON is decoded by `json.loads` into the tags below. A type outside this list is refused when writing (TypeError naming where in the tree it is).

JSON tags (a dict with one key starting with "__"; a plain dict with such a key is written as "__dict__"):
  {"__tensor__": name, "dtype": "bfloat16"}   a Paddle tensor (its array is tensor `name` of the safetensors file)
  {"__array__": name}                          a NumPy array
  {"__objects__": [...]}                       a 1-D NumPy object array (its values encoded one by one)
  {"__scalar__": dtype, "value": v}            a NumPy scalar
  {"__tuple__": [...]}, {"__dict__": [[key, value], ...]}, {"__batch__": {columns, pads, meta}}
"""
import json
import os
from typing import Any, Dict

import numpy as np
import paddle
from safetensors import safe_open
from safetensors.numpy import save_file

from ..batch import StepBatch, object_column

FORMAT = "paddle_rl.state/1"


def state_paths(folder: str, stem: str):
    return os.path.join(folder, stem + ".json"), os.path.join(folder, stem + ".safetensors")


def write_state(folder: str, stem: str, tree: Any) -> None:
    arrays: Dict[str, np.ndarray] = {}
    encoded = _encode(tree, arrays, "state")
    json_path, tensor_path = state_paths(folder, stem)
    if arrays:
        save_file(arrays, tensor_path)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "tensors": os.path.basename(tensor_path) if arrays else None,
                   "state": encoded}, f)


def has_state(folder: str, stem: str) -> bool:
    return os.path.isfile(state_paths(folder, stem)[0])


def read_state(folder: str, stem: str) -> Any:
    json_path, tensor_path = state_paths(folder, stem)
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{json_path}: not a paddle-rl state file (format {FORMAT!r} expected, got "
                         f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r})")
    arrays = {}
    if doc.get("tensors"):
        with safe_open(tensor_path, framework="numpy") as f:
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    return _decode(doc["state"], arrays, json_path)


# ---------------------------------------------------------------------------------------------------- encoding
def _store(array: np.ndarray, arrays: dict, where: str) -> str:
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{where}: an array of dtype {array.dtype} cannot be stored (numbers and booleans only)")
    name = f"t{len(arrays):06d}"
    arrays[name] = np.ascontiguousarray(array)
    return name


def _encode(value, arrays: dict, where: str):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and type(value) in (int, float):
        return value
    if isinstance(value, paddle.Tensor):
        dtype = str(value.dtype).replace("paddle.", "")
        return {"__tensor__": _store(value.numpy(), arrays, where), "dtype": dtype}
    if isinstance(value, np.ndarray):
        if value.dtype == object and value.ndim == 1:  # a batch's per-row values (prompt ids: lists of ints)
            return {"__objects__": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
        return {"__array__": _store(value, arrays, where)}
    if isinstance(value, np.generic):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{where}: a NumPy scalar of dtype {value.dtype} cannot be stored")
        return {"__scalar__": value.dtype.str, "value": value.item()}
    if isinstance(value, StepBatch):
        return {"__batch__": {"columns": _encode(value.columns, arrays, where + ".columns"),
                              "pads": _encode(value.pads, arrays, where + ".pads"),
                              "meta": _encode(value.meta, arrays, where + ".meta")}}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, arrays, f"{where}.{k}") for k, v in value.items()}
        return {"__dict__": [[_encode(k, arrays, f"{where} key {k!r}"), _encode(v, arrays, f"{where}[{k!r}]")]
                             for k, v in value.items()]}
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__name__} cannot be stored in a checkpoint "
                    "(JSON values, tuples, NumPy arrays (numbers, booleans, 1-D object arrays of such values) and scalars, Paddle tensors and step batches only)")


def _decode(value, arrays: dict, path: str):
    if isinstance(value, list):
        return [_decode(v, arrays, path) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        array = _array(value["__tensor__"], arrays, path)
        if value["dtype"] == "bfloat16":   # NumPy has no bfloat16: its bits travel as uint16
            return paddle.to_tensor(array).view(paddle.bfloat16)
        return paddle.to_tensor(array, dtype=value["dtype"])
    if "__array__" in value:
        return _array(value["__array__"], arrays, path)
    if "__objects__" in value:
        return object_column(_decode(v, arrays, path) for v in value["__objects__"])
    if "__scalar__" in value:
        return np.dtype(value["__scalar__"]).type(value["value"])
    if "__tuple__" in value:
        return tuple(_decode(v, arrays, path) for v in value["__tuple__"])
    if "__dict__" in value:
        return {_hashable(_decode(k, arrays, path)): _decode(v, arrays, path) for k, v in value["__dict__"]}
    if "__batch__" in value:
        parts = {k: _decode(v, arrays, path) for k, v in value["__batch__"].items()}
        return StepBatch(parts["columns"], parts["pads"], parts["meta"])
    return {k: _decode(v, arrays, path) for k, v in value.items()}


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _array(name: str, arrays: dict, path: str) -> np.ndarray:
    if name not in arrays:
        raise KeyError(f"{path}: tensor {name!r} is missing from its safetensors file")
    return arrays[name]


__all__ = ["write_state", "read_state", "has_state", "state_paths"]

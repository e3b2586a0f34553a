"""Load and save a decoder + tokenizer folder in the Hugging Face layout."""
import json
import os
import shutil
from typing import Optional

import numpy as np
import paddle

from .config import ModelConfig
from .decoder import CausalLM
from .layout import hf_to_local, local_to_hf
from .safetensors_io import load_state, save_state

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def load_model(folder: str, config: Optional[ModelConfig] = None, tp_group=None) -> CausalLM:
    """The model of a Hugging Face folder; with `tp_group` each rank builds tensor-parallel layers and keeps
    its own shard of every split tensor."""
    config = config or ModelConfig.from_pretrained(folder)
    model = CausalLM(config, tp_group)
    load_local_state(model, read_local_state(folder, config, tp_group), source=folder)
    return model


def read_local_state(folder: str, config: ModelConfig, tp_group=None) -> dict:
    """A checkpoint's tensors under this decoder's names (this rank's shards under tensor parallelism)."""
    try:
        local = hf_to_local(config, load_state(folder))
    except KeyError as e:
        raise KeyError(f"{folder}: checkpoint lacks tensor {e.args[0]}") from None
    if tp_group is not None:
        from ..parallel.tensor_parallel import shard_state
        local = shard_state(config, local, tp_group.rank, tp_group.nranks)
    return local


def load_local_state(model: CausalLM, local: dict, source: str = "state") -> None:
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name not in local:
            raise KeyError(f"{source}: missing tensor for parameter {name}")
        value = local[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{source}: {name} has shape {list(value.shape)}, model expects {list(param.shape)}")
        param.set_value(paddle.to_tensor(np.ascontiguousarray(value), dtype=param.dtype))


def model_state_numpy(model: CausalLM) -> dict:
    """Full (unsharded) numpy state; a tensor-parallel model gathers its shards (collective over its group)."""
    if getattr(model, "tp_group", None) is not None:
        from ..parallel.tensor_parallel import gather_state
        return gather_state(model, model.tp_group)
    return {name: param.numpy() for name, param in model.named_parameters()}


def save_model(model: CausalLM, folder: str, tokenizer_folder: Optional[str] = None,
               max_shard_bytes: int = 5 * 1024**3, state: Optional[dict] = None) -> None:
    """One ordinary checkpoint. A tensor-parallel model is gathered (every rank of its group calls this) and
    written by the group's first rank; `state` passes an already gathered full state instead."""
    if state is None:
        state = model_state_numpy(model)
        group = getattr(model, "tp_group", None)
        if group is not None and group.rank != 0:
            return
    os.makedirs(folder, exist_ok=True)
    model.config.save(folder)
    save_state(folder, local_to_hf(model.config, state), max_shard_bytes=max_shard_bytes)
    if tokenizer_folder:
        copy_tokenizer_files(tokenizer_folder, folder)


def copy_tokenizer_files(src: str, dst: str) -> None:
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(path, os.path.join(dst, name))


def write_generation_config(folder: str, eos_token_ids, pad_token_id=None) -> None:
    data = {"eos_token_id": list(eos_token_ids)}
    if pad_token_id is not None:
        data["pad_token_id"] = pad_token_id
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)

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


def load_model(folder: str, config: Optional[ModelConfig] = None) -> CausalLM:
    config = config or ModelConfig.from_pretrained(folder)
    model = CausalLM(config)
    try:
        local = hf_to_local(config, load_state(folder))
    except KeyError as e:
        raise KeyError(f"{folder}: checkpoint lacks tensor {e.args[0]}") from None
    load_local_state(model, local, source=folder)
    return model


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
    return {name: param.numpy() for name, param in model.named_parameters()}


def save_model(model: CausalLM, folder: str, tokenizer_folder: Optional[str] = None,
               max_shard_bytes: int = 5 * 1024**3) -> None:
    os.makedirs(folder, exist_ok=True)
    model.config.save(folder)
    save_state(folder, local_to_hf(model.config, model_state_numpy(model)), max_shard_bytes=max_shard_bytes)
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

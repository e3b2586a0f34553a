"""Load and save a decoder + tokenizer folder in the Hugging Face layout."""
import json
import os
import shutil
from typing import Optional

import numpy as np
import paddle

from ..model_files.safetensors_io import load_state, save_state
from .config import ModelConfig
from .decoder import CausalLM
from .layers import specs_of
from .lora import WEIGHTS_FILE as ADAPTER_WEIGHTS
from .lora import (AdapterError, LoraSettings, add_adapters, has_adapter, merge_state, read_adapter,
                   save_adapter)

MERGED_FOLDER = "merged"  # a LoRA checkpoint's merged weights (merge_lora)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def load_model(folder: str, config: Optional[ModelConfig] = None, tp_group=None, stage=(0, 1),
               lora: Optional[LoraSettings] = None, adapter: Optional[str] = None) -> CausalLM:
    """The model of a Hugging Face folder; with `tp_group` each rank builds tensor-parallel layers and keeps
    its own shard of every split tensor; `stage=(index, count)` keeps one pipeline stage.

    LoRA (models/lora.py): `lora` puts fresh adapters on the frozen base; `adapter` (a PEFT folder:
    adapter_config.json, adapter_model.safetensors) puts that adapter's weights on it, with its own settings
    unless `lora` gives them (lora_settings of a config reconciles the two)."""
    if config is None and not os.path.isfile(os.path.join(folder, "config.json")) and has_adapter(folder):
        raise AdapterError(f"{folder} holds a LoRA adapter, not a model: load the base model with "
                           f"adapter={folder!r} (lora_path in a config)")
    config = config or ModelConfig.from_pretrained(folder)
    model = unfilled(config, tp_group, stage)
    load_weights(model, folder)
    if adapter is not None:
        add_adapters(model, lora or LoraSettings.from_peft(adapter))
        load_weights(model, adapter)
    elif lora is not None:
        add_adapters(model, lora)
    model.base_folder = folder
    return model


def unfilled(config: ModelConfig, tp_group=None, stage=(0, 1)) -> CausalLM:
    """A model whose parameters hold no values yet, for load_weights to fill (paddle.LazyGuard: neither memory nor
    the initializers' random numbers until a value is set). Building SmolLM2-135M with its initializers took
    ~2.1 s that loading then overwrote; unfilled it takes 0.07 s, and the loaded weights are the same bits."""
    with paddle.LazyGuard():
        return CausalLM(config, tp_group, stage)


def load_weights(model: CausalLM, source) -> None:
    """Overwrite a model's parameters from a Hugging Face folder or a {HF name: array} state (each rank takes
    its own shard through the parameters' specs). A model with LoRA adapters reads only its adapters from a
    folder holding one (a PEFT adapter, or a LoRA run's checkpoint): the base stays the one it was built on."""
    params = specs_of(model)
    if isinstance(source, str) and model.lora is not None and has_adapter(source):
        tensors, where = read_adapter(source), os.path.join(source, ADAPTER_WEIGHTS)
        params = specs_of(model, frozen=False)
    else:
        tensors, where = (load_state(source), source) if isinstance(source, str) else (source, "state")
    group = model.tp_group
    rank, size = (0, 1) if group is None else (group.rank, group.nranks)
    for name, param in params:
        try:
            value = param.spec.shard(param.spec.from_hf(tensors), rank, size)
        except KeyError as e:
            raise KeyError(f"{where}: checkpoint lacks tensor {e.args[0]} (parameter {name})") from None
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{where}: {', '.join(param.spec.hf_names)} gives shape {list(value.shape)} for "
                             f"{name}, model expects {list(param.shape)}")
        value = np.ascontiguousarray(value)
        # float32 into a float32 parameter: one copy (set_value of the array), not two (a tensor of it first)
        param.set_value(value if value.dtype == np.float32 and param.dtype == paddle.float32 else
                        paddle.to_tensor(value, dtype=param.dtype))
    # an unfilled model (`unfilled`) must not reach a pass with a parameter that holds nothing
    empty = [name for name, param in model.named_parameters() if not param._is_initialized()]
    if empty:
        raise ValueError(f"{where}: parameters left without a value: {', '.join(empty[:5])}"
                         + (f" and {len(empty) - 5} more" if len(empty) > 5 else ""))


def state_problem(model: CausalLM, tensors, exact: bool = True) -> Optional[str]:
    """What keeps a {HF name: array} state from replacing every weight of a one-process `model` (None: nothing):
    a tensor it lacks, one that gives a parameter another shape, and with `exact` one the model does not have.
    load_weights checks as it writes, so a state refused half-way leaves the first parameters replaced; this reads
    everything first and writes nothing (a server fed states by its clients asks it first)."""
    wanted = set()
    for name, param in specs_of(model):
        wanted.update(param.spec.hf_names)
        try:
            value = param.spec.from_hf(tensors)
        except KeyError as e:
            return f"the state lacks tensor {e.args[0]} (parameter {name})"
        except ValueError as e:   # tensors of one fused parameter that do not concatenate
            return f"{', '.join(param.spec.hf_names)} do not make parameter {name}: {e}"
        if tuple(value.shape) != tuple(param.shape):
            return (f"{', '.join(param.spec.hf_names)} gives shape {list(value.shape)} for {name}, the model expects "
                    f"{list(param.shape)}")
    unknown = sorted(set(tensors) - wanted) if exact else []
    return f"{unknown[0]} is not a tensor of this model" if unknown else None


def hf_state(model: CausalLM, frozen: bool = True) -> dict:
    """This model's full tensors under their Hugging Face names (a LoRA model's adapters under PEFT's module
    names; `frozen=False`: the adapters only); a tensor-parallel model gathers its shards (a collective over its
    group: every rank calls it)."""
    import paddle.distributed as dist
    group = model.tp_group
    out = {}
    for _, param in specs_of(model, frozen):
        if group is None or not param.is_distributed:
            full = param.numpy() if param.dtype == paddle.float32 else param.astype("float32").numpy()
        else:
            shards: list = []
            dist.all_gather(shards, param.detach(), group=group)
            full = param.spec.unshard([s.numpy() for s in shards])
        out.update(param.spec.to_hf(full))
    return out


def saves_frozen(model: CausalLM) -> bool:
    """Whether a checkpoint holds the frozen parameters: always, except a LoRA model's base (its adapters are
    saved, and the base too only to write the merged weights)."""
    return model.lora is None or model.lora.save_merged


def checkpoint_state(model: CausalLM) -> dict:
    """What a checkpoint of this model holds (gathered; a collective under tensor parallelism)."""
    return hf_state(model, frozen=saves_frozen(model))


def save_model(model: CausalLM, folder: str, tokenizer_folder: Optional[str] = None,
               max_shard_bytes: int = 5 * 1024**3, state: Optional[dict] = None, dtype: str = "float32") -> None:
    """One ordinary checkpoint. A tensor-parallel model is gathered (every rank of its group calls this) and
    written by the group's first rank; `state` passes an already gathered state (checkpoint_state) instead.
    A LoRA model writes its adapter in PEFT's layout, and with `save_merged` the merged weights as an ordinary
    Hugging Face model in the subfolder `merged/` (not beside the adapter: transformers would read
    adapter_config.json there and add the adapter a second time). `dtype` (float32 | bfloat16): the Hugging Face
    weights' dtype on disk (config.json's torch_dtype); a LoRA adapter stays float32."""
    if state is None:
        state = checkpoint_state(model)
        if model.tp_group is not None and model.tp_group.rank != 0:
            return
    os.makedirs(folder, exist_ok=True)
    if model.lora is not None:
        save_adapter(folder, state, model.lora, base=getattr(model, "base_folder", ""),
                     modules_to_save=("score",) if model.config.sequence_classifier else ())
        if model.lora.save_merged:
            _save_plain(model, os.path.join(folder, MERGED_FOLDER), merge_state(state, model.lora), tokenizer_folder,
                        max_shard_bytes, dtype)
        if tokenizer_folder:
            copy_tokenizer_files(tokenizer_folder, folder)
        return
    _save_plain(model, folder, state, tokenizer_folder, max_shard_bytes, dtype)


def _save_plain(model: CausalLM, folder: str, state: dict, tokenizer_folder: Optional[str], max_shard_bytes: int,
                dtype: str = "float32"):
    os.makedirs(folder, exist_ok=True)
    model.config.save(folder, dtype)
    save_state(folder, state, max_shard_bytes=max_shard_bytes, dtype=dtype)
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

"""Hugging Face tensor names and orientation <-> this decoder's fused parameters.

HF Linear weights are [out, in]; Paddle's are [in, out]. q/k/v and gate/up are concatenated
along the output axis into qkv_proj and gate_up_proj.
"""
from typing import Dict

import numpy as np

from .config import ModelConfig

HF_PREFIX = "model."


def hf_to_local(config: ModelConfig, hf: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Map a full HF state dict (numpy) to this model's parameter names. Raises KeyError naming the missing tensor."""
    def take(name):
        if name not in hf:
            raise KeyError(name)
        return hf[name]

    local = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        local["lm_head.weight"] = take("lm_head.weight").T
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = (take(f"{src}self_attn.{p}_proj.weight") for p in "qkv")
        local[f"{dst}self_attn.qkv_proj.weight"] = np.concatenate([q, k, v], axis=0).T
        if config.attention_bias:
            local[f"{dst}self_attn.qkv_proj.bias"] = np.concatenate(
                [take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"], axis=0)
        local[f"{dst}self_attn.o_proj.weight"] = take(f"{src}self_attn.o_proj.weight").T
        if config.uses_qk_norm:
            local[f"{dst}self_attn.q_norm.weight"] = take(f"{src}self_attn.q_norm.weight")
            local[f"{dst}self_attn.k_norm.weight"] = take(f"{src}self_attn.k_norm.weight")
        gate, up = take(f"{src}mlp.gate_proj.weight"), take(f"{src}mlp.up_proj.weight")
        local[f"{dst}mlp.gate_up_proj.weight"] = np.concatenate([gate, up], axis=0).T
        local[f"{dst}mlp.down_proj.weight"] = take(f"{src}mlp.down_proj.weight").T
        local[f"{dst}input_layernorm.weight"] = take(f"{src}input_layernorm.weight")
        local[f"{dst}post_attention_layernorm.weight"] = take(f"{src}post_attention_layernorm.weight")
    return local


def local_to_hf(config: ModelConfig, local: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    hf = {"model.embed_tokens.weight": local["embed_tokens.weight"], "model.norm.weight": local["norm.weight"]}
    if not config.tie_word_embeddings:
        hf["lm_head.weight"] = local["lm_head.weight"].T
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    bounds = [q_size, q_size + kv_size]
    for i in range(config.num_hidden_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for name, part in zip("qkv", np.split(local[f"{src}self_attn.qkv_proj.weight"].T, bounds, axis=0)):
            hf[f"{dst}self_attn.{name}_proj.weight"] = part
        if config.attention_bias:
            for name, part in zip("qkv", np.split(local[f"{src}self_attn.qkv_proj.bias"], bounds, axis=0)):
                hf[f"{dst}self_attn.{name}_proj.bias"] = part
        hf[f"{dst}self_attn.o_proj.weight"] = local[f"{src}self_attn.o_proj.weight"].T
        if config.uses_qk_norm:
            hf[f"{dst}self_attn.q_norm.weight"] = local[f"{src}self_attn.q_norm.weight"]
            hf[f"{dst}self_attn.k_norm.weight"] = local[f"{src}self_attn.k_norm.weight"]
        gate, up = np.split(local[f"{src}mlp.gate_up_proj.weight"].T, 2, axis=0)
        hf[f"{dst}mlp.gate_proj.weight"], hf[f"{dst}mlp.up_proj.weight"] = gate, up
        hf[f"{dst}mlp.down_proj.weight"] = local[f"{src}mlp.down_proj.weight"].T
        hf[f"{dst}input_layernorm.weight"] = local[f"{src}input_layernorm.weight"]
        hf[f"{dst}post_attention_layernorm.weight"] = local[f"{src}post_attention_layernorm.weight"]
    return {k: np.ascontiguousarray(v) for k, v in hf.items()}

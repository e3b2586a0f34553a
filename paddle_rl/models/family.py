"""Model families: what distinguishes one dense decoder architecture from another, in one table.

The decoder (decoder.py) is built from a family's switches; the Hugging Face tensor names come from
the layers themselves (layers.py). Adding a dense family whose layers already exist (Mistral, say) is one
`register_family` call here (and a parity test): nothing else lists families or their names.
"""
from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Family:
    model_type: str               # config.json "model_type"
    architecture: str             # config.json "architectures"[0] written on save
    attention_bias: bool = False  # default of q/k/v projection biases (config.json may override)
    qk_norm: bool = False         # RMSNorm on each query / key head before the rotary embedding (Qwen3)
    extra_config: tuple = ()      # (key, value) pairs written to config.json for transformers


FAMILIES: Dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type]


register_family(Family("qwen2", "Qwen2ForCausalLM", attention_bias=True))
register_family(Family("qwen3", "Qwen3ForCausalLM", qk_norm=True))
register_family(Family("llama", "LlamaForCausalLM", extra_config=(("mlp_bias", False),)))
register_family(Family("mistral", "MistralForCausalLM", extra_config=(("sliding_window", None),)))

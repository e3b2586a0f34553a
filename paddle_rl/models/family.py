"""Model families: what distinguishes one dense decoder architecture from another, in one table.

The decoder (decoder.py) is built from a family's switches; the Hugging Face tensor names come from
the layers themselves (layers.py, moe.py). Adding a family whose layers already exist (Mistral, say; or a
Mixture-of-Experts one like Qwen3-MoE) is one `register_family` call here (and a parity test): nothing else
lists families or their names.
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
    bias_key: str = "attention_bias"  # the config.json key of the q/k/v biases (Qwen2-MoE: qkv_bias)
    mlp: str = "dense"            # "dense": a SwiGLU MLP per layer; "moe": sparse Mixture-of-Experts blocks (moe.py)
    shared_expert: bool = False   # moe: plus a dense expert every token takes, scaled by a sigmoid gate (Qwen2-MoE)
    settings: tuple = ()          # (config.json key, transformers' default) of the family's own keys, which
    #                               ModelConfig keeps in `extra`; read with `setting`
    aliases: tuple = ()           # (key, other spelling) of such keys (transformers 5 writes num_local_experts)

    def setting(self, config, key: str):
        """A family-specific config.json value (config.extra under `key` or an alias), else transformers' default."""
        for name in (key, *(alias for k, alias in self.aliases if k == key)):
            if name in config.extra:
                return config.extra[name]
        return dict(self.settings)[key]

    def qkv_bias(self, config) -> bool:
        """Whether the q/k/v projections have biases (config.json's `bias_key`, else the family default)."""
        return bool(config.extra.get(self.bias_key, config.attention_bias))


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

_MOE = (("norm_topk_prob", False), ("decoder_sparse_step", 1), ("mlp_only_layers", ()),  # transformers' defaults
        ("router_aux_loss_coef", 0.001), ("output_router_logits", False))
register_family(Family("qwen2_moe", "Qwen2MoeForCausalLM", attention_bias=True, bias_key="qkv_bias", mlp="moe",
                       shared_expert=True,
                       settings=_MOE + (("num_experts", 60), ("num_experts_per_tok", 4),
                                        ("moe_intermediate_size", 1408), ("shared_expert_intermediate_size", 5632))))
register_family(Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, mlp="moe",
                       settings=_MOE + (("num_experts", 128), ("num_experts_per_tok", 8),
                                        ("moe_intermediate_size", 768)),
                       aliases=(("num_experts", "num_local_experts"),)))

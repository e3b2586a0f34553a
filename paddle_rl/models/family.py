"""Model families: what distinguishes one dense decoder architecture from another, in one table.

The decoder (decoder.py) is built from a family's switches; the Hugging Face tensor names come from
the layers themselves (layers.py, moe.py). Adding a family whose layers already exist (Mistral, say; or a
Mixture-of-Experts one like Qwen3-MoE) is one `register_family` call here (and a parity test): nothing else
lists families or their names.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json value -> the MLP's gate activation


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
    activation_key: str = "hidden_act"  # the config.json key naming the MLP's gate activation (ACTIVATIONS)
    norm_offset: bool = False     # RMSNorm weights stored as an offset from 1: x_normed * (1 + w) (Gemma)
    sandwich_norms: bool = False  # a norm on the attention output and on the MLP output too, and one before the MLP
    #                               (post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)
    embed_scale: bool = False     # token embeddings times sqrt(hidden_size), in the embedding dtype
    sliding: bool = False         # sliding-window layers among global ones (settings sliding_window, layer_types or
    #                               sliding_window_pattern, rope_local_base_freq for their rotary base)
    query_scale_key: str = ""     # a config.json key s: attention scores scaled by s ** -0.5, not head_dim ** -0.5
    logit_softcap_key: str = ""   # a config.json key c: final logits c * tanh(logits / c) where c is set

    def setting(self, config, key: str):
        """A family-specific config.json value (config.extra under `key` or an alias), else transformers' default."""
        for name in (key, *(alias for k, alias in self.aliases if k == key)):
            if name in config.extra:
                return config.extra[name]
        return dict(self.settings)[key]

    def activation(self, config) -> str:
        """The MLP's gate activation ("silu" or "gelu_tanh"); a ValueError names the key of any other."""
        value = self.setting(config, self.activation_key) if self.activation_key != "hidden_act" else config.hidden_act
        if value not in ACTIVATIONS:
            raise ValueError(f"{self.activation_key} {value!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return ACTIVATIONS[value]

    def sliding_windows(self, config) -> List[Optional[int]]:
        """Each layer's sliding window (None: global attention). `layer_types` where config.json lists them, else
        every `sliding_window_pattern`-th layer global (transformers' rule)."""
        layers = config.num_hidden_layers
        if not self.sliding:
            return [None] * layers
        window = self.setting(config, "sliding_window")
        types = self.setting(config, "layer_types")
        if types is None:
            pattern = int(self.setting(config, "sliding_window_pattern"))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must list 'sliding_attention' / 'full_attention' for each of the "
                             f"{layers} layers, got {types}")
        if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        return [window if t == "sliding_attention" else None for t in types]

    def query_scale(self, config) -> float:
        """The factor of the attention scores q.k."""
        scalar = self.setting(config, self.query_scale_key) if self.query_scale_key else config.head_dim
        return float(scalar) ** -0.5

    def logit_softcap(self, config) -> Optional[float]:
        cap = self.setting(config, self.logit_softcap_key) if self.logit_softcap_key else None
        return None if cap is None else float(cap)

    def check(self, config) -> None:
        """The family's settings the decoder does not implement are errors naming the key."""
        self.activation(config)
        self.sliding_windows(config)
        for key, off in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False)):
            if key in dict(self.settings) and self.setting(config, key) not in (off, None):
                raise ValueError(f"{key} {self.setting(config, key)!r} is not supported (only {off!r})")

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
register_family(Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, activation_key="hidden_activation",
                       norm_offset=True, sandwich_norms=True, embed_scale=True, sliding=True,
                       query_scale_key="query_pre_attn_scalar", logit_softcap_key="final_logit_softcapping",
                       settings=(("hidden_activation", "gelu_pytorch_tanh"), ("sliding_window", 4096),  # transformers'
                                 ("layer_types", None), ("sliding_window_pattern", 6),                  # defaults
                                 ("rope_local_base_freq", 10000.0), ("query_pre_attn_scalar", 256),
                                 ("final_logit_softcapping", None), ("attn_logit_softcapping", None),
                                 ("use_bidirectional_attention", False)),
                       aliases=(("sliding_window_pattern", "_sliding_window_pattern"),),
                       extra_config=(("tie_word_embeddings", True),)))

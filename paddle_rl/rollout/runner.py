"""The decode step of the rollout: one new token per row through the decoder with few, fused ops.

It reads the model's own layers (their projections, norms and heads, so tensor-parallel layers keep working)
and replaces the generic attention path of a one-token step with: RMSNorm -> qkv projection ->
`rotary_qkv_cache` (split, q/k norm, rotary, KV-cache write in place) -> `decode_attention` over the cache
(left padding skipped by a per-row start slot) -> output projection -> RMSNorm -> gate/up -> `swiglu` -> down.
With the fused kernels off, the same steps run as their pure-Paddle references. The prefill goes through
the model's own forward (`CausalLM.hidden_states` with a preallocated LayerCache).
"""
from .. import ops


class DecodeRunner:
    def __init__(self, model):
        self.model = model
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            head_dim = attn.head_dim
            self.layers.append(dict(
                attn=attn, mlp=mlp,
                input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
                heads=attn.split_sizes[0] // head_dim, kv_heads=attn.split_sizes[1] // head_dim,
                scale=attn.scale,
                q_norm=attn.q_norm.weight if attn.qk_norm else None,
                k_norm=attn.k_norm.weight if attn.qk_norm else None,
                qk_eps=attn.q_norm.eps if attn.qk_norm else 1e-6))

    @staticmethod
    def supports(model) -> bool:
        """The model has the decoder layout this runner reads (else the engine uses the model's forward)."""
        try:
            layer = model.layers[0]
            attn = layer.self_attn
            return (len(attn.split_sizes) == 3 and hasattr(attn, "qkv_proj") and hasattr(attn, "o_proj")
                    and hasattr(layer.mlp, "gate_up_proj") and hasattr(layer.mlp, "down_proj")
                    and hasattr(model, "rotary") and hasattr(model.rotary, "inv_freq"))
        except (AttributeError, IndexError, TypeError):
            return False

    def step(self, tokens, positions, cache, start):
        """Logits [B, V] of the next token after `tokens` [B] at `positions` [B, 1]; appends to `cache`.

        `start` [B] int64: the first cache slot each row attends to (its prompt's first real token)."""
        model = self.model
        batch = tokens.shape[0]
        x = model.embed_tokens(tokens.unsqueeze(-1))
        inv_freq = model.rotary.inv_freq
        for spec, layer_cache in zip(self.layers, cache):
            attn, mlp = spec["attn"], spec["mlp"]
            norm = spec["input_norm"]
            h = ops.rms_norm(x, norm.weight, norm.eps)
            slot = layer_cache.length
            q = ops.rotary_qkv_cache(attn.qkv_proj(h), positions, inv_freq, layer_cache.k, layer_cache.v,
                                     spec["heads"], spec["kv_heads"], slot, spec["q_norm"], spec["k_norm"],
                                     spec["qk_eps"])
            layer_cache.length = slot + 1
            out = ops.decode_attention(q, layer_cache.k, layer_cache.v, start, slot + 1, spec["scale"])
            x = x + attn.o_proj(out)
            norm = spec["post_norm"]
            h = ops.rms_norm(x, norm.weight, norm.eps)
            x = x + mlp.down_proj(ops.swiglu(mlp.gate_up_proj(h)))
        x = ops.rms_norm(x, model.norm.weight, model.norm.eps)
        return model.logits(x).reshape([batch, -1])

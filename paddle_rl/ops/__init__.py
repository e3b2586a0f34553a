"""Fused kernels (csrc/, built with paddle.utils.cpp_extension on first use) with pure-Paddle fallbacks.

Each op has `<op>_reference` (pure Paddle: the definition), `<op>_fused` (the kernel) and `<op>` (the kernel
when it is in use, else the reference). `configure("auto" | "on" | "off")` selects (config key
`use_custom_ops`); see build.py for the cache and the modes.

- rms_norm: RMSNorm with its backward
- residual_add: the residual stream's sum, its backward passing one gradient tensor to both inputs (no copies)
- swiglu: silu(gate) * up of a fused [gate | up] projection, with its backward
- rotary: rotate-half rotary embedding with its backward
- qkv_rotary: the training passes' q/k/v from the fused projection: bias add, split, q/k rotary and the head-major
  layout in one op, with its backward (the bias's gradient summed in it)
- rotary_qkv_cache: the decode step's qkv split + q/k norm + rotary + in-place KV-cache write
- packed_linear: the rollout's x @ W from a copy of W packed in 32-column panels (pack_weight), or from a copy in
  bfloat16 / int8 / int4 (pack_weight_lowp: rollout_dtype, rollout_quant_type)
- bf16_linear: x W with bfloat16-rounded operands and float32 sums in the forward and both gradients (`bf16: true`
  training on a CPU), its products by bf16_matmul: AMX-BF16, AVX512-BF16 or AVX2 kernels where the CPU has them,
  else emulated (rounded copies, float32 matmul)
- product_gradients: a stand-in for x W (float32 or bf16_linear's) whose forward computes nothing and whose backward
  is the product's: a recomputed block's last product, whose output the backward does not need (no reference /
  fused pair: it runs no kernel of its own)
- half_linear: x W as a float16 (IEEE half) or bfloat16 matmul with float32 sums, forward and both gradients, the
  outputs rounded too under AMP O2 (`fp16: true`, `fp16_opt_level`; half.py); float16 always emulated
- kv_place: the rollout's KV-cache relayout (rows' windows copied into another buffer, in place)
- decode_attention: one decode step of grouped-query attention over the cache
- decode_layer: a whole dense decoder layer of a decode step in one call (the ten ops above it runs, same bits)
- masked_softmax: the training / prefill attention's softmax(scale * scores + bias), with its backward
- packed_attention_fused / _reference: attention of a packed row (several sequences, each token's keys as two
  ranges), with its backward; the fused kernel stores no probabilities
- blocked_attention / _reference: the padded layout's attention with its backward, query rows in blocks, the
  probabilities never stored (use_flash_attention)
- sample: penalty, stop-token ban, temperature, top-k, top-p and the inverse-CDF draw; log-prob of the draw
- lm_head_logprobs: per-token log-prob and entropy from hidden states and the LM-head weight, chunked
- row_argmax: each row's first largest index (Paddle's argmax over the last axis of [N, V]), the greedy choice
- step_update: the rollout's per-step stop flags, lengths, seen tokens and min-length ban

switches.py holds the fused-kernel switches of the model's passes (use_flash_attention, use_fused_rms_norm,
use_fused_rope, use_fused_head_and_loss_fn, use_fused_linear): `select_kernels(attention=, rms_norm=, rope=, head=,
linear=)`; linear_bias.py the linear layers' x W + b (Paddle's linear op, or the product and a separate bias add).
"""
from .linear_bias import affine, affine_fused, affine_reference
from .activation import swiglu, swiglu_fused, swiglu_reference
from .attention import (blocked_attention, blocked_attention_reference, decode_attention, decode_attention_fused,
                        decode_attention_reads_windows, decode_attention_reference, masked_softmax,
                        masked_softmax_fused, masked_softmax_reference, packed_attention_fused,
                        packed_attention_reference, packed_attention_usable, packed_key_mask)
from .build import CustomOpsError, available, configure, mode, status
from .decode_layer import (DecodeLayerWeights, decode_layer, decode_layer_fused, decode_layer_reference,
                           enabled as decode_layer_enabled)
from .half import HALF_DTYPES, HalfProducts, half_linear, half_linear_reference, round_grad, round_half, round_value
from .kv_cache import kv_place, kv_place_fused, kv_place_reference
from .linear import (ROLLOUT_DTYPES, BF16_KERNELS, bf16_kernel, bf16_kernels, bf16_linear, bf16_linear_reference,
                     bf16_matmul, bf16_matmul_accumulate, bf16_matmul_fused, bf16_matmul_packed, bf16_matmul_reference,
                     bf16_pack_b,
                     Bf16PackedB, emulation_forced, round_bf16, ROLLOUT_QUANT_TYPES, LowpPacked, pack_weight,
                     pack_weight_fused,
                     pack_weight_lowp, pack_weight_lowp_fused, pack_weight_lowp_reference, pack_weight_reference,
                     packed_linear, packed_linear_fused, packed_linear_lowp, packed_linear_lowp_fused,
                     packed_linear_lowp_reference, packed_linear_reference, packing_helps, product_gradients,
                     rollout_weight_format,
                     to_bf16, to_bf16_fused, to_bf16_reference)
from .logprob import lm_head_logprobs, lm_head_logprobs_reference, logprobs_from_logits, row_argmax
from .norm import rms_norm, rms_norm_fused, rms_norm_reference
from .residual import residual_add, residual_add_reference
from .rollout_state import StepState, step_update, step_update_fused, step_update_reference
from .rope import (qkv_rotary, qkv_rotary_fused, qkv_rotary_reference, qkv_rotary_runs, rotary, rotary_fused, rotary_qkv_cache,
                   rotary_qkv_cache_fused, rotary_qkv_cache_reference, rotary_reference, rotary_tables)
from .sampling import sample, sample_fused, sample_reference
from .switches import SwitchError, current as kernel_switches, select as select_kernels, selected as kernels_selected, \
    switch as kernel_switch

__all__ = ["configure", "available", "mode", "status", "CustomOpsError",
           "HALF_DTYPES", "HalfProducts", "half_linear", "half_linear_reference", "round_grad", "round_half",
           "round_value",
           "rms_norm", "rms_norm_fused", "rms_norm_reference", "residual_add", "residual_add_reference",
           "swiglu", "swiglu_fused", "swiglu_reference",
           "rotary", "rotary_fused", "rotary_reference", "rotary_tables",
           "rotary_qkv_cache", "rotary_qkv_cache_fused", "rotary_qkv_cache_reference",
           "kv_place", "kv_place_fused", "kv_place_reference",
           "pack_weight", "pack_weight_fused", "pack_weight_reference",
           "packed_linear", "packed_linear_fused", "packed_linear_reference", "packing_helps", "product_gradients",
           "bf16_linear", "bf16_linear_reference", "round_bf16", "BF16_KERNELS", "bf16_kernel", "bf16_kernels",
           "bf16_matmul", "bf16_matmul_accumulate", "bf16_matmul_fused", "bf16_matmul_packed", "bf16_pack_b",
           "Bf16PackedB",
           "bf16_matmul_reference", "emulation_forced", "to_bf16", "to_bf16_fused", "to_bf16_reference",
           "ROLLOUT_DTYPES", "ROLLOUT_QUANT_TYPES", "LowpPacked", "rollout_weight_format",
           "pack_weight_lowp", "pack_weight_lowp_fused", "pack_weight_lowp_reference",
           "packed_linear_lowp", "packed_linear_lowp_fused", "packed_linear_lowp_reference",
           "decode_attention", "decode_attention_fused", "decode_attention_reads_windows", "decode_attention_reference",
           "DecodeLayerWeights", "decode_layer", "decode_layer_fused", "decode_layer_reference", "decode_layer_enabled",
           "masked_softmax", "masked_softmax_fused", "masked_softmax_reference",
           "packed_attention_fused", "packed_attention_reference", "packed_attention_usable",
           "packed_key_mask", "blocked_attention", "blocked_attention_reference",
           "affine", "affine_fused", "affine_reference",
           "SwitchError", "kernel_switches", "select_kernels", "kernels_selected", "kernel_switch",
           "sample", "sample_fused", "sample_reference",
           "lm_head_logprobs", "lm_head_logprobs_reference", "logprobs_from_logits", "row_argmax",
           "StepState", "step_update", "step_update_fused", "step_update_reference"]

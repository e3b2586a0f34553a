from dataclasses import dataclass
from typing import Optional

from .fields import ON_OFF, arg

# what recompute_granularity may name (models/decoder.py: CausalLM.recompute)
RECOMPUTE_GRANULARITIES = ("full", "full_attn", "core_attn", "core_attn_mlp")
# what rollout_quant_type may name (ops/linear.py: ROLLOUT_QUANT_TYPES)
ROLLOUT_QUANT_TYPES = ("", "weight_only_int8", "weight_only_int4")


@dataclass
class ModelArgs:
    actor_model_name_or_path: str = arg("", "Folder of the actor checkpoint (Hugging Face layout).")
    reference_model_name_or_path: Optional[str] = arg(None, "Reference checkpoint; defaults to the actor's.")
    tokenizer_name_or_path: Optional[str] = arg(None, "Tokenizer folder; defaults to the actor's.")
    reward_model_name_or_path: str = arg("", "Neural reward model: a *ForSequenceClassification folder, scored as the "
                                             "function `reward_model` of reward_funcs (docs/rewards.md).")
    use_fp32_compute: bool = arg(False, "With bf16: the heads' products stay float32, the LM head's and the value / "
                                        "reward model's score head (otherwise they take bfloat16 operands like the "
                                        "other linear layers); the log-softmax, log-probs, advantages and losses are "
                                        "float32 either way.")
    bf16: bool = arg(False, "bfloat16 for training and inference (PaddleNLP's bf16): every matmul of the actor, "
                            "reference, critic and reward model (linear layers, LoRA A and B, MoE router and "
                            "experts; forward and both gradients) takes bfloat16-rounded operands with float32 sums, "
                            "the parameters stay float32 master weights (optimizer moments float32); norms, softmax, "
                            "log-probs and losses float32, and the attention core (q k^T, p v) float32 on a CPU "
                            "(one warning says so). On a CPU the products run an AMX-BF16, AVX512-BF16 or "
                            "AVX2 kernel where the CPU has one, else they are emulated (the numbers of bf16 "
                            "training, not its speed; one warning); on a GPU, Paddle's AMP O2 with master weights. The rollout follows "
                            "(rollout_dtype auto), checkpoints are written in save_dtype (docs/performance.md, bf16).")
    # fp16, fp16_opt_level, amp_master_grad, amp_custom_*_list and the loss scaling: precision_args.py
    # the fused-kernel switches of the model's passes (ops/switches.py): true the fused path (an error naming the key
    # where it cannot run), false the composed Paddle ops, null (unset) what the build picks (docs/kernels.md)
    use_flash_attention: Optional[bool] = arg(
        None, "Attention of the training, log-prob and prefill passes: true the blocked attention (query rows in "
              "blocks, softmax(QK^T) never stored, the backward recomputing each block's probabilities from the saved "
              "row maxima and sums; packed rows: the CPU kernel, which keeps none either), false the probabilities "
              "materialized, unset: the kernel for packed rows (use_remove_padding) and materialized for padded ones. "
              "With it, recompute_granularity core_attn does not run the core twice. PaddleNLP's default: false.")
    use_fused_rms_norm: Optional[bool] = arg(
        None, "RMSNorm: true the csrc kernel with its own backward (needs use_custom_ops), false the composed Paddle "
              "ops, unset: the kernel where it runs. PaddleNLP's default: false.")
    use_fused_rope: Optional[bool] = arg(
        None, "Rotary embedding of q and k: true the csrc kernel with its own backward (needs use_custom_ops), false "
              "the composed Paddle ops, unset: the kernel where it runs. The rollout's decode step always fuses it "
              "with the KV-cache write. PaddleNLP's default: false.")
    use_fused_head_and_loss_fn: Optional[bool] = arg(
        None, "LM head and log-probs: true or unset, in chunks of rows (never the whole [tokens, vocab] logits; the "
              "backward recomputes a chunk's logits beyond 256 MB), false from the whole logits. Tensor parallelism "
              "and soft-capped logits use the whole (vocabulary-slice) logits: true is refused there. PaddleNLP's "
              "default: false.")
    use_fused_linear: Optional[bool] = arg(
        None, "The linear layers' x W + b in one process: true or unset, Paddle's linear op, which takes the bias "
              "inside the one op (its GEMM epilogue on a GPU, added into the product's output on a CPU), false the "
              "product and a separate bias add over the output. Only layers with a bias differ (Qwen2's q/k/v). "
              "PaddleNLP's default: false.")
    fused_linear: Optional[bool] = arg(None, "PaddleNLP's other spelling of use_fused_linear (both set: they must "
                                             "agree).")
    recompute: bool = arg(False, "Recompute in the backward pass to save memory (what: recompute_granularity).")
    use_custom_ops: str = arg("auto", "Fused C++/CUDA kernels of csrc/ (built on first use): auto (use them if they "
                                      "build, else the pure-Paddle fallbacks with one log line) | on (fail if they "
                                      "cannot be built) | off.", choices=("auto", "on", "off"), spellings=ON_OFF)
    share_prompt_prefix: bool = arg(True, "Run each distinct prompt once per micro-batch in the log-prob and update "
                                          "passes; its rollout_n responses attend to its keys/values (same values "
                                          "up to float rounding; saves the repeated prompt compute).")
    lora: bool = arg(False, "Train LoRA adapters on the frozen actor instead of its weights (docs/lora.md); the "
                            "reference policy is the base with the adapters off. Also on when lora_rank > 0.")
    lora_rank: int = arg(0, "LoRA rank r (0 with lora: true means 8).")
    lora_alpha: float = arg(16.0, "LoRA alpha: the adapters' output is scaled by lora_alpha / lora_rank.")
    lora_dropout: float = arg(0.0, "Dropout on the adapters' input in the update pass.")
    lora_target_modules: list = arg(["all-linear"], "Modules that get adapters: all-linear (every projection of the "
                                                    "decoder, not the head), names such as [q_proj, v_proj], or one "
                                                    "regular expression over the full module names (PEFT's rules).",
                                    aliases=("target_modules",))
    rslora: bool = arg(False, "Rank-stabilized LoRA: scale by lora_alpha / sqrt(lora_rank).", aliases=("use_rslora",))
    lora_path: str = arg("", "A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to continue "
                             "training: its rank, alpha and modules are used.", aliases=("lora_adapter_path",))
    merge_lora: bool = arg(False, "LoRA checkpoints also hold the merged weights as an ordinary Hugging Face model "
                                  "(config.json, model.safetensors) beside the adapter.")
    recompute_use_reentrant: bool = arg(False, "With recompute: Paddle's reentrant recompute (true: a PyLayer that "
                                               "runs each recomputed block without autograd in the forward and again "
                                               "with it in the backward) or its non-reentrant one (false: saved-tensor "
                                               "hooks); the same gradients. PaddleNLP's default: true.")
    recompute_granularity: str = arg("full", "With recompute: full (each decoder layer: only the layer inputs are "
                                             "kept) | full_attn (each self-attention block) | core_attn (the "
                                             "attention core softmax(QK^T)V: its probabilities, which grow with the "
                                             "sequence length, are not kept; the packed CPU kernel keeps none "
                                             "anyway and is not run twice) | core_attn_mlp (this suite's: the "
                                             "attention core and each dense MLP block with its norm, the down "
                                             "projection's forward not run again; sparse MoE blocks are kept). "
                                             "With bf16 on a CPU, full_attn and core_attn_mlp "
                                             "recompute each attention block from its input's bfloat16 rounding "
                                             "(what its q/k/v product reads), the one tensor it keeps.")
    no_recompute_layers: list = arg([], "PaddleNLP's: decoder layers (indices from 0 over the whole model, as in "
                                        "config.json) that keep their activations under recompute; the other layers "
                                        "recompute what recompute_granularity says. Each listed layer saves its "
                                        "recomputed forward and holds its activations through the backward.")
    offload_level: str = arg("", "PaddleNLP's offload of named states to host memory: on a CPU build they are there "
                                  "already (one warning line says so); refused on a GPU build, where offload is not "
                                  "implemented.")
    release_grads: bool = arg(True, "After each optimizer step free the gradients (true; their memory returns until "
                                    "the next backward) or keep them allocated and zeroed (false). PaddleNLP's "
                                    "default: false.")
    offload_optim: bool = arg(False, "PaddleNLP's offload of the optimizer states to host memory after each step: "
                                     "on a CPU build they are there already (one warning line says so); refused "
                                     "on a GPU build, where offload is not implemented.")
    quant_type: str = arg("", "PaddleNLP's quantized training weights (weight_only_int8, a8w8, ...): refused when "
                              "set; the trained weights are float32 here (master weights under bf16 / fp16), and "
                              "the rollout's weights are quantized by rollout_quant_type.")
    rollout_quant_type: str = arg("", "Quantize the rollout's packed weights: '' (off) | weight_only_int8 (per "
                                      "output channel) | weight_only_int4 (groups of 128 along the input, per "
                                      "output channel); dequantized in registers by the packed kernel, with "
                                      "rollout_dtype's activations. The reference and training passes keep the "
                                      "float32 weights.",
                                  choices=ROLLOUT_QUANT_TYPES, spellings={"none": "", "null": ""})

    def _validate_model(self, errors):
        if not self.actor_model_name_or_path:
            errors.append("actor_model_name_or_path: required (a folder with config.json and model.safetensors)")
        if self.lora_rank < 0:
            errors.append(f"lora_rank: must be >= 0, got {self.lora_rank}")
        if self.lora_alpha <= 0:
            errors.append(f"lora_alpha: must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            errors.append(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.uses_lora and not self.lora_target_modules:
            errors.append("lora_target_modules: empty (all-linear, or module names such as [q_proj, v_proj])")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            errors.append(f"recompute_granularity: must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, got "
                          f"{self.recompute_granularity!r}")
        elif self.recompute_granularity != "full" and not self.recompute:
            errors.append(f"recompute_granularity: {self.recompute_granularity} is set without recompute: true, so "
                          "nothing is recomputed")
        bad = [i for i in self.no_recompute_layers if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            errors.append(f"no_recompute_layers: layer indices are integers >= 0, got {bad}")
        elif len(set(self.no_recompute_layers)) != len(self.no_recompute_layers):
            errors.append(f"no_recompute_layers: a layer is listed twice in {self.no_recompute_layers}")
        elif self.no_recompute_layers and not self.recompute:
            errors.append(f"no_recompute_layers: {self.no_recompute_layers} is set without recompute: true, so every "
                          "layer keeps its activations anyway")
        if self.merge_lora and not self.uses_lora:
            errors.append("merge_lora: needs LoRA (lora: true, lora_rank > 0 or lora_path)")
        if self.quant_type:
            errors.append(f"quant_type: {self.quant_type!r}: quantized training weights are not implemented (the "
                          "trained weights are float32, master weights under bf16 / fp16); the rollout's weights are "
                          "quantized by rollout_quant_type (weight_only_int8 | weight_only_int4)")
        for key in ("use_fused_rms_norm", "use_fused_rope"):
            if getattr(self, key) and self.use_custom_ops == "off":
                errors.append(f"{key}: true runs the fused kernel of csrc/, and use_custom_ops is off; set one of them "
                              "differently")
        if self.use_fused_linear is not None and self.fused_linear is not None \
                and self.use_fused_linear != self.fused_linear:
            errors.append(f"fused_linear: {self.fused_linear} contradicts use_fused_linear: {self.use_fused_linear} "
                          "(the same switch); set one")

    @property
    def recompute_what(self):
        """What the update pass recomputes: None, or a recompute_granularity."""
        return self.recompute_granularity if self.recompute else None

    @property
    def kernel_switches(self) -> dict:
        """The fused-kernel switches by their ops/switches.py names (None: unset)."""
        return {"attention": self.use_flash_attention, "rms_norm": self.use_fused_rms_norm,
                "rope": self.use_fused_rope, "head": self.use_fused_head_and_loss_fn,
                "linear": self.use_fused_linear if self.use_fused_linear is not None else self.fused_linear}

    @property
    def uses_lora(self) -> bool:
        return bool(self.lora or self.lora_rank > 0 or self.lora_path)

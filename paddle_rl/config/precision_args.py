from dataclasses import dataclass

from .fields import arg

# Paddle's names of the ops the CPU emulation of bf16 / fp16 runs in half precision: the linear layers' products
# (trainer/precision.py)
MATMUL_OPS = ("matmul_v2", "matmul", "linear", "fused_gemm_epilogue")
AMP_LEVELS = ("O1", "O2")
SCALING_KEYS = ("scale_loss", "incr_ratio", "decr_ratio", "incr_every_n_steps", "decr_every_n_nan_or_inf",
                "use_dynamic_loss_scaling")


def amp_ops(value) -> tuple:
    """The op names of an amp_custom_*_list value (comma or space separated; a YAML list arrives space separated)."""
    return tuple(w for w in str(value or "").replace(",", " ").split())


@dataclass
class PrecisionArgs:
    fp16: bool = arg(False, "float16 mixed precision (PaddleNLP's fp16): the matmuls of the actor and reference "
                            "(linear layers, LoRA A and B, MoE router and experts) run as float16 matmuls with "
                            "float32 sums (operands rounded to IEEE half: overflow to inf above 65504, subnormals "
                            "kept), the parameters float32 master weights, the loss multiplied by a dynamic loss "
                            "scale (scale_loss ...) and an update whose gradients overflow skipped. On a CPU the "
                            "products are emulated (float32 matmuls of the rounded operands: fp16's numbers, not its "
                            "speed), the LM head, the attention core, norms and log-probs stay float32 and the "
                            "rollout decodes in float32 (one warning says so); on a GPU, Paddle's AMP "
                            "(docs/performance.md, fp16). Not with bf16, nor with a critic (rl_algorithm ppo).")
    fp16_opt_level: str = arg("O1", "AMP level of fp16 and bf16 (PaddleNLP's): O1, the matmuls take half-rounded "
                                    "operands and give float32 outputs; O2, every op's output is half as AMP O2 "
                                    "passes them: each product's output and gradients are rounded too, and each "
                                    "micro-batch's gradient of every trained parameter (the summed gradient also, "
                                    "unless amp_master_grad). On a GPU, Paddle's auto_cast level (O2 with "
                                    "paddle.amp.decorate and float32 master weights).",
                              choices=AMP_LEVELS, spellings={"o1": "O1", "o2": "O2"})
    amp_master_grad: bool = arg(False, "With fp16_opt_level O2: the parameters' summed gradients are kept in "
                                       "float32 (clipping, weight decay and the update read float32), not in half; "
                                       "under O1 they are float32 anyway (refused there).")
    amp_custom_black_list: str = arg("", "Ops kept in float32 under bf16 / fp16 (Paddle's op names, comma or space "
                                         "separated, or a YAML list): naming a matmul (matmul_v2, matmul, linear) "
                                         "keeps the linear layers' products float32; other ops are float32 in the "
                                         "CPU emulation already. On a GPU, auto_cast's custom_black_list.")
    amp_custom_white_list: str = arg("", "Ops run in half precision under bf16 / fp16 (Paddle's op names): on a CPU "
                                         "only the matmuls (matmul_v2, matmul, linear), which run in half anyway; "
                                         "any other op is refused there. On a GPU, auto_cast's custom_white_list.")
    scale_loss: float = arg(2.0 ** 15, "fp16: the initial loss scale (PaddleNLP's scale_loss, Paddle GradScaler's "
                                       "init_loss_scaling). The loss is multiplied by it before the backward and the "
                                       "gradients divided by it before clipping, so that gradients too small for "
                                       "float16 survive its rounding.")
    use_dynamic_loss_scaling: bool = arg(True, "fp16: back the loss scale off on overflow and grow it after a run of "
                                               "good updates (Paddle GradScaler); false keeps scale_loss fixed, and "
                                               "an overflowing update then counts as non-finite "
                                               "(max_nonfinite_skips).")
    incr_ratio: float = arg(2.0, "fp16: the loss scale is multiplied by this after incr_every_n_steps applied "
                                 "updates in a row.")
    decr_ratio: float = arg(0.5, "fp16: the loss scale is multiplied by this after decr_every_n_nan_or_inf "
                                 "overflowing updates (never below 1).")
    incr_every_n_steps: int = arg(1000, "fp16: applied updates in a row before the loss scale grows.")
    decr_every_n_nan_or_inf: int = arg(2, "fp16: overflowing (skipped) updates before the loss scale backs off.")

    def _validate_precision(self, errors):
        """The precision keys (fp16 with bf16, and with rollout_dtype: RLConfig._check_across). Reads bf16 (model)
        to know whether a half precision is on."""
        half = self.fp16 or self.bf16
        if self.amp_master_grad and not (half and self.fp16_opt_level == "O2"):
            errors.append("amp_master_grad: float32 master gradients are an O2 setting (fp16 or bf16 with "
                          "fp16_opt_level O2); " + ("under O1 the gradients are float32 already" if half else
                                                    "without fp16 or bf16 everything is float32"))
        for key in ("amp_custom_black_list", "amp_custom_white_list"):
            if amp_ops(getattr(self, key)) and not half:
                errors.append(f"{key}: names ops for bf16 / fp16, and neither is on")
        both = set(amp_ops(self.amp_custom_black_list)) & set(amp_ops(self.amp_custom_white_list))
        if both:
            errors.append(f"amp_custom_black_list: {', '.join(sorted(both))} also in amp_custom_white_list")
        if not self.fp16:
            for key in SCALING_KEYS:
                if getattr(self, key) != type(self).__dataclass_fields__[key].default:
                    errors.append(f"{key}: loss scaling is fp16's (fp16: true); bf16 and float32 keep float32's "
                                  "range and scale nothing")
            return
        if not self.scale_loss >= 1.0:
            errors.append(f"scale_loss: must be >= 1, got {self.scale_loss}")
        if not self.incr_ratio > 1.0:
            errors.append(f"incr_ratio: must be > 1, got {self.incr_ratio}")
        if not 0.0 < self.decr_ratio < 1.0:
            errors.append(f"decr_ratio: must be in (0, 1), got {self.decr_ratio}")
        for key in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
            if getattr(self, key) < 1:
                errors.append(f"{key}: must be >= 1, got {getattr(self, key)}")

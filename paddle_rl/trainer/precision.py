"""The compute precision of a run (`bf16`, `use_fp32_compute`): one strategy object, chosen once per run.

- Float32: everything in float32 (bf16: false).
- EmulatedBf16 (bf16: true on a CPU build): every matmul of the model but the attention core (the column and row
  linear layers, LoRA's A and B, the MoE router, shared-expert gate and experts; models/layers.py Bf16Products)
  runs its three products (y = x W, dx = dy W^T, dW = x^T dy) from bfloat16-rounded operands with float32 sums
  (ops.bf16_linear); the parameters stay float32 and are the master weights the optimizer updates (its moments
  float32); norms, softmax, log-probs, advantages and losses stay float32. The head (the LM head, or a critic's
  value head) too unless use_fp32_compute. The attention core's q k^T and p v stay float32: one warning at the
  start says so (FP32_UNDER_BF16). Paddle's CPU build has no bfloat16 matmul: the products
  run the project's AMX-BF16 / AVX512-BF16 kernel where the CPU has one (ops.bf16_matmul), else they are emulated
  (rounded copies, float32 matmuls: the numbers of bf16 training, not its speed; one warning says so). A frozen
  model (the reference) keeps its linear layers' weights in bfloat16 (the same products, half their bytes).
- AmpBf16 (bf16: true on a CUDA build with a GPU in use): Paddle's AMP O2, `paddle.amp.decorate(models,
  optimizers, level="O2", dtype="bfloat16", master_weight=True)` and `auto_cast` around the forward passes; the LM
  head's log-probs take float32 copies of the hidden states and head weight (bfloat16-rounded operands unless
  use_fp32_compute, as on the CPU). Not run by this project's tests (no GPU there).

Every model of a run (actor, reference, critic) goes through `prepare_model`; the trained ones with their optimizer
through `prepare_training`; the trainer wraps its forward passes in `autocast()`.
"""
import contextlib
import logging

import paddle

from .. import ops

logger = logging.getLogger("paddle_rl")


class Float32:
    name = "float32"

    def prepare_model(self, model) -> None:
        """Set the model's compute precision (before its optimizer is built)."""

    def prepare_training(self, model, optimizer):
        """(model, optimizer) as the run trains them."""
        return model, optimizer

    def autocast(self):
        """The context the forward passes run in."""
        return contextlib.nullcontext()


class EmulatedBf16(Float32):
    name = "bfloat16 on the CPU (bf16-rounded operands, float32 sums)"

    def __init__(self, fp32_head: bool):
        self.fp32_head = fp32_head

    def prepare_model(self, model) -> None:
        model.set_bf16(linears=True, head=not self.fp32_head and getattr(model, "is_last", True))
        if all(p.stop_gradient for p in model.parameters()):  # a frozen model (the reference): bf16 linear weights
            model.store_linears_bf16()


class AmpBf16(Float32):
    name = "bfloat16 (Paddle AMP O2, float32 master weights)"

    def __init__(self, fp32_head: bool):
        self.fp32_head = fp32_head

    def prepare_model(self, model) -> None:
        model.head_bf16 = not self.fp32_head and _has_head(model)  # head_logprobs upcasts, then rounds or not
        if self.fp32_head and model.config.sequence_classifier and getattr(model, "is_last", True):
            logger.warning("use_fp32_compute: under AMP the value head (score) of this sequence classifier runs in "
                           "bfloat16 like the rest of the model; only the LM head's log-probs are float32")
        if getattr(model, "_amp_decorated", False):
            return
        if all(p.stop_gradient for p in model.parameters()):  # a frozen model (the reference): bf16 weights
            paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
            model._amp_decorated = True

    def prepare_training(self, model, optimizer):
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype="bfloat16",
                                               master_weight=True)
        model._amp_decorated = True
        return model, optimizer

    def autocast(self):
        return paddle.amp.auto_cast(level="O2", dtype="bfloat16")


def _has_head(model) -> bool:
    return getattr(model, "is_last", True) and not model.config.sequence_classifier


def _cpu_bf16_kernel() -> str:
    """The bf16 matmul kernel the CPU strategy's products run (amx | avx512_bf16), or "the emulation"."""
    if ops.emulation_forced() or not ops.bf16_kernels():
        return "the emulation (PADDLE_RL_BF16_EMULATE set)" if ops.emulation_forced() else "the emulation"
    return f"the {ops.bf16_kernels()[0]} kernel"


# What bf16: true leaves float32 on a CPU build (the products of trainer/precision.py's EmulatedBf16 are the rest).
FP32_UNDER_BF16 = ("the attention core's products (q k^T and p v, with the softmax between them) run in float32, in "
                   "training and in the rollout's prefill and decode")


def precision_for(config):
    """The strategy of `bf16` / `use_fp32_compute`: AMP on a CUDA build running on a GPU, else the emulation."""
    if not getattr(config, "bf16", False):
        return Float32()
    fp32_head = bool(getattr(config, "use_fp32_compute", False))
    if paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
        strategy = AmpBf16(fp32_head)
    else:
        strategy = EmulatedBf16(fp32_head)
    logger.info("compute precision: %s; LM head / value head %s%s", strategy.name,
                "float32" if fp32_head else "bfloat16",
                "" if isinstance(strategy, AmpBf16) else f"; products by {_cpu_bf16_kernel()}")
    if isinstance(strategy, EmulatedBf16):
        logger.warning("bf16: true does not cover everything: %s (docs/performance.md, bf16)", FP32_UNDER_BF16)
    return strategy

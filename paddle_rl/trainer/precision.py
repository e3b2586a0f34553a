"""The compute precision of a run (`bf16`, `fp16`, `fp16_opt_level`, `amp_master_grad`, `amp_custom_black_list` /
`amp_custom_white_list`, `use_fp32_compute`): one strategy object, chosen once per run, and `fp16`'s dynamic loss
scaling (`LossScale`).

- Float32: everything in float32 (bf16 and fp16 false).
- EmulatedBf16 (bf16: true on a CPU build): every matmul of the model but the attention core (the column and row
  linear layers, LoRA's A and B, the MoE router, shared-expert gate and experts; models/layers.py Bf16Products)
  runs its three products (y = x W, dx = dy W^T, dW = x^T dy) from bfloat16-rounded operands with float32 sums
  (ops.bf16_linear); the parameters stay float32 and are the master weights the optimizer updates (its moments
  float32); norms, softmax, log-probs, advantages and losses stay float32. The head (the LM head, or a critic's
  value head) too unless use_fp32_compute. The attention core's q k^T and p v stay float32: one warning at the
  start says so (FP32_UNDER_BF16). Paddle's CPU build has no bfloat16 matmul: the products
  run the project's AMX-BF16 / AVX512-BF16 / AVX2 kernel where the CPU has one (ops.bf16_matmul), else emulated
  (rounded copies, float32 matmuls: the numbers of bf16 training, not its speed; one warning says so). A frozen
  model (the reference) keeps its linear layers' weights in bfloat16 (the same products, half their bytes).
- EmulatedFp16 (fp16: true on a CPU build): the same products as float16 (IEEE half) matmuls with float32 sums
  (ops.half_linear: operands rounded to float16, overflowing to inf above 65504, subnormals kept); the LM head and
  a value head stay float32 (their logits are what the log-probs read), and so does everything bf16 leaves float32.
  The loss is multiplied by the loss scale before the backward, so that the gradients the products round to float16
  stay above its underflow (LossScale).
- fp16_opt_level (both emulations): O1, the products' operands are rounded, their outputs float32 (bf16's numbers
  as before); O2, what AMP O2 passes between ops is half too: each product's output (y, dx, dW) is rounded, and so
  is each micro-batch's gradient of every trained parameter; without amp_master_grad the summed gradient of the
  mini-batch is stored in half as well (rounded after the backward and again after unscaling), with it float32.
- amp_custom_black_list naming a matmul (matmul_v2, matmul, linear: the products above) keeps the products float32;
  other ops named there are float32 in the emulation already. amp_custom_white_list may name the matmuls only: the
  emulation runs nothing else in half (precision_problems refuses the rest before any model loads).
- AmpHalf (bf16 or fp16 on a CUDA build with a GPU in use): Paddle's AMP at fp16_opt_level, `paddle.amp.decorate(
  models, optimizers, level="O2", dtype, master_weight=True, master_grad=amp_master_grad)` under O2 and `auto_cast(
  level, dtype, custom_white_list, custom_black_list)` around the forward passes; the LM head's log-probs take
  float32 copies of the hidden states and head weight (bfloat16-rounded operands unless use_fp32_compute, as on
  the CPU). Not run by this project's tests (no GPU there).

Every model of a run (actor, reference, critic) goes through `prepare_model`; the trained ones with their optimizer
through `prepare_training`; the trainer wraps its forward passes in `autocast()` and calls `finish_gradients`
after each mini-batch's backward.
"""
import contextlib
import logging
import math

import paddle

from .. import ops
from ..config.precision_args import MATMUL_OPS, amp_ops
from ..models.layers import Bf16Products

logger = logging.getLogger("paddle_rl")


class Float32:
    name = "float32"
    dtype = None          # the half dtype of the products (None: float32)
    loss_scale = None     # fp16's LossScale

    def prepare_model(self, model) -> None:
        """Set the model's compute precision (before its optimizer is built)."""

    def prepare_training(self, model, optimizer):
        """(model, optimizer) as the run trains them."""
        return model, optimizer

    def autocast(self):
        """The context the forward passes run in."""
        return contextlib.nullcontext()

    def finish_gradients(self, params) -> None:
        """After a mini-batch's backward, before unscaling: the gradients as the precision stores them."""


class _Emulated(Float32):
    """What the CPU emulations share: the level (O1 | O2), master gradients, and whether the products are half at all
    (a black-listed matmul keeps them float32)."""

    def __init__(self, level: str = "O1", master_grad: bool = False, products: bool = True):
        self.level, self.master_grad, self.products = level, bool(master_grad), bool(products)

    def _half_products(self, model):
        """O2: the body's products (set_bf16's `linears`, on) round their outputs too; fp16: they are float16."""
        if self.dtype == "bfloat16" and self.level == "O1":
            return
        half = ops.HalfProducts(self.dtype, round_outputs=self.level == "O2")
        for m in model.sublayers():
            if isinstance(m, Bf16Products) and m.bf16 and m is not getattr(model, "lm_head", None) \
                    and m is not getattr(model, "score", None):
                m.half = half

    def prepare_training(self, model, optimizer):
        if self.level == "O2" and self.products:  # each micro-batch's gradient is an O2 op's half output
            dtype = self.dtype
            for p in model.parameters():
                if not p.stop_gradient:
                    p.register_hook(lambda g, dtype=dtype: ops.round_half(g, dtype))
        return model, optimizer

    def finish_gradients(self, params) -> None:
        if self.level == "O2" and self.products and not self.master_grad:  # the summed gradient stored in half
            _round_grads(params, self.dtype)


class EmulatedBf16(_Emulated):
    name = "bfloat16 on the CPU (bf16-rounded operands, float32 sums)"
    dtype = "bfloat16"

    def __init__(self, fp32_head: bool, level: str = "O1", master_grad: bool = False, products: bool = True):
        super().__init__(level, master_grad, products)
        self.fp32_head = fp32_head

    def prepare_model(self, model) -> None:
        if not self.products:
            return
        model.set_bf16(linears=True, head=not self.fp32_head and getattr(model, "is_last", True))
        self._half_products(model)
        if all(p.stop_gradient for p in model.parameters()):  # a frozen model (the reference): bf16 linear weights
            model.store_linears_bf16()


class EmulatedFp16(_Emulated):
    name = "float16 on the CPU (float16-rounded operands, float32 sums)"
    dtype = "float16"

    def __init__(self, loss_scale, level: str = "O1", master_grad: bool = False, products: bool = True):
        super().__init__(level, master_grad, products)
        self.loss_scale = loss_scale

    def prepare_model(self, model) -> None:
        if not self.products:
            return
        model.set_bf16(linears=True, head=False)   # the body's products on; the head stays float32
        self._half_products(model)


class AmpHalf(Float32):
    """Paddle's AMP on a GPU (module doc)."""

    def __init__(self, fp32_head: bool, dtype: str = "bfloat16", level: str = "O2", master_grad: bool = False,
                 white: tuple = (), black: tuple = (), loss_scale=None):
        self.fp32_head, self.dtype, self.level, self.master_grad = fp32_head, dtype, level, bool(master_grad)
        self.white, self.black, self.loss_scale = list(white), list(black), loss_scale
        self.name = f"{dtype} (Paddle AMP {level}" + (", float32 master weights)" if level == "O2" else ")")

    def prepare_model(self, model) -> None:
        model.head_bf16 = not self.fp32_head and _has_head(model)  # head_logprobs upcasts, then rounds or not
        if self.fp32_head and model.config.sequence_classifier and getattr(model, "is_last", True):
            logger.warning("use_fp32_compute: under AMP the value head (score) of this sequence classifier runs in "
                           "%s like the rest of the model; only the LM head's log-probs are float32", self.dtype)
        if getattr(model, "_amp_decorated", False) or self.level != "O2":
            return
        if all(p.stop_gradient for p in model.parameters()):  # a frozen model (the reference): half weights
            paddle.amp.decorate(models=model, level="O2", dtype=self.dtype)
            model._amp_decorated = True

    def prepare_training(self, model, optimizer):
        if self.level != "O2":
            return model, optimizer
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.dtype,
                                               master_weight=True, master_grad=self.master_grad)
        model._amp_decorated = True
        return model, optimizer

    def autocast(self):
        return paddle.amp.auto_cast(level=self.level, dtype=self.dtype, custom_white_list=self.white or None,
                                    custom_black_list=self.black or None)


class AmpBf16(AmpHalf):
    """AmpHalf in bfloat16 (O2 unless told)."""

    def __init__(self, fp32_head: bool, level: str = "O2", master_grad: bool = False, white=(), black=()):
        super().__init__(fp32_head, "bfloat16", level, master_grad, white, black)


@paddle.no_grad()
def _round_grads(params, dtype: str) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.stop_gradient = True  # as the clipping's in-place scale does (parallel/sharding.py)
            paddle.assign(ops.round_half(p.grad, dtype), output=p.grad)


class LossScale:
    """Dynamic loss scaling as Paddle's GradScaler (PaddleNLP's `scale_loss` its initial value): the loss is multiplied
    by `value` before the backward and the gradients divided by it after; an update whose gradients hold an inf or
    NaN is skipped (`overflow`), and after `decr_every_n_nan_or_inf` such updates (counted since the last change)
    the scale is multiplied by `decr_ratio` (never below 1); after `incr_every_n_steps` applied updates in a row by
    `incr_ratio` (while the product stays finite). `dynamic` false: the scale stays at its initial value."""

    def __init__(self, init: float, incr_ratio: float = 2.0, decr_ratio: float = 0.5, incr_every_n_steps: int = 1000,
                 decr_every_n_nan_or_inf: int = 2, dynamic: bool = True, half_grads: str = None):
        self.value, self.incr_ratio, self.decr_ratio = float(init), float(incr_ratio), float(decr_ratio)
        self.incr_every, self.decr_every, self.dynamic = int(incr_every_n_steps), int(decr_every_n_nan_or_inf), dynamic
        self.half_grads = half_grads   # the dtype the unscaled gradients are stored in (O2 without master grads)
        self.good = self.bad = 0
        self.overflows = 0             # updates skipped for an overflow, the run's (checkpointed)

    def scale(self, loss):
        return loss * self.value if self.value != 1.0 else loss

    def unscale_(self, params) -> None:
        """Each gradient divided by the scale (multiplied by its inverse, as Paddle does), in place."""
        if self.value == 1.0:
            return
        inverse = 1.0 / self.value
        with paddle.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.stop_gradient = True  # as the clipping's in-place scale does (parallel/sharding.py)
                    p.grad.scale_(inverse)
        if self.half_grads:
            _round_grads(params, self.half_grads)

    @property
    def cures(self) -> bool:
        """Whether a skipped update can be blamed on the scale: dynamic scaling with room to back off."""
        return self.dynamic and self.value > 1.0

    def update(self, found_inf: bool) -> None:
        """After an update: applied (found_inf false) or skipped for a non-finite gradient."""
        if not self.dynamic:
            return
        if found_inf:
            self.good, self.bad = 0, self.bad + 1
            if self.bad >= self.decr_every:
                self.value, self.bad = max(1.0, self.value * self.decr_ratio), 0
            return
        self.good, self.bad = self.good + 1, 0
        if self.good >= self.incr_every:
            grown = self.value * self.incr_ratio
            self.value, self.good = (grown if math.isfinite(grown) else self.value), 0

    def state_dict(self) -> dict:
        return {"value": self.value, "good": self.good, "bad": self.bad, "overflows": self.overflows}

    def set_state_dict(self, state: dict) -> None:
        if state:
            self.value = float(state["value"])
            self.good, self.bad = int(state.get("good", 0)), int(state.get("bad", 0))
            self.overflows = int(state.get("overflows", 0))


def _has_head(model) -> bool:
    return getattr(model, "is_last", True) and not model.config.sequence_classifier


def _cpu_bf16_kernel() -> str:
    """The bf16 matmul kernel the CPU strategy's products run (amx | avx512_bf16 | avx2), or "the emulation"."""
    if ops.emulation_forced() or not ops.bf16_kernels():
        return "the emulation (PADDLE_RL_BF16_EMULATE set)" if ops.emulation_forced() else "the emulation"
    return f"the {ops.bf16_kernels()[0]} kernel"


# What bf16: true leaves float32 on a CPU build (the products of trainer/precision.py's EmulatedBf16 are the rest).
FP32_UNDER_BF16 = ("the attention core's products (q k^T and p v, with the softmax between them) run in float32, in "
                   "training and in the rollout's prefill and decode")
# What fp16: true leaves float32 on a CPU build besides
FP32_UNDER_FP16 = ("the LM head's products, the attention core's (q k^T and p v, with the softmax between them), "
                   "norms, the residual stream, log-probs and losses run in float32, and the rollout decodes in "
                   "float32")


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu")


def cpu_float32_white_ops(config, on_gpu=None) -> list:
    """The ops of amp_custom_white_list that a CPU build keeps float32 under bf16 / fp16: its emulation runs only
    the matmuls in half precision (Paddle's AMP on a GPU build takes the whole list)."""
    if not (config.bf16 or config.fp16) or (_on_gpu() if on_gpu is None else on_gpu):
        return []
    return [op for op in amp_ops(config.amp_custom_white_list) if op not in MATMUL_OPS]


def loss_scale_for(config):
    """fp16's LossScale from the config's keys (None without fp16)."""
    if not config.fp16:
        return None
    half_grads = "float16" if config.fp16_opt_level == "O2" and not config.amp_master_grad else None
    return LossScale(config.scale_loss, config.incr_ratio, config.decr_ratio, config.incr_every_n_steps,
                     config.decr_every_n_nan_or_inf, config.use_dynamic_loss_scaling, half_grads)


def precision_for(config):
    """The strategy of `bf16` / `fp16` and their keys: AMP on a CUDA build running on a GPU, else the emulation."""
    if not (getattr(config, "bf16", False) or getattr(config, "fp16", False)):
        return Float32()
    other = cpu_float32_white_ops(config)
    if other:   # as the attention core under bf16 on a CPU: said once, the run goes on (PaddleNLP's file lists them)
        logger.warning("amp_custom_white_list: %s: on a CPU build the %s emulation runs only the matmuls (%s: the "
                       "linear layers' products) in half precision; these ops stay float32 (Paddle's AMP on a GPU "
                       "build takes the list)", ", ".join(other), "fp16" if config.fp16 else "bf16",
                       ", ".join(MATMUL_OPS))
    fp16 = bool(config.fp16)
    fp32_head = bool(getattr(config, "use_fp32_compute", False))
    level, master = config.fp16_opt_level, bool(config.amp_master_grad)
    white, black = amp_ops(config.amp_custom_white_list), amp_ops(config.amp_custom_black_list)
    products = not any(op in MATMUL_OPS for op in black)
    scale = loss_scale_for(config)
    if _on_gpu():
        strategy = AmpHalf(fp32_head, "float16" if fp16 else "bfloat16", level, master, white, black, scale)
    elif fp16:
        strategy = EmulatedFp16(scale, level, master, products)
    else:
        strategy = EmulatedBf16(fp32_head, level, master, products)
    if isinstance(strategy, AmpHalf):
        logger.info("compute precision: %s; LM head / value head %s", strategy.name,
                    "float32" if fp32_head else strategy.dtype)
    elif not products:
        logger.warning("amp_custom_black_list names %s: the linear layers' products run in float32, so %s: true "
                       "computes nothing in half precision on this CPU build%s", ", ".join(
                           op for op in black if op in MATMUL_OPS), "fp16" if fp16 else "bf16",
                       " (the loss is still scaled)" if fp16 else "")
    elif fp16:
        logger.info("compute precision: %s, %s%s; loss scale %g (%s)", strategy.name, level,
                    "" if level == "O1" else (" with float32 master gradients" if master else
                                              " with float16 gradients"),
                    scale.value, "dynamic" if scale.dynamic else "static")
        logger.warning("fp16: true does not cover everything: %s (docs/performance.md, fp16)", FP32_UNDER_FP16)
    else:
        logger.info("compute precision: %s, %s; LM head / value head %s; products by %s", strategy.name, level,
                    "float32" if fp32_head else "bfloat16", _cpu_bf16_kernel())
        logger.warning("bf16: true does not cover everything: %s (docs/performance.md, bf16)", FP32_UNDER_BF16)
    return strategy

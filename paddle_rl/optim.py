"""AdamW with decoupled weight decay (not on norms and biases), lr schedules and global-norm clipping."""
import math
from typing import Callable, Iterable, Optional

import paddle


def lr_factor(schedule: str, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0,
              decay_steps: int = 0) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based). warmup_stable_decay: the peak
    after the warm-up, then a cosine decay over the last `decay_steps` steps (transformers' WSD schedule)."""
    total_steps = max(total_steps, 1)
    wsd = schedule == "warmup_stable_decay"
    decay_start = max(total_steps - decay_steps, warmup_steps) if wsd else warmup_steps
    decay = "cosine" if wsd else schedule

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule in ("constant", "constant_with_warmup") or step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        if decay == "linear":
            return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        if decay == "cosine":
            return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"lr_scheduler_type: unknown {schedule!r}")
    return factor


def build_optimizer(model, config, total_optimizer_steps: int, parameters=None):
    """(AdamW, scheduler) over the trained ones of `parameters` (default: the model's; a sharded optimizer passes
    its shard); frozen parameters (a LoRA model's base) get no optimizer state."""
    warmup = config.warmup_steps or int(config.warmup_ratio * total_optimizer_steps)
    scheduler = paddle.optimizer.lr.LambdaDecay(
        config.learning_rate, lr_factor(config.lr_scheduler_type, total_optimizer_steps, warmup, config.min_lr_ratio,
                                       config.lr_decay_steps))
    no_decay = {p.name for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")}
    parameters = [p for p in (model.parameters() if parameters is None else parameters) if not p.stop_gradient]
    optimizer = paddle.optimizer.AdamW(
        learning_rate=scheduler, parameters=parameters, weight_decay=config.weight_decay,
        beta1=config.adam_beta1, beta2=config.adam_beta2, epsilon=config.adam_epsilon,
        apply_decay_param_fun=lambda name: name not in no_decay)
    return optimizer, scheduler


def make_state(optimizer) -> None:
    """An AdamW's state (its moments, the betas' powers, and the float32 master weights of parameters AMP O2 made
    half) made now, beside the parameters, not in its first step() as Paddle would; call it after the precision has
    prepared the optimizer (AMP's decorate decides the master weights). `optimizer`: an AdamW or a sharded optimizer
    around one. The same values. Made in the first step, the state takes the heap's pieces the first update's
    activations freed and the second update's no longer fit them: W3 float32 on the EPYC Zen 3, that update took 435K
    page faults and ~8 s more (47K with the state made here). The cost: a one-step run peaks higher (6.5 GB against
    5.3; from the second step on 6.8 against 7.0-7.1)."""
    inner = getattr(optimizer, "inner", optimizer)
    trained = [p for p in inner._parameter_list if not p.stop_gradient]
    inner._create_accumulators(paddle.static.default_main_program().global_block(), trained)


def clip_grad_norm_(parameters: Iterable, max_norm: float,
                    reduce_sum: Optional[Callable] = None) -> float:
    """Scale gradients so their global L2 norm is at most max_norm; returns the norm before clipping.

    reduce_sum, when given, sums the squared norm across the ranks that hold disjoint gradient shards.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    squared = paddle.add_n([paddle.sum(g.astype("float32").square()) for g in grads])
    if reduce_sum is not None:
        squared = reduce_sum(squared)
    norm = float(squared.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        with paddle.no_grad():
            for g in grads:
                g.scale_(scale)
    return norm

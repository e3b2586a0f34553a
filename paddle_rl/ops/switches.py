"""The fused-kernel switches of the model's passes (PaddleNLP's use_flash_attention, use_fused_rms_norm,
use_fused_rope, use_fused_head_and_loss_fn, use_fused_linear): each None (automatic: the kernel where it runs, the
choice of earlier builds), True (the fused path, an error naming the key where it cannot run) or False (the composed Paddle ops).

- attention: True, the blocked attention (ops.blocked_attention; a packed row: the CPU kernel where it runs): the
  probabilities are never stored, the backward recomputes them from each row's saved maximum and sum; False,
  softmax(QK^T) materialized; None, the packed kernel for packed rows and the materialized path for padded ones
- rms_norm, rope: True, the kernel with its own backward; False, the composed ops; None, the kernel where it runs
- head: True or None, the LM head and log-probs in chunks of rows (ops.lm_head_logprobs); False, the whole
  [tokens, vocab] logits (ops.lm_head_logprobs_reference)
- linear: True or None, Paddle's linear op with the bias inside it (linear_bias.py); False, the product and a separate
  bias add

One setting per process (`select`, from the config as the trainer starts; `selected` for a block of code). The
rollout's decode step keeps its own fused kernels (rotary_qkv_cache, decode_attention) whatever is set.
"""
import contextlib

from . import build

KEYS = {"attention": "use_flash_attention", "rms_norm": "use_fused_rms_norm", "rope": "use_fused_rope",
        "head": "use_fused_head_and_loss_fn", "linear": "use_fused_linear"}
# switches whose fused path is a csrc kernel (attention's and head's also run without one)
NEEDS_KERNELS = ("rms_norm", "rope")

_state = dict.fromkeys(KEYS)


class SwitchError(ValueError):
    """A switch is on where its fused path cannot run; the message starts with the key."""


def select(**values) -> None:
    """Set switches by name (attention, rms_norm, rope, head) to None / True / False. A True switch whose fused
    path is a kernel needs the custom ops in use (SwitchError naming the key)."""
    for name, value in values.items():
        if name not in KEYS:
            raise ValueError(f"unknown kernel switch {name!r} (one of {', '.join(KEYS)})")
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{KEYS[name]}: must be true, false or null, got {value!r}")
    for name, value in values.items():
        if value and name in NEEDS_KERNELS and not build.available():
            raise SwitchError(f"{KEYS[name]}: true needs the fused kernels of csrc/, which are not in use "
                              f"({build.status()['reason']}); set it false or leave it unset")
    _state.update(values)


def switch(name: str):
    """The switch's value: None (automatic), True or False."""
    return _state[name]


def current() -> dict:
    return dict(_state)


@contextlib.contextmanager
def selected(**values):
    """The switches set as given inside the block, restored after it."""
    previous = current()
    try:
        select(**values)
        yield
    finally:
        _state.update(previous)


def unset_choices(packed: bool) -> dict:
    """What each switch left unset selects in the model's training passes on this build: True the fused path,
    False the composed one (attention: the packed kernel for packed rows where the kernels run, the materialized
    probabilities for padded rows; rms_norm, rope: the kernel where the kernels run; head: chunked, unless the model
    reads whole logits (tensor parallel, soft-capped: `CausalLM.unchunked_head`); linear: Paddle's linear op)."""
    kernels = build.available()
    return {"attention": packed and kernels, "rms_norm": kernels, "rope": kernels, "head": True, "linear": True}


def unusable(name: str, why: str) -> SwitchError:
    """The error of a True switch whose fused path does not run on these tensors."""
    return SwitchError(f"{KEYS[name]}: true, but the fused kernel cannot run here ({why}); set it false or leave it "
                       "unset")

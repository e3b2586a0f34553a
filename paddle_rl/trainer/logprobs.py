"""Per-token log-probs (and entropy) of response tokens under a model, in micro-batches.

The LM head runs on response positions only, through `ops.lm_head_logprobs`: chunks of rows, never a
[tokens, vocab] log-softmax (a fused kernel when available).
"""
import numpy as np
import paddle

from .. import ops
from ..models.decoder import attention_bias_from_mask, position_ids_from_mask


def _head_weight(model):
    """(weight, transposed) when the output projection is one bias-free matrix over the whole vocabulary
    ([hidden, vocab], or the tied embedding [vocab, hidden]); None otherwise (the model's own `logits`)."""
    if getattr(model, "tp_group", None) is not None:
        return None
    cfg = model.config
    if cfg.tie_word_embeddings:
        weight = getattr(getattr(model, "embed_tokens", None), "weight", None)
        ok = weight is not None and list(weight.shape) == [cfg.vocab_size, cfg.hidden_size]
        return (weight, True) if ok else None
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or getattr(head, "bias", None) is not None:
        return None
    return (weight, False) if list(weight.shape) == [cfg.hidden_size, cfg.vocab_size] else None


def response_hidden(model, input_ids, attention_mask, prompt_width: int, length: int, shared_prompts=None):
    """Final hidden states at the positions that predict the `length` response tokens: [b, length, hidden].

    shared_prompts = (prompt_first [U], prompt_rows [b]) runs each distinct prompt once
    (`CausalLM.shared_prompt_hidden_states`); None runs every row's prompt. Layer recompute in training
    takes the full pass: a recomputed layer cannot hand its prompt keys/values, with their autograd
    history, to the response pass."""
    recomputing = getattr(model, "recompute", False) and model.training
    if shared_prompts is not None and not recomputing and input_ids.shape[1] == prompt_width + length:
        return model.shared_prompt_hidden_states(input_ids, attention_mask, prompt_width, *shared_prompts)
    bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
    hidden = model.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias)
    return hidden[:, prompt_width - 1:prompt_width - 1 + length]


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False, shared_prompts=None):
    """log softmax(logits / T) at response_ids: [b, T] (and entropy [b, T]).

    input_ids = [left-padded prompt | right-padded response]; the LM head runs on response positions only.
    shared_prompts: see `response_hidden`.
    """
    batch, length = response_ids.shape[0], response_ids.shape[1]
    hidden = response_hidden(model, input_ids, attention_mask, prompt_width, length, shared_prompts)
    head = _head_weight(model)
    if head is None:
        return ops.logprobs_from_logits(model.logits(hidden), response_ids, temperature, with_entropy)
    weight, transposed = head
    logp, entropy = ops.lm_head_logprobs(hidden.reshape([batch * length, hidden.shape[-1]]), weight,
                                         response_ids.reshape([-1]), temperature, with_entropy,
                                         transpose_weight=transposed)
    return logp.reshape([batch, length]), None if entropy is None else entropy.reshape([batch, length])


@paddle.no_grad()
def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, with_entropy: bool = False,
                     chunk_fn=None, share_prompts: bool = True):
    """No-grad log-probs over a whole RolloutBatch in chunks; numpy [B, T] (and entropy).

    chunk_fn (default token_logprobs) computes one chunk; tensor parallelism passes its vocab-parallel one.
    share_prompts runs each distinct prompt of a chunk once (`response_hidden`).
    """
    chunk_fn = chunk_fn or token_logprobs
    was_training = model.training
    model.eval()
    outs, ents = [], []
    for start in range(0, batch.size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        part = batch.tensors(rows)
        logp, ent = chunk_fn(model, part["input_ids"], part["attention_mask"], batch.prompt_width,
                             part["response_ids"], temperature, with_entropy,
                             shared_prompts=batch.shared_prompts(rows) if share_prompts else None)
        outs.append(logp.numpy())
        if with_entropy:
            ents.append(ent.numpy())
    if was_training:
        model.train()
    mask = batch.response_mask
    logp = np.concatenate(outs) * mask
    return (logp, np.concatenate(ents) * mask) if with_entropy else logp


def reuses_rollout_logprobs(config, mini_batches_per_step: int) -> bool:
    """Whether the old-policy log-probs are the rollout's own (`reuse_rollout_logprobs`).

    The rollout samples from, and records log softmax(logits / T) of, the very weights the old-log-prob pass
    would recompute, so the two agree to float rounding (tests/test_rollout_logprobs.py bounds the gap).
    `auto` reuses them when the update is on-policy (one mini-batch per step, update_iters 1), where the
    PPO ratio is 1 up to that rounding; `on` always; `off` never."""
    mode = str(getattr(config, "reuse_rollout_logprobs", "off")).lower()
    if mode == "on":
        return True
    if mode == "auto":
        return mini_batches_per_step == 1 and config.update_iters == 1
    return False

"""Response-token log-probs of a tensor-parallel model from vocabulary-sharded logits.

Same contract as trainer/logprobs.py (which a model without a tensor-parallel group goes to): the LM
head runs on response positions only, logits are divided by the temperature.
"""

from ..models.decoder import attention_bias_from_mask, position_ids_from_mask
from .tensor_parallel import vocab_parallel_logprobs


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False):
    group = getattr(model, "tp_group", None)
    if group is None:
        from ..trainer import logprobs as single
        return single.token_logprobs(model, input_ids, attention_mask, prompt_width, response_ids, temperature,
                                     with_entropy)
    length = response_ids.shape[1]
    bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
    hidden = model.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias)
    logits = model.local_logits(hidden[:, prompt_width - 1:prompt_width - 1 + length])
    if temperature > 0:
        logits = logits / temperature
    return vocab_parallel_logprobs(logits, response_ids, group, model.embed_tokens.vocab_start, with_entropy)


def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, with_entropy: bool = False):
    """No-grad log-probs over a whole RolloutBatch in chunks; numpy [B, T] (and entropy)."""
    from ..trainer import logprobs as single
    chunk_fn = None if getattr(model, "tp_group", None) is None else token_logprobs
    return single.batched_logprobs(model, batch, temperature, micro_batch_size, with_entropy, chunk_fn=chunk_fn)

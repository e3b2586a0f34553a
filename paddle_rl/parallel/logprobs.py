"""Response-token log-probs of a tensor-parallel model from vocabulary-sharded logits.

Same contract as trainer/logprobs.py (which a model without a tensor-parallel group goes to): the LM
head runs on response positions only, logits are divided by the temperature.
"""

from .tensor_parallel import vocab_parallel_logprobs


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False, shared_prompts=None):
    from ..trainer import logprobs as single
    group = getattr(model, "tp_group", None)
    if group is None:
        return single.token_logprobs(model, input_ids, attention_mask, prompt_width, response_ids, temperature,
                                     with_entropy, shared_prompts)
    hidden = single.response_hidden(model, input_ids, attention_mask, prompt_width, response_ids.shape[1],
                                    shared_prompts)
    logits = model.local_logits(hidden)
    if temperature > 0:
        logits = logits / temperature
    return vocab_parallel_logprobs(logits, response_ids, group, model.embed_tokens.vocab_start, with_entropy)


def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, with_entropy: bool = False,
                     share_prompts: bool = True):
    """No-grad log-probs over a whole RolloutBatch in chunks; numpy [B, T] (and entropy)."""
    from ..trainer import logprobs as single
    chunk_fn = None if getattr(model, "tp_group", None) is None else token_logprobs
    return single.batched_logprobs(model, batch, temperature, micro_batch_size, with_entropy, chunk_fn=chunk_fn,
                                   share_prompts=share_prompts)

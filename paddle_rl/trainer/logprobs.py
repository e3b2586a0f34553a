"""Per-token log-probs (and entropy) of response tokens under a model, in micro-batches."""
from typing import Optional

import numpy as np
import paddle
import paddle.nn.functional as F

from ..models.decoder import attention_bias_from_mask, position_ids_from_mask


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False):
    """log softmax(logits / T) at response_ids: [b, T] (and entropy [b, T]).

    input_ids = [left-padded prompt | right-padded response]; the LM head runs on response positions only.
    """
    length = response_ids.shape[1]
    bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
    hidden = model.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias)
    logits = model.logits(hidden[:, prompt_width - 1:prompt_width - 1 + length])
    if temperature > 0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, axis=-1)
    logp = paddle.take_along_axis(logp_all, response_ids.unsqueeze(-1), axis=-1).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


@paddle.no_grad()
def batched_logprobs(model, batch, temperature: float, micro_batch_size: int, with_entropy: bool = False):
    """No-grad log-probs over a whole RolloutBatch in chunks; numpy [B, T] (and entropy)."""
    was_training = model.training
    model.eval()
    outs, ents = [], []
    for start in range(0, batch.size, micro_batch_size):
        part = batch.tensors(slice(start, start + micro_batch_size))
        logp, ent = token_logprobs(model, part["input_ids"], part["attention_mask"], batch.prompt_width,
                                   part["response_ids"], temperature, with_entropy)
        outs.append(logp.numpy())
        if with_entropy:
            ents.append(ent.numpy())
    if was_training:
        model.train()
    mask = batch.response_mask
    logp = np.concatenate(outs) * mask
    return (logp, np.concatenate(ents) * mask) if with_entropy else logp

"""Per-token log-probs (and entropy) of response tokens under a model, for one micro-batch (padded, or packed
into one row: packing.py).

The LM head runs on response positions only (`CausalLM.head_logprobs`: chunked, or vocabulary-parallel
under tensor parallelism).
"""
import paddle

from .decoder import attention_bias_from_mask, position_ids_from_mask


def response_hidden(model, input_ids, attention_mask, prompt_width: int, length: int, shared_prompts=None):
    """Final hidden states at the positions that predict the `length` response tokens: [b, length, hidden].

    shared_prompts = (prompt_first [U], prompt_rows [b]) runs each distinct prompt once
    (`CausalLM.shared_prompt_hidden_states`); None runs every row's prompt. Layer or attention-block recompute in
    training takes the full pass: a recomputed layer cannot hand its prompt keys/values, with their autograd
    history, to the response pass (core_attn recompute can: the keys and values are made outside it)."""
    if shared_prompts is not None and not model.recomputes_layers and input_ids.shape[1] == prompt_width + length:
        return model.shared_prompt_hidden_states(input_ids, attention_mask, prompt_width, *shared_prompts)
    bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
    # the load-balancing loss (MoE) counts the tokens the shared-prompt pass runs: all real ones but the last column
    weight = paddle.concat([attention_mask[:, :-1], paddle.zeros_like(attention_mask[:, -1:])], axis=1)
    hidden = model.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias, token_weight=weight)
    return hidden[:, prompt_width - 1:prompt_width - 1 + length]


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False, shared_prompts=None, with_greedy: bool = False):
    """log softmax(logits / T) at response_ids: [b, T] (and entropy [b, T], else None; with `with_greedy` a third
    output, the argmax of the logits at each position [b, T] int64: CausalLM.head_logprobs).

    input_ids = [left-padded prompt | right-padded response]; shared_prompts: see `response_hidden`.
    """
    hidden = response_hidden(model, input_ids, attention_mask, prompt_width, response_ids.shape[1], shared_prompts)
    return model.head_logprobs(hidden, response_ids, temperature, with_entropy, with_greedy=with_greedy)


def packed_token_logprobs(model, packing, temperature: float, with_entropy: bool = False, with_greedy: bool = False):
    """token_logprobs of a packed micro-batch (packing.Packing): [b, W] (and entropy, and the argmax with
    `with_greedy`), the LM head on the positions that predict real response tokens only; 0 where nothing is
    predicted."""
    hidden = paddle.gather(model.packed_hidden_states(packing)[0], packing.select).unsqueeze(0)
    out = model.head_logprobs(hidden, packing.targets, temperature, with_entropy, with_greedy=with_greedy)
    return tuple(None if x is None else packing.place(x) for x in out)

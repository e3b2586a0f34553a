"""Per-token log-probs (and entropy) of response tokens under a model, for one micro-batch (padded, or packed
into one row: packing.py).

The LM head runs on response positions only (`CausalLM.head_logprobs`: chunked, or vocabulary-parallel
under tensor parallelism).
"""
import numpy as np
import paddle

from .decoder import attention_bias_from_mask, position_ids_from_mask


def response_hidden(model, input_ids, attention_mask, prompt_width: int, length: int, shared_prompts=None):
    """Final hidden states at the positions that predict the `length` response tokens: [b, length, hidden].

    shared_prompts = (prompt_first [U], prompt_rows [b]) runs each distinct prompt once
    (`CausalLM.shared_prompt_hidden_states`); None runs every row's prompt. Layer or attention-block recompute in
    training takes the full pass: a recomputed layer cannot hand its prompt keys/values, with their autograd
    history, to the response pass (core_attn recompute can: the keys and values are made outside it)."""
    if shared_prompts is not None and not model.recomputes_layers and input_ids.shape[1] == prompt_width + length \
            and model.context_group is None:
        return model.shared_prompt_hidden_states(input_ids, attention_mask, prompt_width, *shared_prompts)
    bias = attention_bias_from_mask(attention_mask, input_ids.shape[1], causal=True)
    # the load-balancing loss (MoE) counts the tokens the shared-prompt pass runs: all real ones but the last column
    weight = paddle.concat([attention_mask[:, :-1], paddle.zeros_like(attention_mask[:, -1:])], axis=1)
    hidden = model.hidden_states(input_ids, position_ids_from_mask(attention_mask), bias, token_weight=weight,
                                 split_context=True)
    if model.context_group is not None:  # this rank's tokens: the caller's head reads them (response_head)
        return hidden
    return hidden[:, prompt_width - 1:prompt_width - 1 + length]


def response_head(model, input_ids, attention_mask, prompt_width: int, length: int, shared_prompts, fn, kinds):
    """fn(hidden [b, n, h], cols) -> outputs [b, n] (one per entry of `kinds`: "float", "int" or None) at the
    positions that predict the `length` response tokens, each output [b, length]. Under context parallelism the
    hidden states hold this rank's tokens and fn runs on the response positions among them (`context_head`);
    otherwise on all (cols: every column)."""
    hidden = response_hidden(model, input_ids, attention_mask, prompt_width, length, shared_prompts)
    if model.context_group is None:
        return fn(hidden, np.arange(length))
    split = model.context_split(input_ids.shape[1])
    return context_head(split, hidden, np.arange(prompt_width - 1, prompt_width - 1 + length), fn, kinds)


def head_kinds(with_entropy: bool, with_greedy: bool) -> tuple:
    """The kinds of CausalLM.head_logprobs's outputs (context_head)."""
    return ("float", "float" if with_entropy else None) + (("int",) if with_greedy else ())


def token_logprobs(model, input_ids, attention_mask, prompt_width: int, response_ids, temperature: float,
                   with_entropy: bool = False, shared_prompts=None, with_greedy: bool = False):
    """log softmax(logits / T) at response_ids: [b, T] (and entropy [b, T], else None; with `with_greedy` a third
    output, the argmax of the logits at each position [b, T] int64: CausalLM.head_logprobs).

    input_ids = [left-padded prompt | right-padded response]; shared_prompts: see `response_hidden`.
    """
    def head(hidden, cols):
        targets = response_ids if len(cols) == response_ids.shape[1] else \
            paddle.gather(response_ids, paddle.to_tensor(cols), axis=1)
        return model.head_logprobs(hidden, targets, temperature, with_entropy, with_greedy=with_greedy)
    return response_head(model, input_ids, attention_mask, prompt_width, response_ids.shape[1], shared_prompts, head,
                         head_kinds(with_entropy, with_greedy))


def packed_token_logprobs(model, packing, temperature: float, with_entropy: bool = False, with_greedy: bool = False):
    """token_logprobs of a packed micro-batch (packing.Packing): [b, W] (and entropy, and the argmax with
    `with_greedy`), the LM head on the positions that predict real response tokens only; 0 where nothing is
    predicted. Under context parallelism each rank runs the head on the positions it holds (`context_head`)."""
    hidden = model.packed_hidden_states(packing, split_context=True)
    if model.context_group is None:
        out = model.head_logprobs(paddle.gather(hidden[0], packing.select).unsqueeze(0), packing.targets, temperature,
                                  with_entropy, with_greedy=with_greedy)
    else:
        def head(h, cols):
            return model.head_logprobs(h, paddle.gather(packing.targets, paddle.to_tensor(cols), axis=1), temperature,
                                       with_entropy, with_greedy=with_greedy)
        out = context_head(model.context_split(packing.tokens), hidden, packing.select.numpy(), head,
                           head_kinds(with_entropy, with_greedy))
    return tuple(None if x is None else packing.place(x) for x in out)


def context_head(split, hidden, positions, fn, kinds):
    """Outputs of a head at `positions` (numpy int64 [P], token indices along axis 1 of the whole pass) from hidden
    states that hold this rank's tokens only (context parallelism: collectives.ContextSplit; hidden [B, local, h]).
    fn(h, cols) runs the head on the positions this rank holds (h [B, n, h]; cols: their indices in `positions`) and
    returns one tensor [B, n] per entry of `kinds` ("float", "int", or None for an output it does not make). Each
    output comes back [B, P] on every rank: the ranks' own positions summed over the group (the float ones with an
    identity backward, so each rank's positions take the gradient of the loss that every rank computes whole)."""
    positions = np.asarray(positions, dtype=np.int64)
    mine = np.flatnonzero(split.owned(positions))
    batch, count = hidden.shape[0], len(positions)
    # a rank holding none of the positions runs the head on its first token and keeps 0 x its outputs (in the first
    # position's place): its backward then reaches the layers' collectives and every head parameter as its peers' do
    # (the gradient sum over the group needs the same tensors on every rank)
    idle = not len(mine)
    at = np.zeros(1, np.int64) if idle else positions[mine] - split.start
    take = np.zeros(1, np.int64) if idle else mine
    outs = fn(paddle.gather(hidden, paddle.to_tensor(at), axis=1), take)
    index = np.full(count, len(take), dtype=np.int64)
    index[take] = np.arange(len(take))
    index = paddle.to_tensor(index)
    result = []
    for kind, out in zip(kinds, outs):
        if kind is None:
            result.append(None)
            continue
        dtype = "int64" if kind == "int" else "float32"
        out = out.astype(dtype)
        if idle:
            out = paddle.zeros_like(out) if kind == "int" else out * 0.0
        full = paddle.gather(paddle.concat([out, paddle.zeros([batch, 1], dtype)], axis=1), index, axis=1)
        result.append(split.sum_ints(full) if kind == "int" else split.sum(full))
    return tuple(result)

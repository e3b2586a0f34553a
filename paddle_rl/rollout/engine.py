"""Batched KV-cached generation: prefill each prompt once, fan out to n samples, decode step by step.

The engine is bound to the model it decodes with; its output is a StepBatch with the rollout's columns
(prompt_ids, response_ids, response_mask, rollout_logp, lengths, truncated; row r is sample r % n of
prompt r // n, responses right-padded to the longest).
"""
from typing import Optional, Sequence

import numpy as np
import paddle

from .. import ops
from ..batch import StepBatch, left_pad, rollout_batch
from ..models.decoder import CausalLM, attention_bias_from_mask, position_ids_from_mask
from .keys import uniforms_for
from .sampling import SamplingParams


class RolloutEngine:
    def __init__(self, model: CausalLM, pad_id: int, eos_ids: Sequence[int], max_num_seqs: int = -1):
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = list(eos_ids)
        self.max_num_seqs = max_num_seqs

    def bind(self, model: CausalLM) -> "RolloutEngine":
        """The same settings, decoding with another model (a resharded rollout copy)."""
        return RolloutEngine(model, self.pad_id, self.eos_ids, self.max_num_seqs)

    @paddle.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams,
                 keys: Optional[Sequence] = None) -> StepBatch:
        """`keys[i * n + j]` seeds sample j of prompt i (required unless greedy)."""
        if not params.greedy and keys is None:
            raise ValueError("sampling needs one key per sample")
        per_chunk = len(prompts) if self.max_num_seqs <= 0 else max(1, self.max_num_seqs // n)
        parts = []
        for start in range(0, len(prompts), per_chunk):
            chunk = prompts[start:start + per_chunk]
            chunk_keys = None if keys is None else keys[start * n:(start + len(chunk)) * n]
            parts.append(self._generate_chunk(chunk, n, params, chunk_keys))
        return StepBatch.concat(parts)

    def _generate_chunk(self, prompts, n, params: SamplingParams, keys) -> StepBatch:
        model = self.model
        was_training = model.training
        model.eval()
        stop_ids = sorted(set(params.stop_token_ids) | set(self.eos_ids))
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        cache = model.new_cache(width + params.max_dec_len)
        ids_t, mask_t = paddle.to_tensor(ids), paddle.to_tensor(mask)
        hidden = model.hidden_states(ids_t, position_ids_from_mask(mask_t),
                                     attention_bias_from_mask(mask_t, width, causal=True), cache)
        logits = model.logits(hidden[:, -1])
        if n > 1:
            for layer in cache:
                layer.repeat_interleave(n)
            logits = paddle.repeat_interleave(logits, n, axis=0)
            mask = np.repeat(mask, n, axis=0)
        batch = logits.shape[0]
        rows_prompts = [list(p) for p in prompts for _ in range(n)]
        prompt_lens = mask.sum(1).astype(np.int64)
        next_pos = paddle.to_tensor(prompt_lens.reshape(-1, 1))
        start = paddle.to_tensor(width - prompt_lens)          # first cache slot of each row's prompt
        uniforms = None
        if not params.greedy:
            uniforms = paddle.to_tensor(np.ascontiguousarray(uniforms_for(keys, params.max_dec_len).T))
        seen = None
        if params.repetition_penalty != 1.0:
            seen_np = np.zeros((batch, logits.shape[-1]), dtype=np.float32)
            for r, p in enumerate(rows_prompts):
                seen_np[r, p] = 1.0
            seen = paddle.to_tensor(seen_np)
        stop_t = paddle.to_tensor(np.asarray(stop_ids, dtype=np.int64).reshape([-1]))
        finished = paddle.zeros([batch], dtype="bool")
        lengths = paddle.zeros([batch], dtype="int64")
        ban = paddle.full([batch], True, dtype="bool") if params.min_dec_len > 0 else None
        tokens_out, logp_out = [], []
        for t in range(params.max_dec_len):
            tokens, logp = ops.sample(logits, None if uniforms is None else uniforms[t], seen, ban, stop_t,
                                      params.temperature, params.top_k, params.top_p, params.repetition_penalty)
            state = ops.step_update(tokens, logp, finished, lengths, stop_t, seen, self.pad_id, params.min_dec_len)
            tokens_out.append(state.tokens)
            logp_out.append(state.logprob)
            finished, lengths, seen = state.finished, state.lengths, state.seen
            ban = state.ban if params.min_dec_len > 0 else None
            if t + 1 == params.max_dec_len or bool(state.done):
                break
            logits = model.decode_step(state.tokens, next_pos, cache, start)
            next_pos = next_pos + 1
        if was_training:
            model.train()
        response = paddle.stack(tokens_out, axis=1).numpy()
        lengths_np = lengths.numpy().astype(np.int64)
        alive = (np.arange(response.shape[1])[None, :] < lengths_np[:, None]).astype(np.float32)
        logprobs = paddle.stack(logp_out, axis=1).numpy() * alive
        truncated = ~finished.numpy().astype(bool)
        return rollout_batch(rows_prompts, response, alive, logprobs.astype(np.float32), lengths_np, truncated,
                             self.pad_id)

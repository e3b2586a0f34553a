"""The rollout batch the update consumes: prompt + response token layout and per-sample arrays."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import paddle

from ..rollout.engine import RolloutOutput, concat_outputs, left_pad


@dataclass
class RolloutBatch:
    prompt_ids: np.ndarray        # [B, P] left-padded
    prompt_mask: np.ndarray       # [B, P]
    response_ids: np.ndarray      # [B, T] right-padded
    response_mask: np.ndarray     # [B, T] float32
    group_ids: np.ndarray         # [B] prompt index within the step (same id = same group)
    arrays: Dict[str, np.ndarray] = field(default_factory=dict)  # old_logp, ref_logp, advantages, ...

    @classmethod
    def from_rollout(cls, out: RolloutOutput, group_ids, pad_id: int) -> "RolloutBatch":
        ids, mask = left_pad(out.prompt_ids, pad_id)
        return cls(ids, mask, out.response_ids, out.response_mask.astype(np.float32), np.asarray(group_ids))

    @property
    def size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def prompt_width(self) -> int:
        return self.prompt_ids.shape[1]

    def select(self, index) -> "RolloutBatch":
        index = np.asarray(index)
        return RolloutBatch(self.prompt_ids[index], self.prompt_mask[index], self.response_ids[index],
                            self.response_mask[index], self.group_ids[index],
                            {k: v[index] for k, v in self.arrays.items()})

    def tensors(self, rows=slice(None), keys: Optional[List[str]] = None) -> Dict[str, paddle.Tensor]:
        prompt_ids, prompt_mask = self.prompt_ids[rows], self.prompt_mask[rows]
        response_ids, response_mask = self.response_ids[rows], self.response_mask[rows]
        out = {
            "input_ids": paddle.to_tensor(np.concatenate([prompt_ids, response_ids], axis=1)),
            "attention_mask": paddle.to_tensor(np.concatenate([prompt_mask, response_mask.astype(np.int64)], axis=1)),
            "response_ids": paddle.to_tensor(response_ids),
            "response_mask": paddle.to_tensor(response_mask),
        }
        for key in keys or []:
            out[key] = paddle.to_tensor(self.arrays[key][rows])
        return out

    def shared_prompts(self, rows=slice(None)):
        """(prompt_first [U], prompt_rows [b]) of `rows`: the first row of each distinct group and each row's
        group, as positions within `rows` (see CausalLM.shared_prompt_hidden_states); None when every row
        has its own group."""
        groups = self.group_ids[rows]
        _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        if len(first) == len(groups):
            return None
        return paddle.to_tensor(first.astype(np.int64)), paddle.to_tensor(inverse.reshape(-1).astype(np.int64))


def merge_rollouts(outs: List[RolloutOutput], pad_id: int) -> RolloutOutput:
    return outs[0] if len(outs) == 1 else concat_outputs(outs, pad_id)


def select_rollout(out: RolloutOutput, index) -> RolloutOutput:
    index = np.asarray(index, dtype=np.int64)
    return RolloutOutput([out.prompt_ids[i] for i in index], out.response_ids[index], out.response_mask[index],
                         out.logprobs[index], out.lengths[index], out.truncated[index])


def select_result(result, index):
    from ..rewards import RewardResult
    index = np.asarray(index, dtype=np.int64)
    return RewardResult(result.scores[index], {k: v[index] for k, v in result.per_function.items()},
                        None if result.correct is None else result.correct[index],
                        None if getattr(result, "skipped", None) is None else result.skipped[index])

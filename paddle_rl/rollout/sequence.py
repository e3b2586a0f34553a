"""One sample of a rollout as a record every stage of the engine reads and extends, and the scheduler that
admits prompt groups into the running batch.

A `Sequence` is sample `sample` of prompt `group`: its prompt, its random stream (keys.py) and, once decoding,
its tokens and log-probs. The `Scheduler` keeps the waiting prompt groups (a prompt and its `n` samples are
admitted together: the prompt is prefilled once and fanned out) and admits them while the running batch stays
within `max_num_seqs` rows and `max_cache_tokens` KV slots (rows x the widest window a row can need: its
prompt plus `max_dec_len`).
"""
from collections import deque
from typing import List, Optional

import numpy as np

from ..batch import StepBatch, rollout_batch


class Sequence:
    __slots__ = ("row", "group", "sample", "prompt", "uniforms", "tokens", "logprobs", "stopped",
                 "joined_at", "decode_steps", "policy", "forced", "turn_start", "versions", "greedy")

    def __init__(self, row: int, group: int, sample: int, prompt: List[int], uniforms: Optional[np.ndarray]):
        self.row = row                 # its row in the rollout's output (group * n + sample)
        self.group = group
        self.sample = sample
        self.prompt = prompt
        self.uniforms = uniforms       # [max_dec_len] float32 of its key, None when greedy
        self.tokens: List[int] = []
        self.logprobs: List[float] = []
        self.stopped = False           # ended with a stop token (else truncated at max_dec_len)
        self.joined_at = 0             # the engine's decode-step counter when it joined the running batch
        self.decode_steps = 0          # decode steps that processed this row
        self.policy: List[float] = []  # per token: 1 sampled by the policy, 0 fed in (an environment's observation)
        self.forced = deque()          # tokens still to feed in, one per decode step (the KV cache keeps them)
        self.turn_start = 0            # index in `tokens` where the current turn began
        self.versions: List[int] = []  # per token: the policy version that produced it (partial rollouts)
        self.greedy: List[int] = []    # per token: the argmax of the rollout's logits there (-1: fed in)

    def append(self, token: int, logprob: float, policy: bool, greedy: int = -1) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob if policy else 0.0)
        self.policy.append(1.0 if policy else 0.0)
        self.greedy.append(greedy if policy else -1)

    @property
    def truncated(self) -> bool:
        return not self.stopped


def append_samples(seqs: List[Sequence], tokens: List[int], logprobs: List[float], greedy: List[int],
                   stopped: List[bool], version: int) -> None:
    """One decode step's samples, one per sequence: what `Sequence.append(..., policy=True)` records, the
    policy's version and whether the token stopped the sequence (a loop without a call per row)."""
    for seq, token, logprob, best, stop in zip(seqs, tokens, logprobs, greedy, stopped):
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.policy.append(1.0)
        seq.greedy.append(best)
        seq.versions.append(version)
        seq.stopped = stop


class Scheduler:
    def __init__(self, groups: List[List[Sequence]], max_num_seqs: int, max_cache_tokens: int, max_dec_len: int):
        self.waiting = deque(groups)
        self.max_num_seqs = max_num_seqs
        self.max_cache_tokens = max_cache_tokens
        self.max_dec_len = max_dec_len
        for group in groups:
            self._check_fits(group)

    def _slots(self, group: List[Sequence]) -> int:
        return len(group) * (len(group[0].prompt) + self.max_dec_len)

    def _check_fits(self, group: List[Sequence]) -> None:
        if 0 < self.max_num_seqs < len(group):
            raise ValueError(f"rollout_max_num_seqs ({self.max_num_seqs}) is smaller than rollout_n "
                             f"({len(group)}): the samples of one prompt are decoded together")
        if 0 < self.max_cache_tokens < self._slots(group):
            raise ValueError(f"rollout_kv_cache_tokens ({self.max_cache_tokens}) cannot hold one prompt's samples: "
                             f"{len(group)} x (prompt {len(group[0].prompt)} + max_dec_len {self.max_dec_len}) = "
                             f"{self._slots(group)} slots")

    def admit(self, running: List[Sequence]) -> List[List[Sequence]]:
        """The waiting groups that join now (in order: a group never overtakes an earlier one)."""
        if not self.waiting:   # (asked every decode step: the running rows are read only when a group waits)
            return []
        rows = len(running)
        widest = max((len(s.prompt) for s in running), default=0)
        out = []
        while self.waiting:
            group = self.waiting[0]
            widest_after = max(widest, len(group[0].prompt))
            if 0 < self.max_num_seqs < rows + len(group):
                break
            if 0 < self.max_cache_tokens < (rows + len(group)) * (widest_after + self.max_dec_len):
                break
            out.append(self.waiting.popleft())
            rows, widest = rows + len(group), widest_after
        return out

    @property
    def done(self) -> bool:
        return not self.waiting


def sequences_batch(done: List[Sequence], rows: int, pad_id: int, token_versions: bool = False) -> StepBatch:
    """The rollout's StepBatch of finished sequences (one per output row): their tokens, log-probs (0 where fed
    in), `response_mask` from `policy` (a fed-in token is out of the loss), lengths, truncation, group and sample,
    decode steps and, with `token_versions`, each token's policy version. The engine's output, and an agent
    program's recorded episodes (rollout/agents.py)."""
    done = sorted(done, key=lambda s: s.row)
    assert len(done) == rows and all(s.row == r for r, s in enumerate(done))
    width = max(1, max(len(s.tokens) for s in done))
    response = np.full((rows, width), pad_id, dtype=np.int64)
    logprobs = np.zeros((rows, width), dtype=np.float32)
    lengths = np.array([len(s.tokens) for s in done], dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.float32)
    greedy = np.full((rows, width), -1, dtype=np.int64)
    for r, s in enumerate(done):
        response[r, :len(s.tokens)] = s.tokens
        logprobs[r, :len(s.tokens)] = s.logprobs
        greedy[r, :len(s.tokens)] = s.greedy
        mask[r, :len(s.tokens)] = s.policy  # observation tokens are out of the loss mask
    out = rollout_batch([s.prompt for s in done], response, mask, logprobs, lengths,
                        np.array([s.truncated for s in done]), pad_id, [s.group for s in done],
                        [s.sample for s in done])
    out["decode_steps"] = np.array([s.decode_steps for s in done], dtype=np.int64)
    out["rollout_greedy"] = greedy
    if token_versions:
        versions = np.full((rows, width), -1, dtype=np.int64)
        for r, s in enumerate(done):
            versions[r, :len(s.versions)] = s.versions
        out["token_version"] = versions
    return out

"""`EngineSettings`: what a rollout engine decodes with besides its model, as one record (no Paddle: the
asynchronous worker's parent sends it before the worker imports Paddle)."""
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class EngineSettings:
    """What an engine decodes with besides its model: one record that the trainer, evaluation, the asynchronous
    worker (sent as a dict) and `bind` share."""
    pad_id: int
    eos_ids: Tuple[int, ...]
    max_num_seqs: int = -1          # rollout_max_num_seqs, per_device_rollout_batch_size (RolloutArgs.decode_rows)
    max_cache_tokens: int = -1      # rollout_kv_cache_tokens
    kv_cache_dtype: Optional[str] = None
    rollout_dtype: str = "float32"
    quant_type: str = ""            # rollout_quant_type

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))

    @classmethod
    def from_config(cls, config, pad_id: int, eos_ids) -> "EngineSettings":
        return cls(pad_id, tuple(eos_ids), config.decode_rows, config.rollout_kv_cache_tokens,
                   config.kv_cache_paddle_dtype, config.rollout_dtype, config.rollout_quant_type)

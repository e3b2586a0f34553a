"""Decoder hyper-parameters read from (and written to) a Hugging Face config.json."""
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .family import family_of


@dataclass
class ModelConfig:
    model_type: str = "qwen2"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: Optional[bool] = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[object] = None
    pad_token_id: Optional[int] = None
    rope_scaling: Optional[dict] = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        family = family_of(self.model_type)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = family.attention_bias
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {self.rope_scaling} is not supported")

    @property
    def family(self):
        return family_of(self.model_type)

    @property
    def uses_qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def eos_token_ids(self) -> list:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
        rope = data.get("rope_parameters")
        if isinstance(rope, dict):  # transformers 5 writes the rotary settings here, not at the top level
            if "rope_theta" in rope:
                if "rope_theta" in data and float(data["rope_theta"]) != float(rope["rope_theta"]):
                    raise ValueError(f"rope_theta {data['rope_theta']} contradicts rope_parameters {rope}")
                kwargs["rope_theta"] = float(rope["rope_theta"])
            if rope.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = rope
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, folder: str) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model config not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_dict(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON: {e}") from None

    def to_hf_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        data.update(self.extra)
        data["architectures"] = [self.family.architecture]
        for key, value in self.family.extra_config:
            data.setdefault(key, value)
        data.setdefault("torch_dtype", "float32")
        return data

    def save(self, folder: str) -> None:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)

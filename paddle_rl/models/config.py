"""Decoder hyper-parameters read from (and written to) a Hugging Face config.json."""
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .family import family_of

ROPE_TYPES = ("default", "linear", "llama3")  # rotary scalings the decoder implements (decoder.RotaryEmbedding)


def rope_settings(rope, key: str, max_position_embeddings: int) -> Optional[dict]:
    """The rotary scaling a config.json dict asks for, normalized for the decoder: None for the plain rotary
    embedding, else {"rope_type": "linear" | "llama3", "factor", ...}. `key` (rope_parameters or rope_scaling) is
    where the dict came from; a rope type or setting the decoder does not implement is a ValueError naming it."""
    if not rope:
        return None
    if not isinstance(rope, dict):
        raise ValueError(f"{key} must be a mapping, got {rope!r}")
    type_key = "type" if "rope_type" not in rope and "type" in rope else "rope_type"  # "type": older configs
    kind = rope.get(type_key, "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{key}.{type_key} {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{key}.partial_rotary_factor {rope['partial_rotary_factor']} is not supported (1.0 only)")
    if kind == "default":
        return None

    def number(name, default=None):
        value = rope.get(name, default)
        if value is None:
            raise ValueError(f"{key}.rope_type {kind!r} needs {key}.{name}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{key}.{name} must be a positive number, got {value!r}")
        return float(value)

    out = {"rope_type": kind, "factor": number("factor")}
    if kind == "llama3":
        out.update(low_freq_factor=number("low_freq_factor"), high_freq_factor=number("high_freq_factor"),
                   original_max_position_embeddings=number("original_max_position_embeddings",
                                                           max_position_embeddings))
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"{key}.high_freq_factor {out['high_freq_factor']} must exceed "
                             f"{key}.low_freq_factor {out['low_freq_factor']}")
    return out


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
        family.check(self)  # the activation and the family's own settings (an unsupported one: error naming it)
        rope_settings(self.rope_scaling, "rope_scaling", self.max_position_embeddings)  # an unsupported one: error

    @property
    def family(self):
        return family_of(self.model_type)

    @property
    def rope(self) -> Optional[dict]:
        """The rotary scaling, normalized (`rope_settings`); None for the plain rotary embedding."""
        return rope_settings(self.rope_scaling, "rope_scaling", self.max_position_embeddings)

    @property
    def sequence_classifier(self) -> bool:
        """A `<Family>ForSequenceClassification` checkpoint (a reward model): a `score` head instead of the LM head."""
        return any(str(a).endswith("ForSequenceClassification") for a in self.extra.get("architectures") or ())

    @property
    def num_labels(self) -> int:
        labels = self.extra.get("id2label")
        return len(labels) if isinstance(labels, dict) and labels else int(self.extra.get("num_labels", 2))

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
        # the weights' dtype on disk (transformers 5: "dtype", older: "torch_dtype") describes the file, not the model:
        # this suite computes in float32 and writes float32, so neither is carried over to a saved config
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known and k not in ("dtype", "torch_dtype")}
        rope = data.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            # per layer type (Gemma 3, transformers 5): the global layers' rope; the sliding layers' base only
            local = rope.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
                                 "supported (default only)")
            if "rope_theta" in local:
                kwargs["extra"]["rope_local_base_freq"] = float(local["rope_theta"])
            rope = rope["full_attention"]
        if isinstance(rope, dict):  # transformers 5 writes the rotary settings here, not at the top level
            if "rope_theta" in rope:
                if "rope_theta" in data and float(data["rope_theta"]) != float(rope["rope_theta"]):
                    raise ValueError(f"rope_theta {data['rope_theta']} contradicts rope_parameters {rope}")
                kwargs["rope_theta"] = float(rope["rope_theta"])
            max_positions = data.get("max_position_embeddings", cls.max_position_embeddings)
            scaling = rope_settings(rope, "rope_parameters", max_positions)
            if scaling is not None:
                # transformers 5 reads a legacy rope_scaling over rope_parameters: both present must agree
                legacy = data.get("rope_scaling")
                if legacy and rope_settings(legacy, "rope_scaling", max_positions) != scaling:
                    raise ValueError(f"rope_scaling {legacy} contradicts rope_parameters {rope}")
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
            except (ValueError, TypeError) as e:  # an unsupported rope type, family, activation ...: name the file
                raise ValueError(f"{path}: {e}") from None

    def to_hf_dict(self, dtype: str = "float32") -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        data.update(self.extra)
        data["architectures"] = (list(self.extra["architectures"]) if self.sequence_classifier
                                 else [self.family.architecture])
        for key, value in self.family.extra_config:
            data.setdefault(key, value)
        data["dtype"] = data["torch_dtype"] = dtype  # what save_model writes (transformers 5 reads "dtype")
        return data

    def save(self, folder: str, dtype: str = "float32") -> None:
        """config.json; `dtype`: the weights' dtype on disk (torch_dtype)."""
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(dtype), f, indent=2, sort_keys=True)

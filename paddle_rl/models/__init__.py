from .config import ModelConfig
from .decoder import CausalLM, LayerCache, attention_bias_from_mask, new_cache, position_ids_from_mask
from .lora import LoraSettings, adapters_off, merged_weights
from .pretrained import checkpoint_state, hf_state, load_model, load_weights, save_model, unfilled
from .tokenizer import Tokenizer

__all__ = ["ModelConfig", "CausalLM", "LayerCache", "new_cache", "attention_bias_from_mask",
           "position_ids_from_mask", "load_model", "load_weights", "unfilled", "hf_state", "checkpoint_state",
           "save_model", "Tokenizer", "LoraSettings", "adapters_off", "merged_weights"]

from .config import ModelConfig
from .decoder import CausalLM, LayerCache, attention_bias_from_mask, new_cache, position_ids_from_mask
from .pretrained import hf_state, load_model, load_weights, save_model
from .tokenizer import Tokenizer

__all__ = ["ModelConfig", "CausalLM", "LayerCache", "new_cache", "attention_bias_from_mask",
           "position_ids_from_mask", "load_model", "load_weights", "hf_state", "save_model", "Tokenizer"]

"""The critic of PPO: the decoder with a scalar head (`layers.ScoreHead`, one label), read at every response
position, where the reward model reads only the last token.

A critic starts from a `*ForSequenceClassification` folder with one label (a reward model: decoder and score head)
or from any decoder folder (the actor's, by default: its decoder and a new value head of zeros, so every value
starts at 0). It is saved as a one-label sequence classifier, so a checkpoint's critic loads back as either.
"""
from typing import Optional

import numpy as np
import paddle

from ..model_files.safetensors_io import load_state
from .config import ModelConfig
from .decoder import CausalLM
from .logprobs import context_head, response_head
from .lora import LoraSettings, add_adapters
from .pretrained import load_model, load_weights, unfilled

SEQUENCE_CLASSIFIER = "ForSequenceClassification"


def critic_config(folder: str) -> ModelConfig:
    """The critic's config of a folder: its own when it is a one-label sequence classifier, else the decoder's as
    a one-label sequence classifier of its family."""
    config = ModelConfig.from_pretrained(folder)
    if config.sequence_classifier:
        if config.num_labels != 1:
            raise ValueError(f"{folder}/config.json has {config.num_labels} labels; a critic has one (num_labels 1)")
        return config
    architecture = config.family.architecture
    base = architecture[:-len("ForCausalLM")] if architecture.endswith("ForCausalLM") else architecture
    config.extra["architectures"] = [base + SEQUENCE_CLASSIFIER]
    config.extra["num_labels"] = 1
    for key in ("id2label", "label2id"):
        config.extra.pop(key, None)
    return config


def load_critic(folder: str, tp_group=None, lora: Optional[LoraSettings] = None, stage=(0, 1)) -> CausalLM:
    """The critic from a folder, as `critic_config` reads it; with `tp_group` its decoder is split over the
    tensor-parallel ranks like the actor's and its value head is replicated (the final hidden state it reads is
    whole on every rank); `stage=(index, count)` keeps one pipeline stage, as the actor's (the value head on the
    last). `lora`: fresh adapters on the frozen decoder (models/lora.py) and the value head trained whole (PEFT's
    `modules_to_save` of a sequence classifier)."""
    config = critic_config(folder)
    if ModelConfig.from_pretrained(folder).sequence_classifier:
        model = load_model(folder, config, tp_group=tp_group, stage=stage)
    else:
        model = unfilled(config, tp_group, stage)
        state = load_state(folder)
        state["score.weight"] = np.zeros([1, config.hidden_size], dtype=np.float32)  # HF orientation [labels, hidden]
        load_weights(model, state)
        model.base_folder = folder
    if lora is not None:
        add_adapters(model, lora)               # freezes every parameter but the adapters
        if model.is_last:
            model.score.weight.stop_gradient = False
    return model


def head_values(model: CausalLM, hidden):
    """The value head on final hidden states [..., hidden] -> [...] (the last pipeline stage's)."""
    return model.score(hidden)[..., 0]


def token_values(model: CausalLM, input_ids, attention_mask, prompt_width: int, length: int, shared_prompts=None):
    """V_t of each response position t [b, length]: the head on the hidden state that predicts response token t
    (the state before the token is chosen), as `models.logprobs.token_logprobs` reads the LM head."""
    return response_head(model, input_ids, attention_mask, prompt_width, length, shared_prompts,
                         lambda hidden, cols: (head_values(model, hidden),), ("float",))[0]


def packed_token_values(model: CausalLM, packing):
    """token_values of a packed micro-batch (packing.Packing): [b, W], 0 where nothing is predicted (under context
    parallelism each rank's head on the positions it holds: logprobs.context_head)."""
    hidden = model.packed_hidden_states(packing, split_context=True)
    if model.context_group is None:
        return packing.place(head_values(model, paddle.gather(hidden[0], packing.select).unsqueeze(0)))
    values, = context_head(model.context_split(packing.tokens), hidden, packing.select.numpy(),
                           lambda h, cols: (head_values(model, h),), ("float",))
    return packing.place(values)

"""Tokenizer from tokenizer.json (the `tokenizers` package) with the chat template of tokenizer_config.json."""
import json
import os
from typing import List, Optional, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, backend: _HFTokenizer, config: dict, generation_config: Optional[dict] = None):
        self.backend = backend
        self.config = config
        self.chat_template = config.get("chat_template")
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.pad_token = _token_text(config.get("pad_token")) or self.eos_token
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id = self.token_to_id(self.pad_token) if self.pad_token else 0
        eos_ids = []
        gen_eos = (generation_config or {}).get("eos_token_id")
        if gen_eos is not None:
            eos_ids.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        if self.eos_token_id is not None:
            eos_ids.append(self.eos_token_id)
        self.eos_token_ids = sorted(set(eos_ids))
        self._template = None

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        backend = _HFTokenizer.from_file(path)
        config = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        template_path = os.path.join(folder, "chat_template.jinja")
        if not config.get("chat_template") and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        generation = {}
        gen_path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                generation = json.load(f)
        return cls(backend, config, generation)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.backend.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=2, ensure_ascii=False, sort_keys=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> List[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> List[str]:
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

"""A neural reward model: a Hugging Face sequence-classification checkpoint (`LlamaForSequenceClassification`,
`Qwen2ForSequenceClassification`, ...: the decoder plus `score.weight`) scoring (prompt, response) pairs.

The text a pair becomes:
- a record with chat messages (ms-swift `messages`, verl `prompt`, a PaddleNLP `src` list): the messages before
  the answer plus an assistant turn holding the response, rendered with the REWARD model's own chat template;
- a record whose prompt is already a string (PaddleNLP `src`, chat-formatted by the data): `src + response` as it
  stands (the PaddleNLP protocol: the model reads it at its last token).
The score is the head's first output at the last token that is not the pad token (as transformers reads it), in
batches of `per_device_reward_batch_size`, right-padded. It runs replicated in every process that scores, and in
the reward server (`paddle-rl reward-server --reward-model PATH`).
"""
from typing import List

import numpy as np

from .base import RewardSample



class NeuralReward:
    def __init__(self, folder: str, batch_size: int = 8, bf16: bool = False, fp32_head: bool = False):
        """`bf16` (the run's `bf16`): the model's products take bfloat16 operands with float32 sums (CausalLM.set_bf16),
        its score head too unless `fp32_head` (use_fp32_compute)."""
        import paddle

        # Paddle and the model code load only when a reward model is configured (reward-server workers run without)
        from ..models import Tokenizer, load_model
        from ..models.config import ModelConfig
        config = ModelConfig.from_pretrained(folder)
        if not config.sequence_classifier:
            raise ValueError(f"reward_model_name_or_path: {folder}/config.json is not a sequence classifier "
                             f"(architectures {config.extra.get('architectures')}; expected *ForSequenceClassification)")
        if config.num_labels != 1:
            raise ValueError(f"reward_model_name_or_path: {folder}/config.json has {config.num_labels} labels; a reward "
                             "model has one (num_labels 1)")
        try:
            self.model = load_model(folder, config)
        except KeyError as e:
            raise ValueError(f"reward_model_name_or_path: {e.args[0]}") from None
        self.model.eval()
        self.model.set_bf16(linears=bf16, head=bf16 and not fp32_head)
        self.tokenizer = Tokenizer.from_pretrained(folder)
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else self.tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError(f"reward_model_name_or_path: {folder} names no pad token (config.json pad_token_id)")
        self.batch_size = max(1, int(batch_size))
        self.source = folder  # how RuleReward names it in errors
        self._paddle = paddle

    def text(self, sample: RewardSample) -> str:
        record = sample.record or {}
        for key in ("messages", "prompt", "src"):
            messages = record.get(key)
            if isinstance(messages, list) and messages and isinstance(messages[0], dict):
                turns = [m for m in messages if m.get("role") != "assistant" or m is not messages[-1]]
                turns = turns + [{"role": "assistant", "content": sample.response}]
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("the reward model's tokenizer has no chat template for chat records")
                return self.tokenizer.apply_chat_template(turns, add_generation_prompt=False)
        return sample.prompt + sample.response

    def scores(self, texts: List[str]) -> np.ndarray:
        paddle = self._paddle
        out = []
        for start in range(0, len(texts), self.batch_size):
            ids = self.tokenizer.encode_batch(texts[start:start + self.batch_size])
            width = max(len(i) for i in ids)
            batch = np.full((len(ids), width), self.pad_id, dtype=np.int64)
            mask = np.zeros_like(batch)
            for r, row in enumerate(ids):
                batch[r, :len(row)], mask[r, :len(row)] = row, 1
            with paddle.no_grad():
                out.append(self.model.sequence_scores(paddle.to_tensor(batch), paddle.to_tensor(mask)).numpy()[:, 0])
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)

    def __call__(self, samples: List[RewardSample]):
        return self.scores([self.text(s) for s in samples]), None

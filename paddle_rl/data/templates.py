"""Prompt templates for converted datasets: system prompts and a Qwen2.5 chat layout.

The built-in `qwen2.5` layout renders exactly what Qwen2.5's own chat template renders for a
system + user conversation, and then opens the assistant turn with "<think>", the convention the
kk and format rewards assume (the response continues an open <think>).
"""
from typing import List, Optional

THINK_PREFIX = "<think>"

THINK_ANSWER_SYSTEM = (
    "You are a helpful assistant. The user asks a question and you solve it. "
    "First think through the reasoning step by step inside <think> </think>, "
    "then give the final answer inside <answer> </answer>, "
    "i.e. <think> reasoning here </think> <answer> answer here </answer>."
)

# What each source asks for inside <answer>, so that its rule reward can read the result.
ANSWER_INSTRUCTIONS = {
    # the code reward runs the last ```python block of the response
    "code": " Inside <answer> </answer>, write the complete Python program in one ```python code block; it "
            "reads its input from stdin and prints its output, unless the question names a function to write.",
    # the gsm8k reward reads the last "#### <number>" of the response
    "gsm8k": " Inside <answer> </answer>, write the final number after \"####\", for example "
             "<answer> #### 42 </answer>.",
    # the math reward reads the text inside <answer> (else the last \boxed{})
    "math": " Inside <answer> </answer>, write only the final result in LaTeX, for example "
            "<answer> \\frac{1}{2} </answer>.",
}

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5's chat template for plain conversations (no tool calls), as a jinja string that a
# tokenizer_config.json can carry.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def system_prompt(task: Optional[str] = None) -> str:
    """The <think>/<answer> system prompt, with the answer instruction of `task` (gsm8k, math) if any."""
    return THINK_ANSWER_SYSTEM + ANSWER_INSTRUCTIONS.get(task or "", "")


def chat_messages(question: str, system: Optional[str]) -> List[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return messages


def render_qwen25(messages: List[dict], add_generation_prompt: bool = True) -> str:
    """What QWEN25_CHAT_TEMPLATE renders, without jinja."""
    parts = []
    if not messages or messages[0]["role"] != "system":
        parts.append(f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n")
    for m in messages:
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)

"""Prompt templates and record layouts for KK puzzles.

Templates:
  qwen2.5    Qwen2.5 chat layout with a system prompt; ends in "<|im_start|>assistant\\n<think>".
  tiny       the same chat layout without a system turn, for small models.
  plain      the puzzle text alone.
  paddlenlp  the record of PaddleNLP's GRPO guide (its ppo-kk data), byte for byte: src and tgt as one-item lists,
             the Qwen2.5 chat layout with the guide's system prompt, each turn's text ending in a newline before
             <|im_end|>, the assistant turn opened with "<think>".
"""

from __future__ import annotations

from .puzzle import Puzzle

SYSTEM_PROMPT = (
    "You are a careful logician solving a Knights and Knaves puzzle. "
    "First work through the puzzle step by step inside <think> </think>, "
    "then give the final answer inside <answer> </answer>. "
    "In the answer, list every inhabitant on a separate line, numbered in the order "
    "they were introduced, in the form \"(1) Name is a knight\" or \"(1) Name is a knave\". "
    "For example: <think> reasoning </think> <answer> (1) Name is a knight\n"
    "(2) Name is a knave </answer>."
)

# The system prompt of PaddleNLP's GRPO guide (llm/alignment/rl/README.md, its ppo-kk records), verbatim (its
# "and<answer>" and double space included).
GUIDE_SYSTEM_PROMPT = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within <think> </think> "
    "and<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
    "</answer>.  Now the user asks you to solve a logical reasoning problem. After thinking, when you finally reach "
    "a conclusion, clearly state the identity of each character within <answer> </answer> tags. i.e., <answer> (1) "
    "Zoey is a knight\n(2) ... </answer>.\n"
)

DATA_SOURCE = "kk"

_QWEN = (
    "<|im_start|>system\n{system}<|im_end|>\n"
    "<|im_start|>user\n{puzzle}<|im_end|>\n"
    "<|im_start|>assistant\n<think>"
)
_TINY = "<|im_start|>user\n{puzzle}<|im_end|>\n<|im_start|>assistant\n<think>"
_GUIDE = (
    "<|im_start|>system\n{system}<|im_end|>\n"
    "<|im_start|>user\n{puzzle}\n<|im_end|>\n"
    "<|im_start|>assistant\n<think>"
)

TEMPLATES: tuple[str, ...] = ("qwen2.5", "tiny", "plain", "paddlenlp")


def render_prompt(puzzle_text: str, template: str = "qwen2.5") -> str:
    """Wrap puzzle text in one of TEMPLATES."""
    if template == "qwen2.5":
        return _QWEN.format(system=SYSTEM_PROMPT, puzzle=puzzle_text)
    if template == "tiny":
        return _TINY.format(puzzle=puzzle_text)
    if template == "plain":
        return puzzle_text
    if template == "paddlenlp":
        return _GUIDE.format(system=GUIDE_SYSTEM_PROMPT, puzzle=puzzle_text)
    raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")


def render_paddlenlp(puzzle: Puzzle, template: str = "qwen2.5", compact: bool = False) -> dict:
    """PaddleNLP record: {"src": templated prompt, "tgt": ground truth}; with the paddlenlp template, the guide's
    layout: {"src": [templated prompt], "tgt": [ground truth]}."""
    src, tgt = render_prompt(puzzle.text(compact=compact), template), puzzle.ground_truth()
    if template == "paddlenlp":
        return {"src": [src], "tgt": [tgt]}
    return {"src": src, "tgt": tgt}


def render_chat(puzzle: Puzzle, compact: bool = False, template: str = "qwen2.5") -> dict:
    """Chat record (ms-swift style): system and user turns, solution, data source (the guide's system prompt with
    the paddlenlp template)."""
    return {
        "messages": [
            {"role": "system", "content": GUIDE_SYSTEM_PROMPT if template == "paddlenlp" else SYSTEM_PROMPT},
            {"role": "user", "content": puzzle.text(compact=compact)},
        ],
        "solution": puzzle.ground_truth(),
        "data_source": DATA_SOURCE,
    }

"""Prompt templates and record layouts for KK puzzles.

Templates:
  qwen2.5  Qwen2.5 chat layout with a system prompt; ends in "<|im_start|>assistant\\n<think>".
  tiny     the same chat layout without a system turn, for small models.
  plain    the puzzle text alone.
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

DATA_SOURCE = "kk"

_QWEN = (
    "<|im_start|>system\n{system}<|im_end|>\n"
    "<|im_start|>user\n{puzzle}<|im_end|>\n"
    "<|im_start|>assistant\n<think>"
)
_TINY = "<|im_start|>user\n{puzzle}<|im_end|>\n<|im_start|>assistant\n<think>"

TEMPLATES: tuple[str, ...] = ("qwen2.5", "tiny", "plain")


def render_prompt(puzzle_text: str, template: str = "qwen2.5") -> str:
    """Wrap puzzle text in one of TEMPLATES."""
    if template == "qwen2.5":
        return _QWEN.format(system=SYSTEM_PROMPT, puzzle=puzzle_text)
    if template == "tiny":
        return _TINY.format(puzzle=puzzle_text)
    if template == "plain":
        return puzzle_text
    raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")


def render_paddlenlp(puzzle: Puzzle, template: str = "qwen2.5", compact: bool = False) -> dict:
    """PaddleNLP record: {"src": templated prompt, "tgt": ground truth}."""
    return {
        "src": render_prompt(puzzle.text(compact=compact), template),
        "tgt": puzzle.ground_truth(),
    }


def render_chat(puzzle: Puzzle, compact: bool = False) -> dict:
    """Chat record (ms-swift style): system and user turns, solution, data source."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": puzzle.text(compact=compact)},
        ],
        "solution": puzzle.ground_truth(),
        "data_source": DATA_SOURCE,
    }

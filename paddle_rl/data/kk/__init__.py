"""Knights-and-Knaves logic puzzles: generation, solving, rendering, datasets."""

from .dataset import (
    PRESETS,
    write_dataset,
    write_preset,
    write_puzzles,
    write_with_test_fraction,
)
from .generate import SamplingStats, generate_puzzles, sample_puzzle
from .logic import And, Iff, Implies, Is, Not, Or, Statement, evaluate, solve
from .names import NAMES
from .puzzle import Puzzle
from .reasoning import deduce, reasoning_text, think_text
from .render import SYSTEM_PROMPT, TEMPLATES, render_chat, render_paddlenlp, render_prompt

__all__ = [
    "And",
    "Iff",
    "Implies",
    "Is",
    "NAMES",
    "Not",
    "Or",
    "PRESETS",
    "Puzzle",
    "SYSTEM_PROMPT",
    "SamplingStats",
    "Statement",
    "TEMPLATES",
    "deduce",
    "evaluate",
    "generate_puzzles",
    "render_chat",
    "render_paddlenlp",
    "reasoning_text",
    "render_prompt",
    "sample_puzzle",
    "solve",
    "think_text",
    "write_dataset",
    "write_preset",
    "write_puzzles",
    "write_with_test_fraction",
]

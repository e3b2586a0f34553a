"""`paddle-rl data kk`: write Knights-and-Knaves puzzle datasets.

Examples:
  paddle-rl data kk --people 2,3,4 --num 500 --seed 1 --out data/kk
  paddle-rl data kk --preset logic-rl --out data/kk_logic_rl
  paddle-rl data kk --preset logic-rl --format paddlenlp --out data/ppo-kk
  paddle-rl data kk --people 2,3 --num 200 --template tiny --compact --test-fraction 0.1 --out data/kk_tiny
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from paddle_rl.data.kk.dataset import (
    PRESETS,
    write_dataset,
    write_preset,
    write_with_test_fraction,
)
from paddle_rl.data.kk.generate import MAX_PEOPLE, MIN_PEOPLE
from paddle_rl.data.kk.render import TEMPLATES

DEFAULT_NUM = 100
DEFAULT_SEED = 42
DEFAULT_OUT = "data/kk"
FORMATS = ("ours", "paddlenlp")


def people_list(text: str) -> tuple[int, ...]:
    """Parse "2,3,4" (spaces allowed) into a tuple of inhabitant counts."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not counts:
        raise argparse.ArgumentTypeError("at least one inhabitant count is needed")
    for count in counts:
        if not MIN_PEOPLE <= count <= MAX_PEOPLE:
            raise argparse.ArgumentTypeError(
                f"inhabitant counts must be between {MIN_PEOPLE} and {MAX_PEOPLE}, got {count}"
            )
    return counts


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--people", type=people_list, default=None,
                        help="comma-separated inhabitant counts, each 2..8 (default 2,3,4)")
    parser.add_argument("--num", type=int, default=None,
                        help=f"puzzles per inhabitant count (default {DEFAULT_NUM}; "
                             "with --preset, the train count per inhabitant count)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="published split layout (logic-rl: train 3..7 people, test 5 people)")
    parser.add_argument("--template", choices=TEMPLATES, default=None,
                        help="prompt template for the src field (default qwen2.5)")
    parser.add_argument("--format", choices=FORMATS, default="ours",
                        help="record layout: ours (src / tgt strings, --template's prompt) or paddlenlp (the "
                             "records of PaddleNLP's GRPO guide byte for byte: one-item src / tgt lists, the guide's "
                             "system prompt in the Qwen2.5 chat layout, the <think> opening)")
    parser.add_argument("--compact", action="store_true",
                        help="short puzzle wording (suits tiny models)")
    parser.add_argument("--split", default="train", help="split name: writes SPLIT.jsonl")
    parser.add_argument("--test-fraction", type=float, default=0.0,
                        help="share of each inhabitant count written to test.jsonl instead")
    parser.add_argument("--max-depth", type=int, default=2,
                        help="deepest statement nesting (2: connectives over atoms)")
    parser.set_defaults(func=run_kk)
    return parser


def add_kk_subparser(subparsers) -> argparse.ArgumentParser:
    """Register `kk` on the sub-parsers of `paddle-rl data`."""
    parser = subparsers.add_parser(
        "kk",
        help="generate Knights-and-Knaves logic puzzles",
        description="Generate Knights-and-Knaves puzzles with unique solutions as jsonl "
                    "(PaddleNLP src/tgt and chat layouts).",
    )
    return configure_parser(parser)


def _opt(args: argparse.Namespace, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def run_kk(args: argparse.Namespace) -> list[str]:
    """Write the files the arguments ask for and return their paths."""
    out = _opt(args, "out", DEFAULT_OUT)
    seed = _opt(args, "seed", DEFAULT_SEED)
    template = _opt(args, "template", None)
    if _opt(args, "format", "ours") == "paddlenlp":
        if template not in (None, "paddlenlp"):
            raise ValueError(f"--format paddlenlp writes the guide's own template; --template {template} "
                             f"contradicts it")
        template = "paddlenlp"
    template = template or "qwen2.5"
    compact = bool(_opt(args, "compact", False))
    max_depth = _opt(args, "max_depth", 2)
    split = _opt(args, "split", "train")
    test_fraction = _opt(args, "test_fraction", 0.0)
    people = getattr(args, "people", None)
    num = getattr(args, "num", None)
    if isinstance(people, str):
        people = people_list(people)
    if num is not None and num < 1:
        raise ValueError(f"--num must be at least 1, got {num}")

    preset = getattr(args, "preset", None)
    if preset:
        if people is not None:
            raise ValueError("--people cannot be combined with --preset (the preset fixes them)")
        if test_fraction:
            raise ValueError("--test-fraction cannot be combined with --preset")
        override = {"train": num} if num is not None else None
        paths = write_preset(out, preset, seed, template, compact, max_depth, override)
    else:
        people = people or (2, 3, 4)
        num = num if num is not None else DEFAULT_NUM
        if test_fraction:
            paths = write_with_test_fraction(out, people, num, seed, test_fraction, template,
                                             compact, split, max_depth)
        else:
            paths = write_dataset(out, people, num, seed, template, compact, split, max_depth)

    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        print(f"wrote {path} ({lines} records)")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser(argparse.ArgumentParser(prog="paddle-rl data kk"))
    args = parser.parse_args(argv)
    try:
        run_kk(args)
    except ValueError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writing KK puzzles to jsonl, deterministically.

Each split NAME produces two files in the output folder:
  NAME.jsonl       PaddleNLP layout, {"src": templated prompt, "tgt": ground truth} (one-item lists of them
                   with the paddlenlp template: the layout of PaddleNLP's guide)
  NAME.chat.jsonl  chat layout, {"messages": [...], "solution": ..., "data_source": "kk"}
Keys keep a fixed order, text is written as UTF-8 with ensure_ascii=False and "\\n"
line ends, so the same arguments always give the same bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from .generate import derive_seed, generate_puzzles
from .puzzle import Puzzle
from .render import render_chat, render_paddlenlp


@dataclass(frozen=True)
class SplitSpec:
    name: str
    people: tuple[int, ...]
    num: int


@dataclass(frozen=True)
class Preset:
    """Named splits. Puzzles of earlier splits are kept out of later ones."""

    name: str
    splits: tuple[SplitSpec, ...]


# Logic-RL's published layout: train on 3..7 people, test on 5 people.
PRESETS: dict[str, Preset] = {
    "logic-rl": Preset(
        "logic-rl",
        (
            SplitSpec("test", (5,), 100),
            SplitSpec("train", (3, 4, 5, 6, 7), 900),
        ),
    ),
}


def split_puzzles(people_counts: Sequence[int], num: int, seed: int, split_name: str,
                  max_depth: int = 2, exclude: Iterable[Puzzle] = ()) -> list[Puzzle]:
    """`num` puzzles per people count, grouped by count in the given order.

    The split name enters the seed, so two splits with the same seed differ;
    puzzles equal to one in `exclude` are skipped.
    """
    banned = {(p.names, p.statements) for p in exclude}
    split_seed = derive_seed("split", seed, split_name)
    puzzles: list[Puzzle] = []
    for people in people_counts:
        want = num
        while True:
            batch = generate_puzzles(people, want, split_seed, max_depth)
            kept = [p for p in batch if (p.names, p.statements) not in banned]
            if len(kept) >= num:
                puzzles.extend(kept[:num])
                break
            want += num - len(kept)
    return puzzles


def write_jsonl(path: str, records: Iterable[dict]) -> str:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False))
            f.write("\n")
    return path


def write_puzzles(out_dir: str, split_name: str, puzzles: Sequence[Puzzle],
                  template: str = "qwen2.5", compact: bool = False) -> list[str]:
    """Write NAME.jsonl and NAME.chat.jsonl; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paddle_path = os.path.join(out_dir, f"{split_name}.jsonl")
    chat_path = os.path.join(out_dir, f"{split_name}.chat.jsonl")
    write_jsonl(paddle_path, (render_paddlenlp(p, template, compact) for p in puzzles))
    write_jsonl(chat_path, (render_chat(p, compact, template) for p in puzzles))
    return [paddle_path, chat_path]


def write_dataset(out_dir: str, people_counts: Sequence[int], num: int, seed: int,
                  template: str = "qwen2.5", compact: bool = False,
                  split_name: str = "train", max_depth: int = 2) -> list[str]:
    """Generate `num` puzzles per people count and write one split."""
    puzzles = split_puzzles(people_counts, num, seed, split_name, max_depth)
    return write_puzzles(out_dir, split_name, puzzles, template, compact)


def write_with_test_fraction(out_dir: str, people_counts: Sequence[int], num: int, seed: int,
                             test_fraction: float, template: str = "qwen2.5",
                             compact: bool = False, split_name: str = "train",
                             max_depth: int = 2) -> list[str]:
    """Generate `num` puzzles per people count; the last round(num * fraction) of
    each count go to test.jsonl, the rest to `split_name`."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test fraction must be in [0, 1), got {test_fraction}")
    if split_name == "test":
        raise ValueError("the split holding the remainder cannot be named 'test'")
    n_test = round(num * test_fraction)
    main: list[Puzzle] = []
    test: list[Puzzle] = []
    for people in people_counts:
        puzzles = split_puzzles([people], num, seed, split_name, max_depth)
        main.extend(puzzles[: num - n_test])
        test.extend(puzzles[num - n_test:])
    paths = write_puzzles(out_dir, split_name, main, template, compact)
    return paths + write_puzzles(out_dir, "test", test, template, compact)


def write_preset(out_dir: str, preset: str, seed: int, template: str = "qwen2.5",
                 compact: bool = False, max_depth: int = 2,
                 num_override: dict[str, int] | None = None) -> list[str]:
    """Write every split of a named preset; `num_override` maps split name to count."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    paths: list[str] = []
    earlier: list[Puzzle] = []
    written: dict[str, list[str]] = {}
    for spec in PRESETS[preset].splits:
        num = (num_override or {}).get(spec.name, spec.num)
        puzzles = split_puzzles(spec.people, num, seed, spec.name, max_depth, exclude=earlier)
        earlier.extend(puzzles)
        written[spec.name] = write_puzzles(out_dir, spec.name, puzzles, template, compact)
    for name in sorted(written, key=lambda n: (n != "train", n)):
        paths.extend(written[name])
    return paths

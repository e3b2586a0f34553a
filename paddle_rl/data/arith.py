"""Multi-operand addition with worked solutions, in the <think>/<answer> layout of the KK data.

"What is 51 + 29 + 60?" is solved as " 51 + 29 = 80. 80 + 60 = 140." inside <think> and "140" inside
<answer>. Records are PaddleNLP's {"src", "tgt"} with "tgt" the sum; the `math` rule reward scores them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Tuple

from ..model_files.hub import resolve_model
from .kk.dataset import write_jsonl

DATA_SOURCE = "arith"


@dataclass(frozen=True)
class AdditionProblem:
    operands: Tuple[int, ...]

    def question(self) -> str:
        return "What is " + " + ".join(map(str, self.operands)) + "?"

    def answer(self) -> str:
        return str(sum(self.operands))

    def worked_steps(self) -> str:
        """Running sums, one "a + b = c." per operand after the first."""
        steps, total = [], self.operands[0]
        for x in self.operands[1:]:
            steps.append(f"{total} + {x} = {total + x}.")
            total += x
        return " ".join(steps)


def generate_problems(count: int, operands: int, low: int, high: int, seed: int) -> List[AdditionProblem]:
    """`count` distinct problems with `operands` integers drawn uniformly from [low, high], in a fixed order
    given the seed."""
    if operands < 2:
        raise ValueError(f"operands must be >= 2, got {operands}")
    if low > high:
        raise ValueError(f"low ({low}) must be <= high ({high})")
    space = (high - low + 1) ** operands
    if count > space:
        raise ValueError(f"{count} distinct problems requested but only {space} exist")
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < count:
        ops = tuple(rng.randint(low, high) for _ in range(operands))
        if ops not in seen:
            seen.add(ops)
            problems.append(AdditionProblem(ops))
    return problems


def chat_records(problems: List[AdditionProblem], tokenizer, instruction: str = "", system: str = "") -> List[dict]:
    """PaddleNLP records whose prompt is the question rendered by the model's own chat template."""
    records = []
    for p in problems:
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": (p.question() + " " + instruction).strip()})
        records.append({"src": tokenizer.apply_chat_template(messages, add_generation_prompt=True), "tgt": p.answer(),
                        "data_source": DATA_SOURCE})
    return records


def add_arith_subparser(subparsers) -> None:
    p = subparsers.add_parser("arith", help="addition problems asked in a model's chat template",
                              description="Disjoint held-out test and train splits of addition problems, rendered "
                                          "with the chat template of --model (test.jsonl, train.jsonl).")
    p.add_argument("--model", required=True, help="model folder (or fetchable name) whose chat template renders prompts")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--operands", type=int, default=2)
    p.add_argument("--low", type=int, default=10)
    p.add_argument("--high", type=int, default=99)
    p.add_argument("--train", type=int, default=2000, help="train problems")
    p.add_argument("--test", type=int, default=200, help="held-out problems (never in train)")
    p.add_argument("--instruction", default="", help="text after the question in the user turn")
    p.add_argument("--system", default="", help="system message (default: the template's own)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_arith_cli)


def _arith_cli(args) -> int:
    import os
    import sys

    # the tokenizer (models/, Paddle) only for writing a tokenized dataset; the generator itself needs neither
    from ..models import Tokenizer
    try:
        tokenizer = Tokenizer.from_pretrained(resolve_model(args.model))
        problems = generate_problems(args.test + args.train, args.operands, args.low, args.high, args.seed)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = chat_records(problems, tokenizer, args.instruction, args.system)
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("test", records[:args.test]), ("train", records[args.test:])):
        write_jsonl(os.path.join(args.out, f"{name}.jsonl"), part)
        print(f"{os.path.join(args.out, name + '.jsonl')}: {len(part)} records")
    return 0

"""Multi-operand addition with worked solutions, in the <think>/<answer> layout of the KK data.

"What is 51 + 29 + 60?" is solved as " 51 + 29 = 80. 80 + 60 = 140." inside <think> and "140" inside
<answer>. Records are PaddleNLP's {"src", "tgt"} with "tgt" the sum; the `math` rule reward scores them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Tuple

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

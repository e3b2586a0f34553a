"""Seeded sampling of puzzles that have exactly one consistent assignment.

A puzzle is drawn by first choosing the names and the hidden roles, then giving
each inhabitant a random statement whose truth value matches that inhabitant's
role (so the chosen roles are always consistent), and keeping the puzzle only if
brute force over all 2**n assignments finds no other consistent one.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .english import SPEECH_VERBS
from .logic import And, Iff, Implies, Is, Not, Or, Statement, consistency_mask, evaluate
from .names import NAMES
from .puzzle import Puzzle

MIN_PEOPLE = 2
MAX_PEOPLE = 8

# Relative weights of the statement kinds. Nested operands lean towards atoms so
# that deeper statements stay readable.
TOP_WEIGHTS = {"atom": 1, "not": 1, "and": 2, "or": 2, "implies": 2, "iff": 1}
NESTED_WEIGHTS = {"atom": 6, "not": 1, "and": 1, "or": 1, "implies": 1, "iff": 1}

MAX_ATTEMPTS_PER_PUZZLE = 100_000


def derive_seed(*parts: object) -> int:
    """A stable 64-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class SamplingStats:
    """How many candidate statement sets were drawn per accepted puzzle."""

    accepted: int = 0
    candidates: int = 0
    duplicates: int = 0

    @property
    def rejection_rate(self) -> float:
        return 1.0 - self.accepted / self.candidates if self.candidates else 0.0


def _atom(rng: random.Random, n: int) -> Is:
    return Is(rng.randrange(n), rng.random() < 0.5)


def _kind(rng: random.Random, weights: dict[str, int]) -> str:
    kinds = list(weights)
    return rng.choices(kinds, weights=[weights[k] for k in kinds])[0]


def sample_statement(rng: random.Random, n: int, max_depth: int, top: bool = True) -> Statement:
    """A random statement about n people, at most `max_depth` levels deep."""
    if max_depth <= 1:
        return _atom(rng, n)
    kind = _kind(rng, TOP_WEIGHTS if top else NESTED_WEIGHTS)
    if kind == "atom":
        return _atom(rng, n)
    if kind == "not":
        operand = sample_statement(rng, n, max_depth - 1, top=False)
        explicit = True if not isinstance(operand, Is) else rng.random() < 0.5
        return Not(operand, explicit)
    left, right = _distinct_operands(rng, n, max_depth - 1)
    if kind == "and":
        return And((left, right))
    if kind == "or":
        return Or((left, right))
    if kind == "implies":
        return Implies(left, right)
    return Iff(left, right)


def _distinct_operands(rng: random.Random, n: int, max_depth: int) -> tuple[Statement, Statement]:
    """Two operands that differ; two atoms must be about different people."""
    while True:
        left = sample_statement(rng, n, max_depth, top=False)
        right = sample_statement(rng, n, max_depth, top=False)
        if left == right:
            continue
        if isinstance(left, Is) and isinstance(right, Is) and left.person == right.person:
            continue
        return left, right


def _statement_for(rng: random.Random, n: int, max_depth: int, speaker: int,
                   solution: tuple[bool, ...]) -> Statement:
    """A statement that is true under `solution` iff the speaker is a knight."""
    while True:
        statement = sample_statement(rng, n, max_depth)
        if evaluate(statement, solution) == solution[speaker]:
            return statement


def sample_puzzle(rng: random.Random, people: int, max_depth: int = 2,
                  stats: SamplingStats | None = None) -> Puzzle:
    """One puzzle with a unique solution."""
    names = tuple(rng.sample(NAMES, people))
    solution = tuple(rng.random() < 0.5 for _ in range(people))
    verbs = tuple(rng.choice(SPEECH_VERBS) for _ in range(people))
    for _ in range(MAX_ATTEMPTS_PER_PUZZLE):
        statements = tuple(
            _statement_for(rng, people, max_depth, speaker, solution) for speaker in range(people)
        )
        if stats is not None:
            stats.candidates += 1
        mask = consistency_mask(statements, people)
        if mask & (mask - 1) == 0:  # only the planted assignment survives
            if stats is not None:
                stats.accepted += 1
            return Puzzle(names, statements, solution, verbs)
    raise RuntimeError(
        f"no puzzle with a unique solution after {MAX_ATTEMPTS_PER_PUZZLE} tries "
        f"({people} people, depth {max_depth})"
    )


def generate_puzzles(people: int, num: int, seed: int, max_depth: int = 2,
                     stats: SamplingStats | None = None) -> list[Puzzle]:
    """`num` distinct puzzles of `people` inhabitants, determined by `seed`.

    The first k puzzles for a seed do not depend on `num`, so a larger request
    extends a smaller one.
    """
    if not MIN_PEOPLE <= people <= MAX_PEOPLE:
        raise ValueError(f"people must be between {MIN_PEOPLE} and {MAX_PEOPLE}, got {people}")
    if num < 0:
        raise ValueError(f"num must be non-negative, got {num}")
    if max_depth < 2:
        # Atoms alone only relate roles pairwise; flipping everyone keeps every such
        # puzzle consistent, so none has a unique solution.
        raise ValueError(f"max_depth must be at least 2, got {max_depth}")
    rng = random.Random(derive_seed("kk", seed, people, max_depth))
    puzzles: list[Puzzle] = []
    seen: set[tuple] = set()
    while len(puzzles) < num:
        puzzle = sample_puzzle(rng, people, max_depth, stats)
        key = (puzzle.names, puzzle.statements)
        if key in seen:
            if stats is not None:
                stats.duplicates += 1
            continue
        seen.add(key)
        puzzles.append(puzzle)
    return puzzles

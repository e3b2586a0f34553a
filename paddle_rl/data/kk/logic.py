"""Statements of a Knights-and-Knaves puzzle and a brute-force solver.

A statement is a small tree over atoms "person i is a knight" / "person i is a
knave". An assignment is a tuple of booleans, True for a knight. A knight's
statement is true and a knave's statement is false, so an assignment is
consistent when every speaker's statement evaluates to that speaker's role.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, Union


@dataclass(frozen=True)
class Is:
    """Person `person` is a knight (knight=True) or a knave (knight=False)."""

    person: int
    knight: bool


@dataclass(frozen=True)
class Not:
    """Negation. `explicit` selects the wording "it is not the case that ..."."""

    operand: "Statement"
    explicit: bool = False


@dataclass(frozen=True)
class And:
    operands: tuple["Statement", ...]


@dataclass(frozen=True)
class Or:
    operands: tuple["Statement", ...]


@dataclass(frozen=True)
class Implies:
    antecedent: "Statement"
    consequent: "Statement"


@dataclass(frozen=True)
class Iff:
    left: "Statement"
    right: "Statement"


Statement = Union[Is, Not, And, Or, Implies, Iff]


def evaluate(statement: Statement, assignment: Sequence[bool]) -> bool:
    """Truth value of `statement` under one assignment."""
    if isinstance(statement, Is):
        return assignment[statement.person] == statement.knight
    if isinstance(statement, Not):
        return not evaluate(statement.operand, assignment)
    if isinstance(statement, And):
        return all(evaluate(s, assignment) for s in statement.operands)
    if isinstance(statement, Or):
        return any(evaluate(s, assignment) for s in statement.operands)
    if isinstance(statement, Implies):
        return (not evaluate(statement.antecedent, assignment)) or evaluate(
            statement.consequent, assignment
        )
    if isinstance(statement, Iff):
        return evaluate(statement.left, assignment) == evaluate(statement.right, assignment)
    raise TypeError(f"not a statement: {statement!r}")


def depth(statement: Statement) -> int:
    """Atoms have depth 1; each connective adds one level."""
    if isinstance(statement, Is):
        return 1
    return 1 + max(depth(child) for child in children(statement))


def children(statement: Statement) -> tuple[Statement, ...]:
    if isinstance(statement, Is):
        return ()
    if isinstance(statement, Not):
        return (statement.operand,)
    if isinstance(statement, (And, Or)):
        return statement.operands
    if isinstance(statement, Implies):
        return (statement.antecedent, statement.consequent)
    if isinstance(statement, Iff):
        return (statement.left, statement.right)
    raise TypeError(f"not a statement: {statement!r}")


# Truth tables as bit masks: bit `a` of a mask is the value under the assignment
# whose bit i says whether person i is a knight. One integer operation then
# evaluates a statement under all 2**n assignments at once.


@lru_cache(maxsize=None)
def _knight_masks(n: int) -> tuple[tuple[int, ...], int]:
    full = (1 << (1 << n)) - 1
    masks = []
    for person in range(n):
        mask = 0
        for a in range(1 << n):
            if a >> person & 1:
                mask |= 1 << a
        masks.append(mask)
    return tuple(masks), full


def truth_mask(statement: Statement, n: int) -> int:
    """Bit mask over all 2**n assignments where `statement` is true."""
    knights, full = _knight_masks(n)
    return _mask(statement, knights, full)


def _mask(statement: Statement, knights: tuple[int, ...], full: int) -> int:
    if isinstance(statement, Is):
        m = knights[statement.person]
        return m if statement.knight else full & ~m
    if isinstance(statement, Not):
        return full & ~_mask(statement.operand, knights, full)
    if isinstance(statement, And):
        m = full
        for s in statement.operands:
            m &= _mask(s, knights, full)
        return m
    if isinstance(statement, Or):
        m = 0
        for s in statement.operands:
            m |= _mask(s, knights, full)
        return m
    if isinstance(statement, Implies):
        a = _mask(statement.antecedent, knights, full)
        return (full & ~a) | _mask(statement.consequent, knights, full)
    if isinstance(statement, Iff):
        x = _mask(statement.left, knights, full) ^ _mask(statement.right, knights, full)
        return full & ~x
    raise TypeError(f"not a statement: {statement!r}")


def consistency_mask(statements: Sequence[Statement], n: int | None = None) -> int:
    """Bit mask of the assignments under which every speaker is consistent.

    Speaker i is the one who makes statements[i].
    """
    n = len(statements) if n is None else n
    knights, full = _knight_masks(n)
    mask = full
    for speaker, statement in enumerate(statements):
        said = _mask(statement, knights, full)
        mask &= full & ~(said ^ knights[speaker])
    return mask


def assignment_of(index: int, n: int) -> tuple[bool, ...]:
    return tuple(bool(index >> person & 1) for person in range(n))


def solve(puzzle_or_statements, n: int | None = None) -> list[tuple[bool, ...]]:
    """All consistent assignments, in increasing order of their bit index.

    Accepts a puzzle (anything with a `statements` attribute) or a sequence of
    statements, statement i being made by person i.
    """
    statements = tuple(getattr(puzzle_or_statements, "statements", puzzle_or_statements))
    n = len(statements) if n is None else n
    if n < len(statements):
        raise ValueError(f"{len(statements)} statements but only {n} people")
    mask = consistency_mask(statements, n)
    return [assignment_of(a, n) for a in range(1 << n) if mask >> a & 1]

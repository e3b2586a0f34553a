"""A short, correct line of reasoning for a puzzle, for supervised warm-start data."""

from __future__ import annotations

from .english import list_names, role
from .logic import evaluate
from .puzzle import Puzzle


def think_text(puzzle: Puzzle) -> str:
    """Propose the solution, check each speaker against it, and state uniqueness.

    Example: "Suppose Zoey is a knight and Oliver is a knave. Then Zoey's statement
    is true and Oliver's is false, matching their roles. No other assignment is
    consistent."
    """
    roles = [f"{name} is a {role(knight)}" for name, knight in zip(puzzle.names, puzzle.solution)]
    checks = []
    for speaker, (name, statement) in enumerate(zip(puzzle.names, puzzle.statements)):
        value = "true" if evaluate(statement, puzzle.solution) else "false"
        checks.append(f"{name}'s statement is {value}" if speaker == 0 else f"{name}'s is {value}")
    return (
        f"Suppose {list_names(roles)}. "
        f"Then {list_names(checks)}, matching their roles. "
        "No other assignment is consistent."
    )

"""The puzzle value: who lives on the island, what each says, and the answer."""

from __future__ import annotations

from dataclasses import dataclass

from .english import compact_text, puzzle_text, role
from .logic import Statement


@dataclass(frozen=True)
class Puzzle:
    """A Knights-and-Knaves puzzle with a unique solution.

    names[i] makes statements[i]; solution[i] is True when names[i] is a knight.
    verbs[i] is the speech verb used for names[i] in the full wording.
    """

    names: tuple[str, ...]
    statements: tuple[Statement, ...]
    solution: tuple[bool, ...]
    verbs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.statements) != n or len(self.solution) != n:
            raise ValueError("names, statements and solution must have the same length")
        if self.verbs and len(self.verbs) != n:
            raise ValueError("verbs must be empty or one per inhabitant")

    @property
    def people(self) -> int:
        return len(self.names)

    def text(self, compact: bool = False) -> str:
        if compact:
            return compact_text(self.names, self.statements)
        return puzzle_text(self.names, self.statements, self.verbs)

    def ground_truth(self) -> str:
        """One line per inhabitant in order: "(1) Zoey is a knight"."""
        return "\n".join(
            f"({i}) {name} is a {role(knight)}"
            for i, (name, knight) in enumerate(zip(self.names, self.solution), start=1)
        )

"""English wording of statements and puzzles.

Atoms read "Zoey is a knight" / "Zoey is a knave"; a negated atom reads
"Zoey is not a knight" (or "it is not the case that Zoey is a knight" when the
negation is explicit). Any operand of a connective that is not a plain or negated
atom is put in parentheses, so the wording is never ambiguous.
"""

from __future__ import annotations

from typing import Sequence

from .logic import And, Iff, Implies, Is, Not, Or, Statement

INTRO = (
    "A very special island is inhabited only by knights and knaves. "
    "Knights always tell the truth, and knaves always lie."
)
QUESTION = "So who is a knight and who is a knave?"
COMPACT_INTRO = "Knights tell the truth, knaves lie."
COMPACT_QUESTION = "Who is a knight and who is a knave?"

SPEECH_VERBS: tuple[str, ...] = (
    "said",
    "says",
    "claims",
    "states",
    "tells you",
    "remarks",
    "asserts",
    "declares",
)


def role(knight: bool) -> str:
    return "knight" if knight else "knave"


def _is_simple(statement: Statement) -> bool:
    return isinstance(statement, Is) or (
        isinstance(statement, Not) and isinstance(statement.operand, Is) and not statement.explicit
    )


def phrase(statement: Statement, names: Sequence[str]) -> str:
    """Lower-case English clause for a statement (names keep their capitals)."""
    if isinstance(statement, Is):
        return f"{names[statement.person]} is a {role(statement.knight)}"
    if isinstance(statement, Not):
        inner = statement.operand
        if isinstance(inner, Is) and not statement.explicit:
            return f"{names[inner.person]} is not a {role(inner.knight)}"
        return f"it is not the case that {_operand(inner, names)}"
    if isinstance(statement, And):
        return _join([_operand(s, names) for s in statement.operands], "and")
    if isinstance(statement, Or):
        return _join([_operand(s, names) for s in statement.operands], "or")
    if isinstance(statement, Implies):
        return (
            f"if {_operand(statement.antecedent, names)} "
            f"then {_operand(statement.consequent, names)}"
        )
    if isinstance(statement, Iff):
        return (
            f"{_operand(statement.left, names)} if and only if "
            f"{_operand(statement.right, names)}"
        )
    raise TypeError(f"not a statement: {statement!r}")


def _operand(statement: Statement, names: Sequence[str]) -> str:
    text = phrase(statement, names)
    return text if _is_simple(statement) else f"({text})"


def _join(parts: list[str], word: str) -> str:
    if len(parts) <= 2:
        return f" {word} ".join(parts)
    return ", ".join(parts[:-1]) + f", {word} " + parts[-1]


def sentence(statement: Statement, names: Sequence[str]) -> str:
    """The statement as a capitalised sentence with a final full stop."""
    text = phrase(statement, names)
    return text[0].upper() + text[1:] + "."


def list_names(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return ", ".join(names[:-1]) + ", and " + names[-1]


def puzzle_text(
    names: Sequence[str],
    statements: Sequence[Statement],
    verbs: Sequence[str],
) -> str:
    """The full story: island, inhabitants, one quoted statement each, question."""
    parts = [INTRO, f"You meet {len(names)} inhabitants: {list_names(names)}."]
    for speaker, statement in enumerate(statements):
        verb = verbs[speaker] if speaker < len(verbs) else SPEECH_VERBS[0]
        parts.append(f'{names[speaker]} {verb}, "{sentence(statement, names)}"')
    parts.append(QUESTION)
    return " ".join(parts)


def compact_text(names: Sequence[str], statements: Sequence[Statement]) -> str:
    """A short form: "Knights tell the truth, knaves lie. Zoey: Oliver is a knave. ..."."""
    parts = [COMPACT_INTRO]
    for speaker, statement in enumerate(statements):
        parts.append(f"{names[speaker]}: {sentence(statement, names)}")
    parts.append(COMPACT_QUESTION)
    return " ".join(parts)

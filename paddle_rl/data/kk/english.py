"""English wording of statements and puzzles.

Atoms read "Zoey is a knight" / "Zoey is a knave"; a negated atom reads
"Zoey is not a knight" (or "it is not the case that Zoey is a knight" when the
negation is explicit). Any operand of a connective that is not a plain or negated
atom is put in parentheses, so the wording is never ambiguous.
"""

from __future__ import annotations

import re
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


# ------------------------------------------------------------------------------------------ reading it back

_ATOM = re.compile(r"([A-Z][a-z]+) is (not )?a (knight|knave)")
_NUMBERED = re.compile(r"\((\d+)\) ([A-Z][a-z]+): ")


def _outside(text: str, token: str) -> list[int]:
    """Offsets of `token` in `text` at parenthesis depth 0."""
    hits, depth = [], 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and text.startswith(token, i):
            hits.append(i)
    return hits


def _cut(text: str, token: str) -> list[str]:
    parts, start = [], 0
    for i in _outside(text, token):
        parts.append(text[start:i])
        start = i + len(token)
    return parts + [text[start:]]


def _enclosed(text: str) -> bool:
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return text.startswith("(") and i == len(text) - 1
    return False


def read_phrase(text: str, names: Sequence[str]) -> Statement:
    """The statement a clause of `phrase` words (the inverse of `phrase`); ValueError naming what it cannot read."""
    text = text.strip()
    if _enclosed(text):
        return read_phrase(text[1:-1], names)
    if _outside(text, " if and only if "):
        left, right = _cut(text, " if and only if ")
        return Iff(read_phrase(left, names), read_phrase(right, names))
    if text[:3].lower() == "if " and _outside(text, " then "):
        parts = _cut(text[3:], " then ")
        if len(parts) == 2:
            return Implies(read_phrase(parts[0], names), read_phrase(parts[1], names))
    for word, node in (("and", And), ("or", Or)):
        if _outside(text, f" {word} "):
            parts = [p[:-1] if p.endswith(",") else p for p in _cut(text, f" {word} ")]
            parts = [q for p in parts for q in _cut(p, ", ")]
            return node(tuple(read_phrase(p, names) for p in parts))
    if text.lower().startswith("it is not the case that "):
        return Not(read_phrase(text[len("it is not the case that "):], names), explicit=True)
    m = _ATOM.fullmatch(text)
    if not m or m.group(1) not in names:
        raise ValueError(f"cannot read the statement {text!r} (names: {', '.join(names)})")
    atom = Is(list(names).index(m.group(1)), m.group(3) == "knight")
    return Not(atom) if m.group(2) else atom


def read_numbered_puzzle(text: str) -> tuple[list[str], list[Statement]]:
    """(names, statements) of a compact puzzle with numbered speakers ("... (1) Zoey: Oliver is a knave. (2) Oliver:
    ... Who is a knight and who is a knave?"), as the tiny KK data words it; ValueError when it is not one."""
    found = list(_NUMBERED.finditer(text))
    if not found or [int(m.group(1)) for m in found] != list(range(1, len(found) + 1)):
        raise ValueError("no numbered KK speakers ('(1) Name: ...') in the text")
    names = [m.group(2) for m in found]
    statements = []
    for k, m in enumerate(found):
        end = found[k + 1].start() if k + 1 < len(found) else text.find(COMPACT_QUESTION, m.end())
        if end < 0:
            raise ValueError(f"the KK puzzle does not end with {COMPACT_QUESTION!r}")
        claim = text[m.end():end].strip()
        if not claim.endswith("."):
            raise ValueError(f"{names[k]}'s claim does not end with a full stop: {claim!r}")
        statements.append(read_phrase(claim[:-1], names))
    return names, statements

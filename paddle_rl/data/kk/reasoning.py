"""Reasoning for a puzzle, for supervised warm-start data.

`deduce` solves a puzzle the way a person writes it out: it follows what each statement forces, supposes a role
for the first undecided person when nothing is forced, drops a supposition that runs into a contradiction (the
person then has the other role) and stops at the first assignment under which every statement fits. It reads
only the names and statements, never `puzzle.solution`. `reasoning_text` renders those steps compactly:

    Suppose Zoey is a knight. Zoey's claim is true, so Oliver is a knave. Oliver's claim is true: contradiction.
    So Zoey is a knave. Zoey's claim is false, so Oliver is a knight. Oliver's claim is true: fits.

`think_text` is the older form, which states the solution first and then checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Optional

from .english import list_names, role
from .logic import evaluate
from .puzzle import Puzzle


@dataclass(frozen=True)
class Step:
    """One line of reasoning.

    kind "suppose": person `person` is supposed to have role `knight`.
    kind "so": the supposition of the opposite role failed, so `person` has role `knight`.
    kind "forces": speaker `person`'s claim has truth `value`, which decides `forced` ((person, knight) pairs).
    kind "fits" / "contradiction": speaker `person`'s claim is decided, `value`, and agrees (or not) with the
    speaker's role.
    """

    kind: str
    person: int
    knight: Optional[bool] = None
    value: Optional[bool] = None
    forced: tuple[tuple[int, bool], ...] = ()


def _completions(known: dict, n: int):
    unknown = [p for p in range(n) if p not in known]
    for values in product((True, False), repeat=len(unknown)):
        full = dict(known)
        full.update(zip(unknown, values))
        yield tuple(full[p] for p in range(n))


def _propagate(statements, known: dict, used: set, steps: list) -> bool:
    """Apply forced steps until none applies. False on a contradiction (the last step says where)."""
    n = len(statements)
    while True:
        for speaker, statement in enumerate(statements):
            if speaker in used:
                continue
            values = {evaluate(statement, a) for a in _completions(known, n)}
            if len(values) == 1:  # the claim is decided by what is known
                value = values.pop()
                if speaker in known:
                    used.add(speaker)
                    if value != known[speaker]:
                        steps.append(Step("contradiction", speaker, value=value))
                        return False
                    steps.append(Step("fits", speaker, value=value))
                else:  # the claim's truth decides the speaker
                    known[speaker] = value
                    used.add(speaker)
                    steps.append(Step("forces", speaker, value=value, forced=((speaker, value),)))
                break
            if speaker in known:  # a knight's claim is true, a knave's false: what does that leave?
                fits = [a for a in _completions(known, n) if evaluate(statement, a) == known[speaker]]
                forced = tuple((p, fits[0][p]) for p in range(n)
                               if p not in known and all(a[p] == fits[0][p] for a in fits))
                if forced:
                    known.update(forced)
                    if len({evaluate(statement, a) for a in _completions(known, n)}) == 1:
                        used.add(speaker)  # decided now, and true to its speaker by construction
                    steps.append(Step("forces", speaker, value=known[speaker], forced=forced))
                    break
        else:
            return True


def _search(statements, known: dict, used: set, steps: list) -> Optional[dict]:
    if not _propagate(statements, known, used, steps):
        return None
    n = len(statements)
    if len(known) == n:
        return known
    person = min(p for p in range(n) if p not in known)
    trial_known, trial_used = dict(known), set(used)
    trial_known[person] = True
    steps.append(Step("suppose", person, knight=True))
    found = _search(statements, trial_known, trial_used, steps)
    if found is not None:
        return found
    known[person] = False
    steps.append(Step("so", person, knight=False))
    return _search(statements, known, used, steps)


def deduce(puzzle: Puzzle) -> tuple[list[Step], tuple[bool, ...]]:
    """The reasoning steps and the assignment they reach (from the statements alone)."""
    steps: list[Step] = []
    found = _search(tuple(puzzle.statements), {}, set(), steps)
    if found is None:
        raise ValueError("the statements have no consistent assignment")
    return steps, tuple(found[p] for p in range(puzzle.people))


def _truth(value: bool) -> str:
    return "true" if value else "false"


def render_step(step: Step, names) -> str:
    name = names[step.person]
    if step.kind == "suppose":
        return f"Suppose {name} is a {role(step.knight)}."
    if step.kind == "so":
        return f"So {name} is a {role(step.knight)}."
    if step.kind == "forces":
        roles = list_names([f"{names[p]} is a {role(k)}" for p, k in step.forced])
        return f"{name}'s claim is {_truth(step.value)}, so {roles}."
    if step.kind in ("fits", "contradiction"):
        return f"{name}'s claim is {_truth(step.value)}: {'fits' if step.kind == 'fits' else 'contradiction'}."
    raise ValueError(f"unknown step kind {step.kind!r}")


def reasoning_text(puzzle: Puzzle) -> str:
    """The steps of `deduce` as one paragraph; the last role each name gets in it is the answer."""
    steps, _ = deduce(puzzle)
    return " ".join(render_step(step, puzzle.names) for step in steps)


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

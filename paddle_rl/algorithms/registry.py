"""Named registries of the algorithm pieces. Each entry is a pure function plus the options it declares.

An entry's options are the keyword parameters it reads after its positional data (scores, mask, ... or
logp, old_logp, ...). Registration checks the declaration against the function's signature, so an entry
neither swallows unknown options (no **kwargs) nor reads one it did not declare. `Objective` builds each
entry's options once from the config, passing only the declared ones, and checks the configured names
against these registries before any model loads; the registries are the one list of valid names.

Traits are facts about an entry that other settings default from (e.g. `loss_agg_mode` for dr_grpo).
"""
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Tuple


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    options: Tuple[str, ...]
    what: str                                        # "advantage estimator", "policy_loss", ...
    traits: Mapping = field(default_factory=dict)

    def __call__(self, *args, **options):
        """Call the function with declared options only; an undeclared one is a TypeError naming the choices."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            declared = ", ".join(self.options) or "none"
            raise TypeError(f"{self.what} {self.name!r} does not read {', '.join(unknown)} (its options: {declared})")
        return self.fn(*args, **options)

    def bind(self, available: Mapping, per_call: Tuple[str, ...] = ()) -> Dict:
        """The declared options found in `available`. Every declared option must be in `available` or
        `per_call` (the ones the caller fills in on each call); anything else is a wiring error."""
        missing = [k for k in self.options if k not in available and k not in per_call]
        if missing:
            raise TypeError(f"{self.what} {self.name!r} reads {', '.join(missing)}, which nothing provides")
        return {k: available[k] for k in self.options if k in available}


class Registry(dict):
    """name -> Entry. `positional`: how many leading positional parameters every entry takes."""

    def __init__(self, what: str, positional: int):
        super().__init__()
        self.what, self.positional = what, positional

    def register(self, name: str, options: Tuple[str, ...] = (), **traits):
        def wrap(fn):
            _check_signature(fn, self.positional, tuple(options), f"{self.what} {name!r}")
            self[name] = Entry(name, fn, tuple(options), self.what, dict(traits))
            return fn
        return wrap

    def lookup(self, name) -> Entry:
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r} (choose from {self.choices})")
        return self[name]

    @property
    def choices(self) -> str:
        return ", ".join(self)


def _check_signature(fn, positional: int, options: Tuple[str, ...], label: str) -> None:
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        raise TypeError(f"{label}: declare its options instead of taking *args / **kwargs")
    keywords = [p.name for p in params[positional:]]
    if len(params) < positional or sorted(keywords) != sorted(options):
        raise TypeError(f"{label}: declared options ({', '.join(options) or 'none'}) do not match the "
                        f"parameters after its {positional} positional ones ({', '.join(keywords) or 'none'})")
    if any(p.default is p.empty for p in params[positional:]):
        raise TypeError(f"{label}: every option needs a default")

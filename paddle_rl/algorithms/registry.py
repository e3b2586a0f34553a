"""Named registries of the algorithm pieces. Each entry is a pure function plus the options it declares.

An entry's options are the keyword parameters it reads after its positional data (scores, mask, ... or
logp, old_logp, ...). Each is either a configuration key the piece declares here, where it registers
(`config.options.option`: the PaddleNLP key name, type, default, help, checks, the rule for its value when
unset), or one of the registry's inputs, which the caller provides (the step's log-probs, the reduce group, ...).
A key another piece already declared is read by naming its declaration (or its key as a string). Registration
checks the options against the function's signature, so an entry neither swallows unknown options (no
**kwargs) nor reads one it did not declare, and adds its keys to the config's registry of piece options
(`PIECE_OPTIONS`): the loader reads, coerces and checks them from then on. `Objective` binds each entry's keys
once as `{key: value in effect}`; the configured names are checked against these registries before any model
loads; the registries are the one list of valid names.

Traits are facts about an entry that other settings default from (e.g. `loss_agg_mode` for dr_grpo).
"""
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Tuple

from ..config.options import PIECE_OPTIONS, Option


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    options: Tuple[str, ...]                         # every keyword parameter: its keys, then its inputs
    what: str                                        # "advantage estimator", "policy_loss", ...
    traits: Mapping = field(default_factory=dict)
    keys: Tuple[Option, ...] = ()                    # the configuration keys among the options

    @property
    def inputs(self) -> Tuple[str, ...]:
        keys = {o.key for o in self.keys}
        return tuple(k for k in self.options if k not in keys)

    def __call__(self, *args, **options):
        """Call the function with declared options only; an undeclared one is a TypeError naming the choices."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            declared = ", ".join(self.options) or "none"
            raise TypeError(f"{self.what} {self.name!r} does not read {', '.join(unknown)} (its options: {declared})")
        return self.fn(*args, **options)

    def bind(self, config, inputs: Mapping, per_call: Tuple[str, ...] = ()) -> Dict:
        """{key: the value in effect} of each declared key of `config`, and the inputs found in `inputs`. Every
        input must be in `inputs` or `per_call` (the ones the caller fills in on each call); anything else is a
        wiring error."""
        missing = [k for k in self.inputs if k not in inputs and k not in per_call]
        if missing:
            raise TypeError(f"{self.what} {self.name!r} reads {', '.join(missing)}, which nothing provides")
        bound = {o.key: o.value(config) for o in self.keys}
        bound.update({k: inputs[k] for k in self.inputs if k in inputs})
        return bound

    def pick(self, available: Mapping) -> Dict:
        """The declared options found in `available` (a caller passing values of its own)."""
        return {k: available[k] for k in self.options if k in available}


class Registry(dict):
    """name -> Entry. `positional`: how many leading positional parameters every entry takes; `inputs`: the
    options the caller provides (any other option is a configuration key the entry declares)."""

    def __init__(self, what: str, positional: int, inputs: Tuple[str, ...] = ()):
        super().__init__()
        self.what, self.positional, self.inputs = what, positional, tuple(inputs)

    def register(self, name: str, options: Tuple = (), **traits):
        """`options`: `Option`s (keys this entry reads), key names of options declared before, input names."""
        label = f"{self.what} {name!r}"
        keys, names = [], []
        for item in options:
            if isinstance(item, Option):
                keys.append(item)
            elif item not in self.inputs:
                if item not in PIECE_OPTIONS:
                    raise TypeError(f"{label}: option {item!r} is neither declared (config.options.option) nor an "
                                    f"input of the {self.what} ({', '.join(self.inputs) or 'none'})")
                keys.append(PIECE_OPTIONS.get(item))
            names.append(item.key if isinstance(item, Option) else item)

        def wrap(fn):
            _check_signature(fn, self.positional, tuple(names), label)
            if name in self:
                self.remove(name)
            PIECE_OPTIONS.declare_all(keys, (self.what, name))
            self[name] = Entry(name, fn, tuple(names), self.what, dict(traits), tuple(keys))
            return fn
        return wrap

    def remove(self, name: str) -> None:
        """Unregister `name`; the keys no other piece reads leave the config with it."""
        del self[name]
        PIECE_OPTIONS.withdraw((self.what, name))

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

"""Options of registered pieces: configuration keys declared where the piece that reads them is registered.

An advantage estimator, policy loss or aggregation mode of paddle_rl/algorithms (and a built-in reward rule of
paddle_rl/rewards/rules.py, `register_rule(..., options=)`, whose factory reads `config.<key>`) declares each key
it reads with `option(key, type, default, help, ...)` (the keyword arguments of `fields.arg`: aliases, choices, `check`,
`when_unset`) and names it among its options when it registers; its function's parameter has the key's name, so
the Objective passes `{key: Option.value(config)}` and nothing is renamed. Registering adds the option to
`PIECE_OPTIONS` with the piece as a reader; a second piece reading the same key names the same declaration.

The keys of a config are the fields of RLConfig's groups plus this registry, looked up each time the loader reads
a file (never frozen into a class when a module is imported): a piece registered at any time before
`load_config` is read, coerced, checked and dumped like any other key, and `RLConfig` answers `config.<key>` with
the declared default until a file sets it. The config package imports nothing above it, so the algorithm's
pieces register when `paddle_rl.algorithms` (the reward rules: `paddle_rl.rewards`) is imported; every command
that reads a config imports both first, and a key the loader does not know while nothing has registered says so.
The multi-turn environments (paddle_rl/rollout/episodes.py, `register_environment(..., options=)`) declare theirs the
same way; a command reading a config imports them too (the trainer package does).

A user's files may declare options as well: a reward plugin (`reward_plugins`) by registering a rule with
`register_rule(..., options=)`, an environment plugin (`env_plugin: file.py:Class`) by a class attribute
`OPTIONS = (option(...), ...)`. The key naming such files is a plugin key (`PLUGIN_KEYS`: key -> a loader of its
value, registered where those files are loaded): when a config holds keys nobody has declared, the loader imports the
files its plugin keys name, and reads those keys again. A config whose keys are all known imports no plugin file.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .fields import HELP, WHEN_UNSET, arg, declared_errors


@dataclass(frozen=True, eq=False)
class Option:
    """One key a piece reads: its name, type and `fields.arg` declaration (default, help, aliases, checks,
    the rule for its value when unset). `error_when_unread`: a value set (not null) while none of the chosen pieces
    reads the key is an error (the Objective's, once the names are known), for keys whose null means off."""
    key: str
    annotation: Any
    field: dataclasses.Field
    error_when_unread: bool = False

    @property
    def metadata(self):
        return self.field.metadata

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def help(self) -> str:
        return self.metadata.get(HELP, "")

    def value(self, config) -> Any:
        """The value in effect: the config's, or the declared rule's when the key is null."""
        raw = getattr(config, self.key)
        rule = self.metadata.get(WHEN_UNSET)
        return rule(config) if raw is None and rule is not None else raw

    def errors(self, config) -> List[str]:
        """The error lines of the declared checks (run when the config loads)."""
        return declared_errors(self.key, getattr(config, self.key), config, self.metadata)


def option(key: str, annotation: Any, default: Any, help: str = "", error_when_unread: bool = False,
           **declared) -> Option:
    """Declare the key `key` of type `annotation` (float, Optional[float], bool, str, ...); `declared`: the
    keyword arguments of `fields.arg` (aliases, choices, spellings, check, when_unset)."""
    return Option(key, annotation, arg(default, help, **declared), error_when_unread)


class PieceOptions:
    """key -> Option, with the pieces that read each key (`(what, name)`, e.g. ("policy_loss", "ppo"))."""

    def __init__(self):
        self._options: Dict[str, Option] = {}
        self._readers: Dict[str, List[Tuple[str, str]]] = {}
        self.group_keys = frozenset()   # the keys (and aliases) of RLConfig's groups, which no piece may declare

    def declare(self, declared: Option, reader: Tuple[str, str]) -> None:
        key = declared.key
        if key in self.group_keys:
            raise TypeError(f"{reader[0]} {reader[1]!r}: option {key!r} is a key of a config group; a piece declares "
                            "only keys that no group has")
        known = self._options.get(key)
        if known is not None and known is not declared:
            first = self._readers[key][0]
            raise TypeError(f"{reader[0]} {reader[1]!r}: option {key!r} is already declared by {first[0]} "
                            f"{first[1]!r}: read that declaration (the same Option, or its key as a string)")
        self._options[key] = declared
        if reader not in self._readers.setdefault(key, []):
            self._readers[key].append(reader)

    def resolve(self, options, reader: Tuple[str, str]) -> Tuple[Option, ...]:
        """`options` as Options: each an Option, or the key of one declared before; TypeError naming `reader`."""
        declared = []
        for item in options:
            if not isinstance(item, Option) and item not in self:
                raise TypeError(f"{reader[0]} {reader[1]!r}: option {item!r} is not declared (config.options.option)")
            declared.append(item if isinstance(item, Option) else self.get(item))
        return tuple(declared)

    def declare_all(self, declared, reader: Tuple[str, str]) -> None:
        """`reader` reads the Options `declared`, replacing what it declared before; on a TypeError it reads
        nothing."""
        self.withdraw(reader)
        try:
            for item in declared:
                self.declare(item, reader)
        except TypeError:
            self.withdraw(reader)
            raise

    def withdraw(self, reader: Tuple[str, str]) -> None:
        """Forget a piece (its registry entry is gone); keys no other piece reads leave with it."""
        for key in list(self._readers):
            if reader in self._readers[key]:
                self._readers[key].remove(reader)
                if not self._readers[key]:
                    del self._readers[key], self._options[key]

    def readers(self, key: str) -> List[Tuple[str, str]]:
        return list(self._readers.get(key, ()))

    def get(self, key: str) -> Optional[Option]:
        return self._options.get(key)

    def __contains__(self, key) -> bool:
        return key in self._options

    def __iter__(self) -> Iterator[Option]:
        return iter(list(self._options.values()))

    def __len__(self) -> int:
        return len(self._options)


PIECE_OPTIONS = PieceOptions()

# key -> load(value): imports the user's files the key's (coerced) value names, which may declare options; raises
# ValueError naming the file when one cannot be loaded
PLUGIN_KEYS: Dict[str, Callable[[Any], None]] = {}


def declare_plugin_key(key: str, load: Callable[[Any], None]) -> None:
    """`key`'s value names files that may declare options; `load(value)` imports them (once per process)."""
    PLUGIN_KEYS[key] = load

"""Declaring configuration keys: a default, a help text, whether this build acts on the key, its aliases, and for
keys with a fixed set of values their choices and other accepted spellings; a key may also declare its checks and
the rule that gives its value when it is left unset (null).

The loader applies a key's declaration as it reads the key: a value is matched case-insensitively against
`choices` after `spellings` maps other names to a choice (YAML's bare on / off, fp32 for float32, ...), and a
value outside them is an error naming the key, the choices and the value. No check has to rewrite a value later.
Declared `check`s run when the config loads, after the groups' resolvers, each reading the key's value as set
(None when unset) and the whole config, and returning an error line that starts with the key (or None).
`when_unset(config)` is the value in effect of a key left null (`options.Option.value`); the config itself keeps
the null, so a dump shows what the file said.
"""
from dataclasses import field
from typing import Any, Callable, Mapping, Optional

ACTED = "acted"
HELP = "help"
ALIASES = "aliases"
CHOICES = "choices"
SPELLINGS = "spellings"
NULLABLE = "nullable"
CHECKS = "checks"
WHEN_UNSET = "when_unset"

# YAML 1.1 reads a bare on / off / yes / no as a bool; a string key takes them as the choices on / off
ON_OFF = {"true": "on", "false": "off", "yes": "on", "no": "off"}


def arg(default: Any, help: str = "", acted: bool = True, aliases: tuple = (), choices: tuple = (),
        spellings: Optional[Mapping[str, str]] = None, check=(), when_unset: Optional[Callable] = None):
    """A configuration key. `acted=False` marks keys accepted for compatibility that this build ignores. `check`: one
    check or a tuple of them, `(key, value, config) -> error line or None` (`at_least`, `above`, `within`, `one_of`
    below); `when_unset`: `config -> value` in effect when the key is null."""
    meta = {HELP: help, ACTED: acted, ALIASES: tuple(aliases), CHOICES: tuple(choices),
            SPELLINGS: dict(spellings or {}), NULLABLE: default is None,
            CHECKS: tuple(check) if isinstance(check, (tuple, list)) else (check,), WHEN_UNSET: when_unset}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def chosen(key: str, value: Any, metadata: Mapping) -> Any:
    """`value` as one of the key's declared choices (unchanged for keys without choices, and None stays None);
    ValueError naming the key, the choices and the value otherwise."""
    choices = metadata.get(CHOICES, ())
    if not choices or value is None:
        return value
    spelled = str(value).lower()
    spelled = metadata.get(SPELLINGS, {}).get(spelled, spelled)
    if spelled not in choices:
        shown = [repr(c) + " (off)" if c == "" else c for c in choices]
        shown += ["null"] if metadata.get(NULLABLE) else []
        listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        raise ValueError(f"{key}: must be {listed}, got {value!r}")
    return spelled


def declared_errors(key: str, value: Any, config, metadata: Mapping) -> list:
    """The error lines of a key's declared checks."""
    return [line for check in metadata.get(CHECKS, ()) for line in [check(key, value, config)] if line]


# --- checks a key declares (a null value passes: "unset" is checked by the rule that fills it in) -----------------

def at_least(bound):
    return lambda key, value, config: (None if value is None or value >= bound
                                       else f"{key}: must be >= {bound}, got {value}")


def above(bound):
    return lambda key, value, config: (None if value is None or value > bound
                                       else f"{key}: must be > {bound}, got {value}")


def within(low, high):
    return lambda key, value, config: (None if value is None or low <= value <= high
                                       else f"{key}: must be in [{low}, {high}], got {value}")


def one_of(choices):
    return lambda key, value, config: (None if value is None or value in choices
                                       else f"{key}: {value!r} is not one of {', '.join(choices)}")

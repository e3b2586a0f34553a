"""Declaring configuration keys: a default, a help text, whether this build acts on the key, its aliases, and for
keys with a fixed set of values their choices and other accepted spellings.

The loader applies a key's declaration as it reads the key: a value is matched case-insensitively against
`choices` after `spellings` maps other names to a choice (YAML's bare on / off, fp32 for float32, ...), and a
value outside them is an error naming the key, the choices and the value. No check has to rewrite a value later.
"""
from dataclasses import field
from typing import Any, Mapping, Optional

ACTED = "acted"
HELP = "help"
ALIASES = "aliases"
CHOICES = "choices"
SPELLINGS = "spellings"
NULLABLE = "nullable"

# YAML 1.1 reads a bare on / off / yes / no as a bool; a string key takes them as the choices on / off
ON_OFF = {"true": "on", "false": "off", "yes": "on", "no": "off"}


def arg(default: Any, help: str = "", acted: bool = True, aliases: tuple = (), choices: tuple = (),
        spellings: Optional[Mapping[str, str]] = None):
    """A configuration key. `acted=False` marks keys accepted for compatibility that this build ignores."""
    meta = {HELP: help, ACTED: acted, ALIASES: tuple(aliases), CHOICES: tuple(choices),
            SPELLINGS: dict(spellings or {}), NULLABLE: default is None}
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

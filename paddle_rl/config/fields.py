"""Declaring configuration keys: a default, a help text, and whether this build acts on the key."""
from dataclasses import field
from typing import Any

ACTED = "acted"
HELP = "help"
ALIASES = "aliases"


def arg(default: Any, help: str = "", acted: bool = True, aliases: tuple = ()):
    """A configuration key. `acted=False` marks keys accepted for compatibility that this build ignores."""
    meta = {HELP: help, ACTED: acted, ALIASES: tuple(aliases)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)

"""YAML + overrides -> RLConfig, with errors that name the key and suggest the right one.

The keys are RLConfig's fields and the options of registered pieces (options.py), both looked up on each read.
"""
import dataclasses
import difflib
import logging
import os
import re
import typing
from typing import Any, Iterable, Optional

import yaml

from .fields import ACTED, ALIASES, chosen
from .options import PIECE_OPTIONS, PLUGIN_KEYS
from .paddlenlp import paddlenlp_differences
from .spellings import Translation, translate
from .rl_config import RLConfig

logger = logging.getLogger("paddle_rl")


class ConfigError(ValueError):
    """A configuration problem; the message names the key (and the file)."""


def _config_class():
    return RLConfig


def _fields():
    return {f.name: f for f in dataclasses.fields(_config_class())}


def _keys():
    """key -> (type, declaration metadata): the groups' fields, then the options of the pieces registered now."""
    cls = _config_class()
    keys = {f.name: (typing.get_type_hints(cls)[f.name] if isinstance(f.type, str) else f.type, f.metadata)
            for f in dataclasses.fields(cls)}
    keys.update({o.key: (o.annotation, o.metadata) for o in PIECE_OPTIONS})
    return keys


def _aliases(keys):
    return {alias: name for name, (_, metadata) in keys.items() for alias in metadata.get(ALIASES, ())}


def _suggest(key: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(key: str, value: Any, annotation) -> Any:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        annotation = args[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if isinstance(value, bool):  # YAML 1.1 reads an unquoted no / yes (save_strategy: no) as a bool
            return "yes" if value else "no"
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return " ".join(value)  # PaddleNLP files also write amp_custom_*_list as YAML lists
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    if annotation is list or typing.get_origin(annotation) is list:
        if value is None:
            return []
        if isinstance(value, str):
            return [v.strip() for v in value.replace(",", " ").split() if v.strip()]
        if isinstance(value, (list, tuple)):
            return list(value)
        return [value]
    if annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    return value


# a command-line word that is a key=value override (any other word names a config file)
OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*=")


def config_and_overrides(words: Iterable[str]) -> tuple:
    """A command line's words -> ([the words naming config files], [the key=value overrides, in order])."""
    words = list(words)
    return [w for w in words if not OVERRIDE.match(w)], [w for w in words if OVERRIDE.match(w)]


def parse_overrides(items: Iterable[str]) -> dict:
    """`key=value` strings -> dict; values parsed as YAML scalars/lists."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        out[key] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path) or os.path.isdir(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else path
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level")
    return data


def _read(raw: dict, keys: dict, where: str, values: dict, errors: list) -> list:
    """Coerce `raw`'s known keys into `values` (bad values become error lines); the keys nobody declared."""
    aliases = _aliases(keys)
    unknown = []
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in keys:
            unknown.append(key)
            continue
        annotation, metadata = keys[name]
        try:
            values[name] = chosen(key, _coerce(key, value, annotation), metadata)
        except ValueError as e:  # ConfigError or a value outside the key's choices
            errors.append(f"{where}{e}")
    return unknown


def _load_plugin_files(values: dict, where: str, errors: list) -> bool:
    """Import the files the config's plugin keys name (they may declare options); False when it names none."""
    named = [(key, values[key]) for key in PLUGIN_KEYS if values.get(key)]
    for key, value in named:
        try:
            PLUGIN_KEYS[key](value)
        except ValueError as e:   # a file that cannot be loaded (the message names the key or the file)
            errors.append(f"{where}{e}")
    return bool(named)


def read_values(path: Optional[str] = None, overrides: Optional[Iterable[str] | dict] = None):
    """(values by field name, errors): a YAML file's keys plus overrides, aliases resolved, each value coerced to
    its field's type; unknown keys and bad values become error lines (with the closest name). Keys nobody has
    declared send the loader to the plugin files the config names (options.PLUGIN_KEYS), then are read again.
    Keys in ms-swift's, verl's or train.sh's spelling are read as this suite's (spellings.py)."""
    values, errors, _ = read_translated(path, overrides)
    return values, errors


def read_translated(path: Optional[str] = None, overrides: Optional[Iterable[str] | dict] = None):
    """read_values, and the spellings.Translation of the keys given in another framework's spelling."""
    keys = _keys()
    names = set(keys) | set(_aliases(keys))
    # each source in its own spelling, read in order (the file, then the command line): a later source wins
    translation = translate(_read_yaml(path) if path else {}, names)
    translation.errors = [f"{path}: {e}" for e in translation.errors]   # (none without a file)
    if overrides:
        given = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
        later = translate(given, names, base=translation.values)
        translation = Translation({**translation.values, **later.values}, translation.lines + later.lines,
                                  translation.ignored + later.ignored, translation.errors + later.errors)
    raw = translation.values
    where = f"{path}: " if path else ""
    errors, values = list(translation.errors), {}
    unknown = _read(raw, _keys(), where, values, errors)
    if unknown and _load_plugin_files(values, where, errors):
        unknown = _read({key: raw[key] for key in unknown}, _keys(), where, values, errors)
    keys = _keys()
    names = list(keys) + list(_aliases(keys))
    hint = "" if len(PIECE_OPTIONS) else (" (no algorithm piece, reward rule or environment has declared its "
                                         "options yet: import paddle_rl.algorithms, paddle_rl.rewards and "
                                         "paddle_rl.rollout before reading a config)")
    errors += [f"{where}unknown key {key!r}{_suggest(key, names)}{hint}" for key in unknown]
    return values, errors, translation


def load_config(path: Optional[str] = None, overrides: Optional[Iterable[str] | dict] = None, warn_unused: bool = True):
    """Read `path` (YAML) and apply overrides; raise ConfigError listing every bad key or value."""
    cls = _config_class()
    values, errors, translation = read_translated(path, overrides)
    keys = _keys()   # after reading: the plugin files a config names may have declared keys
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    config = config_from_values(values)
    for resolve in cls.RESOLVERS:  # keys whose value, left unset, follows from others
        resolve(config, frozenset(values))
    problems = []
    for check in cls.CHECKS:  # each reads the config and reports; none writes
        check(config, problems)
    if problems:
        raise ConfigError("invalid configuration" + (f" in {path}" if path else "") + ":\n  " + "\n  ".join(problems))
    # a config in another framework's spelling gets that framework's differences named instead of PaddleNLP's
    config.paddlenlp_differences = [] if translation.lines else paddlenlp_differences(config, values)
    config.translations, config.untranslated = translation.lines, translation.ignored
    if translation.lines:
        logger.info("read in this suite's keys: %s", "; ".join(translation.lines))
    if translation.ignored:
        logger.warning("no equivalent here: %s", "; ".join(translation.ignored))
    if warn_unused:
        ignored = sorted(k for k in values if not keys[k][1].get(ACTED, True))
        if ignored:
            logger.warning("accepted but not acted on in this build: %s", ", ".join(ignored))
        if config.paddlenlp_differences:
            logger.warning("left out of the config, so this suite's default applies where PaddleNLP's differs: %s",
                           "; ".join(config.paddlenlp_differences))
    config.unacted_keys = sorted(k for k in values if not keys[k][1].get(ACTED, True))
    return config


def config_from_values(values: dict):
    """The config of values `read_values` gave: the groups' fields through the constructor, the options of
    registered pieces as attributes (also where no piece is registered, e.g. a reward-server worker: the values
    were read and checked where they were)."""
    cls = _config_class()
    fields = _fields()
    config = cls(**{k: v for k, v in values.items() if k in fields})
    for key, value in values.items():
        if key not in fields:
            setattr(config, key, value)
    return config


def config_to_dict(config) -> dict:
    """Every key and its value: the groups' fields, then the options of the pieces registered now."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out.update({o.key: getattr(config, o.key) for o in PIECE_OPTIONS})
    return out


def dataset_paths(spec: str):
    return [p.strip() for p in spec.split(",") if p.strip()]

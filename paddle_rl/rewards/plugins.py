"""User reward functions loaded from Python files (`reward_plugins`).

Two signatures are recognised, per function:

- ms-swift: `f(completions: list[str], solution=None, **fields) -> list[float]` called once per batch; every
  field of the dataset records is passed by name as a list aligned with `completions` (plus `prompts`,
  `response_length`, `truncated`). A function without `**kwargs` receives only the names it declares.
  A value of None means "does not apply to this sample".
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float` called once per
  sample (a function whose parameters include `solution_str`). A returned dict gives its "score" (and "acc",
  when present, as the sample's correctness).

A plugin module contributes its public functions (those defined in it, names not starting with "_") and the
entries of a module-level `orms` dict (ms-swift plugin convention; classes are instantiated without arguments).
A rule with config keys of its own is registered by the file itself, `@register_rule(name, needs_config=True,
options=(option(...),))` (rules.py): it is a rule then, not a plugin function, and the loader imports the files of
`reward_plugins` when a config holds keys nobody else declared (config/options.py, plugin keys).
"""
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import threading
from typing import Callable, Dict, List, Optional

import numpy as np

from ..config.options import declare_plugin_key
from .base import RewardSample
from .rules import RULE_REWARDS, SampleError, strip_special_tail

logger = logging.getLogger("paddle_rl")

VERL, SWIFT = "verl", "swift"


class PluginError(ValueError):
    """A plugin could not be loaded or misbehaved; the message names the plugin."""


class PluginFunction:
    """One user reward function, callable like a rule: fn(samples) -> (scores, correct or None)."""

    def __init__(self, name: str, fn: Callable, source: str):
        self.name, self.fn, self.source = name, fn, source
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError) as e:
            raise PluginError(f"reward plugin {self.label}: cannot read its signature: {e}") from None
        self.params = params
        self.var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.style = VERL if "solution_str" in params else SWIFT

    @property
    def label(self) -> str:
        return f"{self.name!r} ({self.source})"

    def __call__(self, samples: List[RewardSample]):
        return self._verl(samples) if self.style == VERL else self._swift(samples)

    # verl: one call per sample
    def _verl(self, samples):
        scores = np.empty(len(samples), dtype=np.float32)
        correct, has_correct = np.zeros(len(samples), dtype=bool), False
        for i, s in enumerate(samples):
            kwargs = {"data_source": s.data_source, "solution_str": strip_special_tail(s.response),
                      "ground_truth": s.ground_truth, "extra_info": s.record.get("extra_info")}
            if not self.var_kw:
                kwargs = {k: v for k, v in kwargs.items() if k in self.params}
            try:
                value = self.fn(**kwargs)
            except Exception as e:  # noqa: BLE001
                raise SampleError(i, f"raised {type(e).__name__}: {e}") from e
            if isinstance(value, dict):
                if "acc" in value:
                    correct[i], has_correct = bool(value["acc"]), True
                if "score" not in value:
                    raise SampleError(i, f"returned a dict without 'score': {sorted(value)}")
                value = value["score"]
            scores[i] = self._number(value, i, allow_none=False)
        return scores, (correct if has_correct else None)

    # ms-swift: one call per batch
    def _swift_kwargs(self, samples):
        fields = {"completions": [strip_special_tail(s.response) for s in samples],
                  "solution": [s.record["solution"] if "solution" in s.record else s.ground_truth for s in samples],
                  "prompts": [s.prompt for s in samples],
                  "response_length": [s.response_length for s in samples],
                  "truncated": [s.truncated for s in samples]}
        keys = []
        for s in samples:
            keys += [k for k in s.record if k not in keys and k not in ("completions", "solution")]
        for key in keys:
            fields[key] = [s.record.get(key) for s in samples]
        if self.var_kw:
            return fields
        missing = [n for n, p in self.params.items() if p.default is inspect.Parameter.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in fields]
        if missing:
            raise PluginError(f"reward plugin {self.label}: needs {missing}, which the records do not have "
                              f"(available: {sorted(fields)})")
        return {k: v for k, v in fields.items() if k in self.params}

    def _swift_call(self, samples):
        values = self.fn(**self._swift_kwargs(samples))
        if isinstance(values, np.ndarray):
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise PluginError(f"reward plugin {self.label}: returned {type(values).__name__}, expected a list of "
                              f"{len(samples)} floats")
        return list(values)

    def _swift(self, samples):
        try:
            values = self._swift_call(samples)
        except PluginError:
            raise
        except Exception as e:  # noqa: BLE001 - find the sample that breaks it
            raise SampleError(self._culprit(samples), f"raised {type(e).__name__}: {e}") from e
        if len(values) != len(samples):
            raise PluginError(f"reward plugin {self.label}: returned {len(values)} scores for {len(samples)} "
                              f"samples (samples 0..{len(samples) - 1} of this call)")
        return np.array([self._number(v, i, allow_none=True) for i, v in enumerate(values)], dtype=np.float32), None

    def _culprit(self, samples) -> int:
        """Index of the first sample on which the function raises when called alone (0 if none does alone)."""
        if len(samples) == 1:
            return 0
        for i, s in enumerate(samples):
            try:
                self._swift_call([s])
            except Exception:  # noqa: BLE001
                return i
        return 0

    def _number(self, value, i, allow_none):
        if value is None and allow_none:
            return np.nan
        if isinstance(value, (str, bytes)):
            raise SampleError(i, f"returned {value!r}, not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise SampleError(i, f"returned {value!r}, not a number") from None
        if math.isnan(number):  # "does not apply" is None (RuleReward refuses infinite scores of every function)
            raise SampleError(i, f"returned {number}")
        return number


def _load_module(spec: str, root: Optional[str] = None):
    path = spec if os.path.isabs(spec) or not root else os.path.join(root, spec)
    if spec.endswith(".py") or os.path.sep in spec or os.path.isfile(path):
        if not os.path.isfile(path):
            raise PluginError(f"reward plugin {spec}: file not found ({os.path.abspath(path)})")
        name = "paddle_rl_reward_plugin_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        folder = os.path.dirname(os.path.abspath(path))
        added = folder not in sys.path
        if added:
            sys.path.insert(0, folder)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            raise PluginError(f"reward plugin {spec}: import failed: {type(e).__name__}: {e}") from e
        finally:
            if added:
                sys.path.remove(folder)
        return module, os.path.abspath(path)
    try:
        return importlib.import_module(spec), spec
    except Exception as e:  # noqa: BLE001
        raise PluginError(f"reward plugin {spec}: import failed: {type(e).__name__}: {e}") from e


def load_plugins(specs: List[str], root: Optional[str] = None) -> Dict[str, PluginFunction]:
    """name -> PluginFunction for every function the plugin files/modules define."""
    found: Dict[str, PluginFunction] = {}
    for spec in specs:
        module, source = _load_module(spec, root)
        candidates = {}
        rules = [rule.fn for rule in RULE_REWARDS.values() if rule is not None and rule.fn is not None
                 and getattr(rule.fn, "__module__", None) == module.__name__]
        for name, obj in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            if any(obj is fn for fn in rules):
                continue   # a rule the file registered (register_rule), not a plugin function
            candidates[name] = obj
        orms = getattr(module, "orms", None)
        if isinstance(orms, dict):
            for name, obj in orms.items():
                if inspect.isclass(obj):
                    try:
                        obj = obj()
                    except Exception as e:  # noqa: BLE001
                        raise PluginError(f"reward plugin {spec}: orms[{name!r}]() failed: {e}") from e
                candidates[name] = obj
        if not candidates and not rules:
            raise PluginError(f"reward plugin {spec}: defines no reward functions")
        for name, obj in candidates.items():
            if name in found:
                raise PluginError(f"reward plugin {spec}: function {name!r} is also defined in {found[name].source}")
            found[name] = PluginFunction(name, obj, source)
    return found


_CACHE: Dict[tuple, Dict[str, PluginFunction]] = {}
_CACHE_LOCK = threading.Lock()


def _cache_key(specs: List[str], root: Optional[str]) -> tuple:
    key = []
    for spec in specs:
        path = spec if os.path.isabs(spec) or not root else os.path.join(root, spec)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                key.append((spec, os.path.abspath(path), hashlib.sha256(f.read()).hexdigest()))
        else:
            key.append((spec, None, None))
    return tuple(key), root


def load_plugins_cached(specs: List[str], root: Optional[str] = None) -> Dict[str, PluginFunction]:
    """load_plugins, once per process for the same files (same contents) and modules.

    `check_reward_config` loads the plugins before any model loads and `build_reward` uses them later: a plugin
    file's module code (which may load a model of its own) runs once. An edited file is loaded again.
    """
    key = _cache_key(list(specs), root)
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = load_plugins(list(specs), root)
        return dict(_CACHE[key])


declare_plugin_key("reward_plugins", lambda specs: load_plugins_cached(list(specs)))

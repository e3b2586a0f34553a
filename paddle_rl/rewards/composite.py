"""Weighted sums of reward functions (rules and plugins), optionally routed by a record's data_source."""
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import RLConfig
from .base import RewardResult, RewardSample
from .check import (MODEL_REWARD, named_functions, overlong_errors, raise_errors, reward_model_errors,
                    unknown_function_errors)
from .plugins import PluginError, PluginFunction, load_plugins_cached
from .rules import RULE_REWARDS, SampleError

logger = logging.getLogger("paddle_rl")


class RewardError(ValueError):
    """A reward function failed; the message names the function (and its plugin file) and the sample."""

    def __init__(self, message: str, function: str = "", index: Optional[int] = None):
        super().__init__(message)
        self.function, self.index = function, index


def _abbrev(indices: Sequence[int]) -> str:
    if len(indices) == 1:
        return f"sample {indices[0]}"
    if list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"samples {indices[0]}..{indices[-1]}"
    shown = ", ".join(map(str, indices[:8]))
    return f"samples {shown}{', ...' if len(indices) > 8 else ''}"


def _weighted(names, weights=None) -> List[Tuple[str, float]]:
    if isinstance(names, dict):
        return [(str(n), float(w)) for n, w in names.items()]
    names = [names] if isinstance(names, str) else list(names)
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"reward_weights: {len(weights)} weights for {len(names)} reward_funcs")
    return [(str(n), float(w)) for n, w in zip(names, weights)]


def _number(value) -> Optional[float]:
    """float(value) for a number (NaN for None: "does not apply"), None for anything else (strings included)."""
    if value is None:
        return float("nan")
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class RuleReward:
    """Weighted sum of named reward functions: built-in rules (RULE_REWARDS) and plugin functions.

    Each sample is scored by `names` (with `weights`), or, when its record's data_source is a key of `routes`,
    by that route's functions (a list of names, weights taken from `names`/`weights` when listed there, else 1;
    or a mapping name -> weight). `correct` comes, per sample, from the first of its functions that defines it.
    """

    def __init__(self, names, weights=None, config=None, plugins: Optional[Dict[str, PluginFunction]] = None,
                 routes: Optional[dict] = None):
        if config is None:
            config = RLConfig()
        plugins = dict(plugins or {})
        self.default = _weighted(names, weights)
        default_weights = dict(self.default)
        self.routes = {}
        for source, spec in (routes or {}).items():
            if isinstance(spec, dict):
                self.routes[str(source)] = _weighted(spec)
            else:
                spec = [spec] if isinstance(spec, str) else list(spec)
                self.routes[str(source)] = [(str(n), default_weights.get(str(n), 1.0)) for n in spec]
        wanted = [n for n, _ in self.default] + [n for r in self.routes.values() for n, _ in r]
        named = named_functions([n for n, _ in self.default], {s: [n for n, _ in r] for s, r in self.routes.items()})
        raise_errors(unknown_function_errors(named, plugins) + overlong_errors(config, named, plugins))
        self.functions, self.sources = {}, {}
        for name in dict.fromkeys(wanted):
            if name in plugins and name in RULE_REWARDS:
                logger.warning("reward plugin %s defines %r, which replaces the built-in rule of that name",
                               plugins[name].source, name)
            if name in plugins:
                self.functions[name] = plugins[name]
                self.sources[name] = plugins[name].source
            else:
                self.functions[name] = RULE_REWARDS[name].make(config)
        self.names = [n for n, _ in self.default]
        self.weights = [w for _, w in self.default]

    def label(self, name: str) -> str:
        source = self.sources.get(name)
        return f"reward plugin {name!r} ({source})" if source else f"reward function {name!r}"

    def _scores(self, name: str, values, global_idx: List[int]) -> np.ndarray:
        """A function's scores for the samples `global_idx` as float32. None (and a rule's NaN) means "does not
        apply"; the wrong number of scores, a string, any other non-number or an infinite score is an error naming
        the function and the first bad sample (a plugin refuses its own NaN: its "does not apply" is None)."""
        try:
            array = np.asarray(values)
        except (TypeError, ValueError):  # ragged nesting
            array = np.asarray([None], dtype=object)
        numbers = array.dtype.kind in "biuf"
        items = array.reshape(-1) if numbers or not isinstance(values, (list, tuple)) else list(values)
        if len(items) != len(global_idx):
            raise RewardError(f"{self.label(name)} returned {len(items)} scores for {len(global_idx)} samples "
                              f"[{_abbrev(global_idx)}]", name)
        if numbers:
            scores = items.astype(np.float32)
        else:  # strings, None, other objects: find the first bad value
            scores = np.empty(len(items), dtype=np.float32)
            for i, value in enumerate(items):
                number = _number(value)
                if number is None:
                    raise RewardError(f"{self.label(name)} returned {value!r} for sample {global_idx[i]}, not a "
                                      "number", name, global_idx[i])
                scores[i] = number
        infinite = np.flatnonzero(np.isinf(scores))
        if infinite.size:
            i = int(infinite[0])
            raise RewardError(f"{self.label(name)} returned {float(scores[i])} for sample {global_idx[i]}: a reward "
                              "must be finite", name, global_idx[i])
        return scores

    def plan(self, sample: RewardSample) -> List[Tuple[str, float]]:
        source = sample.data_source
        return self.routes.get(source, self.default) if source is not None else self.default

    def __call__(self, samples: List[RewardSample], index_base: int = 0) -> RewardResult:
        n = len(samples)
        plans = [self.plan(s) for s in samples]
        order = list(dict.fromkeys(name for plan in plans for name, _ in plan))
        per, corrects, outcomes = {}, {}, {}
        for name in order:
            idx = [i for i in range(n) if any(name == p for p, _ in plans[i])]
            subset = [samples[i] for i in idx]
            global_idx = [index_base + i for i in idx]
            try:
                returned = self.functions[name](subset)
                scores, correct = returned[0], returned[1]
            except SampleError as e:
                where = _abbrev(global_idx) if e.index is None else f"sample {global_idx[e.index]}"
                raise RewardError(f"{self.label(name)} failed on {where}: {e.message}", name,
                                  None if e.index is None else global_idx[e.index]) from e
            except PluginError as e:
                raise RewardError(f"{e} [{_abbrev(global_idx)}]", name) from e
            except Exception as e:  # noqa: BLE001
                raise RewardError(f"{self.label(name)} failed on {_abbrev(global_idx)}: {type(e).__name__}: {e}",
                                  name) from e
            scores = self._scores(name, scores, global_idx)
            for outcome, counts in (returned[2] if len(returned) > 2 else {}).items():  # a rule's own counts
                column = outcomes.setdefault(f"{name}/{outcome}", np.zeros(n, dtype=np.float32))
                column[idx] = np.asarray(counts, dtype=np.float32)
            column = np.full(n, np.nan, dtype=np.float32)
            column[idx] = scores
            per[name] = column
            if correct is not None:
                cmask = np.zeros(n, dtype=bool)
                cvals = np.zeros(n, dtype=bool)
                cmask[idx] = True
                cvals[idx] = np.asarray(correct, dtype=bool).reshape(-1)
                corrects[name] = (cmask, cvals)
        total = np.zeros(n, dtype=np.float32)
        correct_out = np.zeros(n, dtype=bool) if corrects else None
        for i, plan in enumerate(plans):
            values = [(w, per[name][i]) for name, w in plan if not np.isnan(per[name][i])]
            if not values:
                names = [name for name, _ in plan]
                raise RewardError(f"sample {index_base + i}: none of {names} produced a score "
                                  f"(data_source={samples[i].data_source!r})", index=index_base + i)
            total[i] = sum(w * v for w, v in values)
            if correct_out is not None:
                for name, _ in plan:
                    if name in corrects and corrects[name][0][i]:
                        correct_out[i] = corrects[name][1][i]
                        break
        return RewardResult(total, per, correct_out, None, outcomes)


def build_local_reward(config) -> RuleReward:
    """The in-process reward of a config (rules and plugins; ignores use_rm_server). Makes the checks of
    `check_reward_config` (RuleReward does), with the plugins that check loaded."""
    plugins = dict(load_plugins_cached(list(config.reward_plugins)) if config.reward_plugins else {})
    raise_errors(reward_model_errors(config, named_functions(config.reward_funcs, config.reward_routes)))
    if config.reward_model_name_or_path:
        from .reward_model import NeuralReward  # loads Paddle: reward-server workers without a model never do
        plugins[MODEL_REWARD] = NeuralReward(config.reward_model_name_or_path, config.per_device_reward_batch_size,
                                             bf16=bool(getattr(config, "bf16", False)),
                                             fp32_head=bool(getattr(config, "use_fp32_compute", False)))
    return RuleReward(config.reward_funcs, config.reward_weights, config, plugins, config.reward_routes)


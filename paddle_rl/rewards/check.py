"""Checks of a config's reward keys that need the reward registry and the plugins.

The config package validates each key on its own (types, choices, weights per function) and does not import
this package; whether a named reward function exists is checked here, once, when the reward is built
(`build_reward`), and by `check_reward_config(config)`, which the trainer calls before any model loads.
"""
import difflib
from typing import Dict, List, Tuple

from ..config import ConfigError
from ..config.reward_args import MODEL_REWARD
from .client import RewardServerClient
from .plugins import PluginFunction, load_plugins_cached
from .rules import RULE_REWARDS, correctness_rules

OVERLONG_RULE = "soft_overlong"
OVERLONG_KEY = "enable_overlong_reward_buffer"


def named_functions(names, routes=None) -> List[Tuple[str, str]]:
    """(config key, function name) for each reward function named by reward_funcs and reward_routes."""
    names = [names] if isinstance(names, str) else list(names or [])
    out = [("reward_funcs", str(n)) for n in names]
    for source, spec in (routes or {}).items():
        spec = [spec] if isinstance(spec, str) else list(spec)  # a list of names, or a mapping name -> weight
        out += [(f"reward_routes[{str(source)!r}]", str(n)) for n in spec]
    return list(dict.fromkeys(out))


def unknown_function_errors(named: List[Tuple[str, str]], plugins: Dict[str, PluginFunction]) -> List[str]:
    """One message per reward function name that is neither a built-in rule nor a plugin function."""
    available = sorted(set(RULE_REWARDS) | set(plugins))
    errors = []
    for key, name in named:
        if name in RULE_REWARDS or name in plugins:
            continue
        close = difflib.get_close_matches(name, available, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        errors.append(f"{key}: unknown reward function {name!r}{hint}")
    if errors:
        errors.append(f"available: {', '.join(available)}; or define your own in a file of reward_plugins")
    return errors


def raise_errors(errors: List[str]) -> None:
    if errors:
        raise ConfigError("invalid reward configuration:\n  " + "\n  ".join(errors))


def overlong_errors(config, named: List[Tuple[str, str]], plugins: Dict[str, PluginFunction]) -> List[str]:
    """The DAPO soft overlong penalty is applied by the objective (enable_overlong_reward_buffer) or by the
    soft_overlong reward function, never both (it would count twice)."""
    if not getattr(config, OVERLONG_KEY, False) or OVERLONG_RULE in plugins:
        return []
    keys = [key for key, name in named if name == OVERLONG_RULE]
    if not keys:
        return []
    return [f"{keys[0]} names {OVERLONG_RULE!r} and {OVERLONG_KEY} is true: both apply the DAPO soft overlong "
            f"penalty, so it would count twice. Keep one: {OVERLONG_KEY}: true (the objective adds the penalty to "
            f"the summed score; metric score/overlong_penalty_mean) or the {OVERLONG_RULE} reward function (a weighted "
            f"reward; metric reward/{OVERLONG_RULE}_mean)"]


def reward_config_errors(config) -> List[str]:
    """The problems `check_reward_config` raises about, as messages (in process; use_rm_server is not looked at).
    A plugin that fails to load raises PluginError."""
    plugins = load_plugins_cached(list(config.reward_plugins)) if config.reward_plugins else {}
    named = named_functions(config.reward_funcs, config.reward_routes)
    return reward_model_errors(config, named) + unknown_function_errors(
        [(k, n) for k, n in named if n != MODEL_REWARD or not config.reward_model_name_or_path], plugins) + \
        overlong_errors(config, named, plugins) + cosine_errors(config)


def cosine_errors(config) -> List[str]:
    """cosine_accuracy names a rule with the correctness trait (rules.py `register_rule(..., correctness=)`)."""
    choices = correctness_rules()
    if config.cosine_accuracy not in choices:
        return [f"cosine_accuracy: {config.cosine_accuracy!r} is not one of {', '.join(choices)} (the rules that "
                "judge a response right or wrong)"]
    return []


def reward_model_errors(config, named: List[Tuple[str, str]]) -> List[str]:
    """reward_model_name_or_path and the `reward_model` function name go together."""
    used = any(n == MODEL_REWARD for _, n in named)
    path = getattr(config, "reward_model_name_or_path", "")
    if path and not used:
        return [f"reward_model_name_or_path: set, but {MODEL_REWARD!r} is in neither reward_funcs nor reward_routes; "
                f"add it (and its weight to reward_weights) or remove the key (a YAML file or key=value overrides "
                f"add it by themselves)"]
    if used and not path:
        return [f"reward_funcs: {MODEL_REWARD!r} needs reward_model_name_or_path (a *ForSequenceClassification folder)"]
    return []


def check_reward_config(config) -> None:
    """Fail early (before any model loads) on reward keys the config package cannot check by itself.

    In process: loads `reward_plugins` (kept for `build_reward`, so a plugin file runs once per process),
    checks that every name of `reward_funcs` and `reward_routes` is a built-in rule or a plugin function
    (ConfigError naming the key, the name and the closest known name), and that the soft overlong penalty is not
    switched on twice. With `use_rm_server` the server checks its own functions; nothing is loaded here, and a
    server that does not answer at `reward_server` is a ConfigError naming the URL.
    """
    if config.use_rm_server:
        problem = RewardServerClient.from_config(config).unreachable()
        if problem:
            raise ConfigError(f"reward_server: {problem}; start it (paddle-rl reward-server) or set "
                              f"use_rm_server: false")
        return
    raise_errors(reward_config_errors(config))

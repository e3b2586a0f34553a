"""Rewards: rule functions, user plugins and the reward-server client behind one callable.

`build_reward(config)` returns `fn(samples: list[RewardSample]) -> RewardResult`:
- in process (default): the weighted sum of `reward_funcs` (rules and `reward_plugins` functions), routed by a
  record's data_source through `reward_routes`;
- `use_rm_server: true`: a client of the reward server at `reward_server`.
"""
from .base import RewardResult, RewardSample, concat_results
from .check import check_reward_config
from .client import RewardServerClient, RewardServerError
from .composite import RewardError, RuleReward, build_local_reward
from .plugins import PluginError, load_plugins
from .rules import RULE_REWARDS, SampleError, register_rule
from . import code  # noqa: F401  (registers the `code` rule)


def build_reward(config, broadcast_group=None):
    """The reward callable a config asks for.

    `broadcast_group` (optional, a paddle.distributed group) is used only with `use_rm_server`: the group's
    first rank calls the server and broadcasts its result to the other ranks.

    Checks the reward keys first (`check_reward_config`: unknown function names, the soft overlong penalty
    switched on twice); call that alone to fail before loading models.
    """
    if config.use_rm_server:
        return RewardServerClient.from_config(config, broadcast_group=broadcast_group)
    return build_local_reward(config)


__all__ = ["RewardSample", "RewardResult", "RuleReward", "build_reward", "check_reward_config", "build_local_reward",
           "register_rule", "concat_results", "RULE_REWARDS", "RewardServerClient", "RewardServerError", "RewardError",
           "PluginError", "SampleError", "load_plugins"]

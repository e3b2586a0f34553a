"""Which exceptions a command reports as one `error:` line, and which keep their traceback.

One line: the errors raised while a run is being set up (config, data, process grid, plugins, kernels) whose
message names the key, file or package at fault. Everything else, and everything raised once training or
evaluation runs, keeps its traceback: a ValueError or KeyError deep in a step is a bug to locate, not a
message to the user.
"""
from .config import ConfigError
from .data.loader import DatasetError
from .parallel.topology import TopologyError
from .rewards.plugins import PluginError


def setup_error_types() -> tuple:
    # deferred: ops/ loads Paddle, which `paddle-rl --help` and the reward server's parent process do without
    from .ops.build import CustomOpsError
    return ConfigError, DatasetError, TopologyError, PluginError, CustomOpsError, FileNotFoundError

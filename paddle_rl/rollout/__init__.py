from ..batch import left_pad
from .engine import RolloutEngine
from .settings import EngineSettings
from .keys import sample_key, uniforms_for
from .sampling import SamplingParams
from .episodes import ENVIRONMENTS, register_environment
from . import agents  # noqa: F401  (registers env_plugin: agent; episodes.py registers tools)

__all__ = ["ENVIRONMENTS", "register_environment", "EngineSettings", "RolloutEngine", "SamplingParams", "sample_key",
           "uniforms_for", "left_pad"]

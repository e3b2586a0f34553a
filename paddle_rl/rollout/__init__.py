from ..batch import left_pad
from .engine import RolloutEngine
from .settings import EngineSettings
from .keys import sample_key, uniforms_for
from .sampling import SamplingParams

__all__ = ["EngineSettings", "RolloutEngine", "SamplingParams", "sample_key", "uniforms_for", "left_pad"]

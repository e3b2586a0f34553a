from .engine import RolloutEngine, RolloutOutput, left_pad
from .keys import sample_key, uniforms_for
from .sampling import SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "sample_key", "uniforms_for", "left_pad"]

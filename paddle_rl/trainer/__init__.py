from .sft import SFTTrainer
from .trainer import RLTrainer

__all__ = ["RLTrainer", "SFTTrainer"]

from .trainer import RLTrainer

__all__ = ["RLTrainer"]

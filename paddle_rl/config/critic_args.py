from dataclasses import dataclass
from typing import Optional

from .fields import arg

# Keys of the critic (rl_algorithm ppo / advantage_estimator gae), PaddleNLP's names where it has them; a key left
# unset (None) takes the actor's value.
CRITIC_OPTIMIZER_KEYS = ("critic_learning_rate", "critic_weight_decay", "critic_lr_scheduler_type",
                         "critic_warmup_ratio", "critic_min_learning_rate", "critic_max_grad_norm")


@dataclass
class CriticArgs:
    critic_model_name_or_path: str = arg("", "The critic's starting weights (rl_algorithm ppo): empty = the actor's "
                                         "decoder with a new zero value head; a *ForSequenceClassification folder "
                                         "(a reward model) = its decoder and score head; any other decoder folder = "
                                         "its decoder with a new zero value head.")
    critic_learning_rate: Optional[float] = arg(None, "The critic's peak learning rate (default learning_rate).")
    critic_weight_decay: Optional[float] = arg(None, "The critic's AdamW weight decay (default weight_decay).")
    critic_lr_scheduler_type: Optional[str] = arg(None, "The critic's lr schedule (default lr_scheduler_type).")
    critic_warmup_ratio: Optional[float] = arg(None, "The critic's lr warm-up share of its optimizer steps (default "
                                               "warmup_ratio; warmup_steps applies to both when set).")
    critic_min_learning_rate: Optional[float] = arg(None, "The critic's final learning rate of linear / cosine decay "
                                                    "(absolute, as PaddleNLP; default min_lr_ratio of its peak).")
    critic_max_grad_norm: Optional[float] = arg(None, "Clip of the critic's gradient norm (default max_grad_norm; "
                                                "0: off).")
    critic_warmup_steps: int = arg(0, "RL steps at the start that train the critic only (the actor is not updated; "
                                   "verl's trainer.critic_warmup).", aliases=("critic_warmup",))
    min_learning_rate: Optional[float] = arg(None, "PaddleNLP's absolute floor of the actor's linear / cosine decay: "
                                             "sets min_lr_ratio = min_learning_rate / learning_rate.")

    def _resolve_critic(self, given):
        if self.min_learning_rate is not None and "min_lr_ratio" not in given and self.learning_rate > 0:
            self.min_lr_ratio = min(1.0, self.min_learning_rate / self.learning_rate)

    def _validate_critic(self, errors):
        if self.critic_warmup_steps < 0:
            errors.append(f"critic_warmup_steps: must be >= 0, got {self.critic_warmup_steps}")
        for key in ("critic_learning_rate", "critic_weight_decay", "critic_warmup_ratio", "critic_min_learning_rate",
                    "critic_max_grad_norm", "min_learning_rate"):
            value = getattr(self, key)
            if value is not None and value < 0:
                errors.append(f"{key}: must be >= 0, got {value}")
        if self.critic_warmup_ratio is not None and self.critic_warmup_ratio > 1:
            errors.append(f"critic_warmup_ratio: must be <= 1, got {self.critic_warmup_ratio}")
        schedules = ("constant", "constant_with_warmup", "linear", "cosine")
        if self.critic_lr_scheduler_type is not None and self.critic_lr_scheduler_type not in schedules:
            errors.append(f"critic_lr_scheduler_type: {self.critic_lr_scheduler_type!r} is not one of "
                          f"{', '.join(schedules)}")

    def critic_optimizer_settings(self) -> dict:
        """The optimizer keys of the critic (build_optimizer's names), each critic_* key or the actor's value."""
        lr = self.learning_rate if self.critic_learning_rate is None else self.critic_learning_rate
        min_ratio = self.min_lr_ratio
        if self.critic_min_learning_rate is not None:
            min_ratio = min(1.0, self.critic_min_learning_rate / lr) if lr > 0 else 0.0
        pick = lambda own, actor: actor if own is None else own  # noqa: E731
        return {"learning_rate": lr, "min_lr_ratio": min_ratio,
                "weight_decay": pick(self.critic_weight_decay, self.weight_decay),
                "lr_scheduler_type": pick(self.critic_lr_scheduler_type, self.lr_scheduler_type),
                "warmup_ratio": pick(self.critic_warmup_ratio, self.warmup_ratio),
                "max_grad_norm": pick(self.critic_max_grad_norm, self.max_grad_norm)}

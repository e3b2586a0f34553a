"""Pre-flight checks of a run's configuration that need more than the config: models named by a fetchable id
resolved to their folders, each model's config.json read by its family, a LoRA adapter's settings, the data files.
Everything fails here, before any model loads, with the keys named."""
import os

from ..config import ConfigError
from ..config.loader import dataset_paths
from ..models.config import ModelConfig
from ..model_files.hub import resolve_model
from ..models.lora import AdapterError, lora_settings


def check_paths(config, data: bool = True) -> None:
    """Fail before any model loads when a model or data path is missing (`data=False`: the model paths only, for
    a command that reads no data: the rollout server)."""
    problems = []
    for key in ("actor_model_name_or_path", "reference_model_name_or_path", "tokenizer_name_or_path"):
        try:  # a fetchable model's name -> its cached folder (fetched the first time)
            setattr(config, key, resolve_model(getattr(config, key)))
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
    model = config.actor_model_name_or_path
    if not os.path.isdir(model):
        problems.append(f"actor_model_name_or_path: folder not found: {model}")
    elif not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(f"actor_model_name_or_path: {os.path.join(model, 'config.json')} not found")
    else:
        try:  # an unsupported family, rope type or setting: before any model loads
            ModelConfig.from_pretrained(model)
        except ValueError as e:
            problems.append(f"actor_model_name_or_path: {e}")
    tokenizer = config.tokenizer_name_or_path or model
    if os.path.isdir(tokenizer) and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        key = "tokenizer_name_or_path" if config.tokenizer_name_or_path else "actor_model_name_or_path"
        problems.append(f"{key}: {os.path.join(tokenizer, 'tokenizer.json')} not found (a folder written by "
                        "transformers' save_pretrained of a fast tokenizer has it)")
    for key in ("reference_model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(config, key)
        if value and not os.path.isdir(value):
            problems.append(f"{key}: folder not found: {value}")
    if config.lora_path:
        try:
            lora_settings(config)
        except (AdapterError, OSError, KeyError) as e:
            problems.append(f"lora_path: {e}")
    if data and not config.train_datasets:
        problems.append("train_datasets: required")
    for key in ("train_datasets", "eval_datasets") if data else ():
        for p in dataset_paths(getattr(config, key)):
            if not os.path.isfile(p):
                problems.append(f"{key}: file not found: {p}")
    if data and config.do_eval and not config.eval_datasets:
        problems.append("eval_datasets: required when do_eval is true")
    if data and not config.do_train and not (config.do_eval and config.evaluation_strategy != "no"):
        problems.append("do_train: false leaves nothing to run without do_eval: true (and evaluation_strategy "
                        "other than no)")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


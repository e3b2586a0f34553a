"""PaddleNLP's defaults of the keys whose default here differs, for the one line a run prints when its config leaves
such a key out (a PaddleNLP user's file relies on PaddleNLP's defaults; nothing differs silently).

From PaddleNLP's `paddlenlp/trainer/training_args.py` (TrainingArguments) and `paddlenlp/rl/utils/config_utils.py`
(its RL TrainingArguments and DataArgument). Keys whose defaults agree (seed 42, top_p 1.0, repetition_penalty 1.0,
global_batch_size 8, update_iters 1, clip_range_ratio 0.2, clip_range_score 10, max_grad_norm 1.0, weight_decay 0,
warmup_steps 0, save_steps 500, num_train_epochs 1, report_to visualdl, ...) are not listed.
"""
import os

PADDLENLP_DEFAULTS = {
    "rl_algorithm": "ppo",
    "learning_rate": 5e-5,
    "lr_scheduler_type": "linear",
    "rollout_n": 1,
    "max_prompt_len": 4096,
    "max_dec_len": 512,
    "min_dec_len": 1,
    "max_length": 2048,
    "temperature": 1.0,
    "kl_coeff": 0.02,
    "kl_loss_coeff": 0.001,
    "per_device_train_batch_size": 1,
    "logging_steps": 500,
    "eval_steps": "logging_steps",                      # PaddleNLP: eval_steps unset takes logging_steps' value
    "logging_dir": "<output_dir>/runs/<date>_<host>",   # the folder of every dashboard in both
    "release_grads": False,
    "recompute_use_reentrant": True,
}


def _shown(key: str, value, config) -> str:
    if key == "logging_dir" and value is None:
        return os.path.join(config.output_dir, "logs")
    if key == "max_length" and value == -1:
        return "-1 (max_prompt_len + max_dec_len)"
    return str(value)


def paddlenlp_differences(config, given) -> list:
    """"key ours (PaddleNLP: theirs)" for each key left out of the config (not in `given`) whose default here is not
    PaddleNLP's."""
    out = []
    for key, theirs in PADDLENLP_DEFAULTS.items():
        if key in given:
            continue
        ours = getattr(config, key)
        if ours != theirs:
            out.append(f"{key} {_shown(key, ours, config)} (PaddleNLP: {theirs})")
    return out

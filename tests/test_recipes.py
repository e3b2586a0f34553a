"""The recipes in configs/ load, carry the published settings, and name their missing files until the
documented data commands have been run."""
import json
import os

import pytest

from paddle_rl.cli import main as cli_main
from paddle_rl.config import ConfigError, load_config
from paddle_rl.trainer.preflight import check_paths
from paddle_rl.data.kk_cli import main as kk_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
PADDLENLP_GRPO = os.path.join(ROOT, "tests", "fixtures", "paddlenlp_grpo_argument.yaml")

KK_GRPO = os.path.join(CONFIGS, "qwen2.5_7b_kk_grpo.yaml")
KK_RPP = os.path.join(CONFIGS, "qwen2.5_7b_kk_reinforce_pp.yaml")
GSM8K_GRPO = os.path.join(CONFIGS, "qwen2.5_0.5b_gsm8k_grpo.yaml")

# PaddleNLP's published Qwen2.5-7B KK settings shared by both KK recipes
PUBLISHED = {"rollout_n": 8, "learning_rate": 5e-7, "temperature": 0.7, "top_p": 1.0, "max_dec_len": 4096,
             "min_dec_len": 32, "max_prompt_len": 512, "max_length": 4608, "tensor_parallel_degree": 2,
             "max_steps": 3600, "save_steps": 300, "max_grad_norm": 1.0, "weight_decay": 0.01,
             "clip_range_ratio": 0.2, "clip_range_score": 10.0, "lr_scheduler_type": "constant", "seed": 42,
             "prompt_key": "src", "response_key": "tgt", "dataloader_drop_last": True, "eval_steps": 20,
             "per_device_eval_batch_size": 32, "kl_loss_coeff": 0.0, "train_datasets": "data/kk/train.jsonl",
             "eval_datasets": "data/kk/test.jsonl", "reward_funcs": ["kk"]}


def test_kk_grpo_recipe():
    cfg = load_config(KK_GRPO, warn_unused=False)
    for key, value in PUBLISHED.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rl_algorithm == "grpo" and cfg.resolved_estimator == "grpo"
    assert (cfg.global_batch_size, cfg.mini_batch_prompts) == (2, 2)
    assert cfg.sharding == "stage2" and cfg.kl_coeff == 0.0
    assert not cfg.needs_reference_model
    assert cfg.score_normalization == (False, False)
    # the same settings as the PaddleNLP argument file a user already has
    theirs = load_config(PADDLENLP_GRPO, warn_unused=False)
    for key in list(PUBLISHED)[:20] + ["global_batch_size", "mini_batch_prompts", "sharding", "kl_coeff",
                                      "update_iters", "num_train_epochs", "clip_range_ratio_high"]:
        assert getattr(cfg, key) == getattr(theirs, key), key


def test_kk_reinforce_pp_recipe():
    cfg = load_config(KK_RPP, warn_unused=False)
    for key, value in PUBLISHED.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rl_algorithm == "reinforce_plus_plus" and cfg.resolved_estimator == "reinforce_plus_plus"
    assert cfg.kl_coeff == 0.001 and cfg.kl_penalty == "kl"     # KL in the reward
    assert cfg.loss_kl_coeff == 0.0                                # none in the loss
    assert cfg.needs_reference_model
    assert (cfg.global_batch_size, cfg.mini_batch_prompts, cfg.num_train_epochs) == (8, 8, 6)
    assert cfg.gamma == 1.0 and cfg.dataloader_shuffle is False


def test_gsm8k_recipe():
    cfg = load_config(GSM8K_GRPO, warn_unused=False)
    assert cfg.reward_funcs == ["gsm8k"] and cfg.rl_algorithm == "grpo"
    assert cfg.tensor_parallel_degree == 1 and cfg.rollout_n == 8
    assert cfg.kl_loss_coeff > 0 and cfg.needs_reference_model
    assert cfg.global_batch_size % cfg.mini_batch_prompts == 0
    assert (cfg.train_datasets, cfg.eval_datasets) == ("data/gsm8k/train.jsonl", "data/gsm8k/test.jsonl")


@pytest.mark.parametrize("path", [KK_GRPO, KK_RPP, GSM8K_GRPO])
def test_missing_files_are_named(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path, warn_unused=False)
    with pytest.raises(ConfigError) as err:
        check_paths(cfg)
    message = str(err.value)
    assert f"actor_model_name_or_path: folder not found: {cfg.actor_model_name_or_path}" in message
    assert f"train_datasets: file not found: {cfg.train_datasets}" in message
    assert f"eval_datasets: file not found: {cfg.eval_datasets}" in message


def _fake_model(folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2"}, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{}")  # checked for presence only


def test_documented_data_commands_fill_the_recipes(tmp_path, monkeypatch, capsys):
    """data/README.md: `paddle-rl data kk --preset logic-rl --out data/kk` and `paddle-rl data convert` produce
    exactly the files the recipes name."""
    monkeypatch.chdir(tmp_path)
    assert kk_main(["--preset", "logic-rl", "--num", "2", "--out", "data/kk"]) == 0
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    for split in ("train", "test"):
        assert cli_main(["data", "convert", str(gsm8k), "--out", f"data/gsm8k/{split}.jsonl"]) == 0
    capsys.readouterr()
    for path in (KK_GRPO, KK_RPP, GSM8K_GRPO):
        cfg = load_config(path, warn_unused=False)
        _fake_model(cfg.actor_model_name_or_path)
        check_paths(cfg)

"""PPO with a critic (rl_algorithm ppo): the critic's model, its value pass, update, warm-up, checkpoints and
layouts, on the micro model."""
import math
import os

import numpy as np
import paddle
import pytest

from micro_model import micro_overrides
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import read_metrics

PPO = dict(rl_algorithm="ppo", rollout_n=2, critic_learning_rate=1e-3, clip_range_value=0.5, gamma=1.0, lam=0.95,
           per_device_value_batch_size=3)


def run(micro, out, **extra):
    from paddle_rl.trainer import RLTrainer
    # names as in a process of its own (optimizer moments are named by per-process counters)
    with paddle.utils.unique_name.guard():
        trainer = RLTrainer(load_config(None, micro_overrides(micro, str(out), **dict(PPO, **extra))))
        trainer.train()
    return trainer, read_metrics(str(out / "metrics.jsonl"))


def test_ppo_trains_the_critic_and_the_actor(micro, tmp_path):
    trainer, rows = run(micro, tmp_path, max_steps=3, do_eval=False, critic_warmup_steps=1, save_steps=100)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in ("critic/vf_loss", "critic/vpred_mean", "critic/vf_clipfrac", "critic/vf_explained_var",
                    "critic/returns/mean", "critic/grad_norm", "critic/lr", "advantage/mean", "time/values"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row.get(key))
    # warm-up: step 1 trains the critic only
    assert rows[0].get("actor/critic_warmup") == 1.0 and "actor/pg_loss" not in rows[0]
    assert "actor/pg_loss" in rows[1] and "actor/critic_warmup" not in rows[1]
    # the value head starts at zero: the first rollout's values are all 0, later ones are not
    assert rows[0]["critic/values_mean"] == 0.0 and rows[2]["critic/values_mean"] != 0.0
    # the critic was trained apart from the actor (its own parameters, its own learning rate)
    assert rows[0]["critic/lr"] == pytest.approx(1e-3)
    head = trainer.critic.model.score.weight.numpy()
    assert np.abs(head).max() > 0


def test_critic_values_match_the_padded_packed_and_budget_passes(micro, tmp_path):
    from paddle_rl.trainer import RLTrainer
    base = micro_overrides(micro, str(tmp_path), **dict(PPO, max_steps=1, do_eval=False))
    trainer = RLTrainer(load_config(None, base))
    with paddle.no_grad():
        head = trainer.critic.model.score.weight
        head.set_value(paddle.normal(0.0, 1.0, head.shape))
    from paddle_rl.trainer.trainer import StageTimer
    _, batch, _ = trainer._generate_batch(1, StageTimer())
    batch, _ = trainer.layout.batch.place(batch, trainer.config.mini_batch_prompts, False)
    batch.with_prompt_layout(trainer.pad_id)
    padded = trainer.critic.values(batch)
    assert np.abs(padded).max() > 0
    for micro_setting in (dict(remove_padding=True), dict(max_tokens=64), dict(share_prompts=False)):
        for k, v in micro_setting.items():
            setattr(trainer.layout.micro, k, v)
        np.testing.assert_allclose(trainer.critic.values(batch), padded, atol=2e-5)


def test_ppo_resume_is_exact(micro, tmp_path):
    # 3 steps straight against 2 steps, then resume for the third: the same critic and actor metrics
    _, straight = run(micro, tmp_path / "a", max_steps=3, do_eval=False, save_steps=2)
    run(micro, tmp_path / "b", max_steps=2, do_eval=False, save_steps=2)
    assert os.path.isfile(tmp_path / "b" / "checkpoint-2" / "critic" / "model.safetensors")
    _, resumed = run(micro, tmp_path / "b", max_steps=3, do_eval=False, save_steps=2, resume_from_checkpoint="auto")
    for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss", "reward/mean"):
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("key, value, message", [
    ("pipeline_parallel_degree", 2, "not supported with pipeline_parallel_degree > 1 yet"),
    ("tensor_parallel_degree", 2, "not supported with tensor_parallel_degree > 1 yet"),
    ("sharding_parallel_degree", 2, "not supported with sharding_parallel_degree > 1 yet"),
    ("lora_rank", 4, "not supported with LoRA"),
])
def test_unsupported_layouts_are_refused(key, value, message):
    from paddle_rl.trainer.critic import check_critic_config
    config = load_config(None, ["actor_model_name_or_path=x", "rl_algorithm=ppo", f"{key}={value}"])
    with pytest.raises(ConfigError, match=message):
        check_critic_config(config, True)


def test_paddlenlp_ppo_argument_file_loads(caplog):
    import logging
    from paddle_rl.trainer.critic import check_critic_config
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "paddlenlp_ppo_argument.yaml")
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        cfg = load_config(fixture)
    assert cfg.rl_algorithm == "ppo" and cfg.resolved_estimator == "gae"
    assert cfg.clip_range_value == 0.5 and cfg.per_device_value_batch_size == 2
    settings = cfg.critic_optimizer_settings()
    assert settings["learning_rate"] == 1e-5 and settings["weight_decay"] == 0.01 and settings["min_lr_ratio"] == 1.0
    assert cfg.min_lr_ratio == 1.0            # min_learning_rate 1e-6 of learning_rate 1e-6
    message = " ".join(r.getMessage() for r in caplog.records if "not acted on" in r.getMessage())
    assert "use_rule_reward" in message and "clip_range_value" not in message and "critic" not in message
    # its tensor_parallel_degree 2 is named (the critic runs replicated: data parallelism only, for now)
    with pytest.raises(ConfigError, match="tensor_parallel_degree > 1"):
        check_critic_config(cfg, True)


def test_critic_from_a_reward_model_folder(micro, tmp_path):
    # a checkpoint's critic/ is a one-label *ForSequenceClassification folder (a reward model's layout): a critic
    # started from it takes its decoder and its trained value head, not a zero head
    from paddle_rl.models.critic import load_critic
    from paddle_rl.models.config import ModelConfig
    from paddle_rl.models.safetensors_io import load_state
    run(micro, tmp_path / "a", max_steps=1, do_eval=False, save_steps=1)
    folder = str(tmp_path / "a" / "checkpoint-1" / "critic")
    config = ModelConfig.from_pretrained(folder)
    assert config.sequence_classifier and config.num_labels == 1
    saved = load_state(folder)["score.weight"]
    assert np.abs(saved).max() > 0
    np.testing.assert_array_equal(load_critic(folder).score.weight.numpy().T, saved)
    trainer, rows = run(micro, tmp_path / "b", max_steps=1, do_eval=False, save_steps=100,
                        critic_model_name_or_path=folder)
    assert rows[0]["critic/values_mean"] != 0.0    # the trained head values the first rollout

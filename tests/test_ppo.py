"""PPO with a critic (rl_algorithm ppo): the critic's model, its value pass, update, warm-up, checkpoints and
layouts, on the micro model."""
import json
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
    from paddle_rl.monitor import StageTimer
    _, batch, _ = trainer._generate_batch(1, StageTimer())
    batch, _ = trainer.layout.batch.place(batch, trainer.config.mini_batch_prompts, False)
    batch.with_prompt_layout(trainer.pad_id)
    padded = trainer.critic.values(batch)
    assert np.abs(padded).max() > 0
    for micro_setting in (dict(remove_padding=True), dict(max_tokens=64), dict(share_prompts=False)):
        for k, v in micro_setting.items():
            setattr(trainer.layout.micro, k, v)
        np.testing.assert_allclose(trainer.critic.values(batch), padded, atol=2e-5)


@pytest.mark.parametrize("lora", [{}, dict(lora_rank=4, lora_alpha=8)], ids=["full", "lora"])
def test_ppo_resume_is_exact(micro, tmp_path, lora):
    # 3 steps straight against 2 steps, then resume for the third: the same critic and actor metrics (a LoRA critic
    # resumes its adapters and value head from the PEFT adapter folder)
    _, straight = run(micro, tmp_path / "a", max_steps=3, do_eval=False, save_steps=2, **lora)
    run(micro, tmp_path / "b", max_steps=2, do_eval=False, save_steps=2, **lora)
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert os.path.isfile(tmp_path / "b" / "checkpoint-2" / "critic" / weights)
    _, resumed = run(micro, tmp_path / "b", max_steps=3, do_eval=False, save_steps=2, resume_from_checkpoint="auto",
                     **lora)
    for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss", "reward/mean"):
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-5, abs=1e-7), key


def test_every_layout_passes_the_critic_check_and_an_adapter_folder_is_named(micro, tmp_path):
    from paddle_rl.trainer.critic import check_critic_config
    for key, value in (("tensor_parallel_degree", 2), ("sharding_parallel_degree", 2), ("pipeline_parallel_degree", 2),
                       ("lora_rank", 4)):
        check_critic_config(load_config(None, ["actor_model_name_or_path=x", "rl_algorithm=ppo", f"{key}={value}"]),
                            True)
    # a LoRA run's critic folder holds an adapter, not a model: named
    adapter = tmp_path / "critic"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    config = load_config(None, ["actor_model_name_or_path=x", "rl_algorithm=ppo",
                                f"critic_model_name_or_path={adapter}"])
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):
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
    # every key of PaddleNLP's file acts here: nothing is listed as accepted but not acted on
    assert not [r for r in caplog.records if "not acted on" in r.getMessage()]
    # its critic (a hub name, not a folder here) is named; its tensor_parallel_degree 2 runs the critic split like
    # the actor
    with pytest.raises(ConfigError, match="critic_model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct/config.json"):
        check_critic_config(cfg, True)
    cfg.critic_model_name_or_path = ""
    assert cfg.tensor_parallel_degree == 2
    check_critic_config(cfg, True)


def test_critic_from_a_reward_model_folder(micro, tmp_path):
    # a checkpoint's critic/ is a one-label *ForSequenceClassification folder (a reward model's layout): a critic
    # started from it takes its decoder and its trained value head, not a zero head
    from paddle_rl.models.critic import load_critic
    from paddle_rl.models.config import ModelConfig
    from paddle_rl.model_files.safetensors_io import load_state
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


def test_lora_critic_trains_adapters_and_its_head_and_saves_a_peft_adapter(micro, tmp_path):
    """With LoRA the critic trains adapters of the actor's settings and its whole value head; checkpoint-N/critic/ is
    a PEFT adapter (task SEQ_CLS, the head in modules_to_save) that transformers + peft score like paddle-rl."""
    from extras import extra
    from paddle_rl.models.critic import load_critic
    from paddle_rl.models.lora import LoraSettings
    from paddle_rl.trainer.state_files import read_state
    torch, peft, transformers = extra("torch"), extra("peft"), extra("transformers")
    trainer, rows = run(micro, tmp_path, max_steps=2, do_eval=False, save_steps=2, lora_rank=4, lora_alpha=8,
                        critic_learning_rate=1e-2)
    trained = [n for n, p in trainer.critic.model.named_parameters() if not p.stop_gradient]
    assert trained and all("lora_" in n or n == "score.weight" for n in trained) and "score.weight" in trained
    assert rows[-1]["critic/values_mean"] != 0.0
    folder = tmp_path / "checkpoint-2" / "critic"
    assert not (folder / "model.safetensors").exists()   # the frozen base is not copied
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"] and config["r"] == 4
    moments = [k for k in read_state(str(folder), "optimizer") if "moment1" in str(k)]
    assert len(moments) == len(trained), (len(moments), len(trained))   # the adapters and the head only

    ours = load_critic(micro["model"], lora=LoraSettings(rank=4, alpha=8))
    from paddle_rl.models import load_weights
    load_weights(ours, str(folder))
    ours.eval()
    np.testing.assert_array_equal(ours.score.weight.numpy(), trainer.critic.model.score.weight.numpy())
    lora_b = max(float(np.abs(p.numpy()).max()) for n, p in ours.named_parameters() if "lora_B" in n)
    assert lora_b > 0  # the adapters trained (B starts at 0)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(micro["model"], num_labels=1)
    theirs = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    ids = np.random.default_rng(0).integers(3, 200, size=(1, 9))
    for row in ids:
        with torch.no_grad():
            want = theirs(input_ids=torch.tensor(row[None])).logits[0, 0].item()
        got = float(ours.sequence_scores(paddle.to_tensor(row[None]), paddle.ones([1, len(row)], "int64"))[0, 0])
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)


def test_one_update_pass_gives_the_rollout_values_itself(micro, tmp_path, monkeypatch):
    """One mini-batch per step and update_iters 1: the critic's update forward gives the rollout-time values (no
    value pass, time/values absent) and the run equals the one with a separate value pass."""
    from paddle_rl.trainer.critic import Critic
    same = dict(max_steps=3, do_eval=False, save_steps=100, global_mini_batch_size=4, critic_warmup_steps=1)
    trainer, fused = run(micro, tmp_path / "fused", **same)
    assert trainer.critic.fuses_value_pass
    monkeypatch.setattr(Critic, "fuses_value_pass", property(lambda self: False))
    _, plain = run(micro, tmp_path / "plain", **same)
    assert all("time/values" not in r for r in fused) and all("time/values" in r for r in plain)
    assert fused[2]["critic/values_mean"] != 0.0
    for a, b in zip(fused, plain):
        for key in ("critic/vf_loss", "critic/values_mean", "critic/vf_explained_var", "critic/grad_norm",
                    "critic/returns/mean", "advantage/std", "reward/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert fused[2]["actor/pg_loss"] == pytest.approx(plain[2]["actor/pg_loss"], rel=1e-4, abs=1e-7)


def test_lora_dropout_keeps_the_value_pass(micro, tmp_path):
    # the update's forward drops adapter inputs; the rollout values come from the value pass (eval mode)
    trainer, rows = run(micro, tmp_path, max_steps=1, do_eval=False, save_steps=100, global_mini_batch_size=4,
                        lora_rank=4, lora_alpha=8, lora_dropout=0.1)
    assert not trainer.critic.fuses_value_pass and "time/values" in rows[0]


def test_bf16_ppo_with_lora_runs_actor_and_critic_on_bf16_products(micro, tmp_path):
    """bf16 with LoRA through the trainer: the actor's and the critic's linear layers, their adapters and the
    critic's value head are all on the bf16 products (tests/test_bf16.py holds their numbers), and the run trains."""
    from paddle_rl.models.layers import Bf16Products
    trainer, rows = run(micro, tmp_path, max_steps=2, do_eval=False, save_steps=100, lora_rank=4, lora_alpha=8,
                        critic_learning_rate=1e-2, bf16="true")
    for model in (trainer.actor, trainer.critic.model):
        layers = [m for m in model.sublayers() if isinstance(m, Bf16Products)]
        assert any(type(m).__name__ == "RowAdapter" for m in layers) and all(m.bf16 for m in layers)
    assert trainer.critic.model.score.bf16 and trainer.critic.model.bf16 == (True, True)
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
        assert all(math.isfinite(r[key]) for r in rows if key in r) and any(key in r for r in rows)
    assert rows[-1]["critic/values_mean"] != 0.0

"""PaddleNLP's smaller keys: each acts, or a value this build cannot honour is refused by name with the reason
(offload_optim, offload_level, release_grads, recompute_use_reentrant, no_recompute_layers, quant_type, sharding_parallel_config,
per_device_rollout_batch_size, global_gen_batch_size, use_rule_reward, skip_profile_timer, wandb_http_proxy)."""
import logging
import sys
import types

import numpy as np
import pytest

from micro_model import micro_overrides
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import MetricsLog
from paddle_rl.rollout import EngineSettings
from paddle_rl.trainer import RLTrainer
from paddle_rl.trainer.preflight import memory_problems


def _cfg(micro, tmp_path, **extra):
    return load_config(None, micro_overrides(micro, str(tmp_path), do_eval=False, **extra))


@pytest.mark.parametrize("extra,message", [
    (dict(quant_type="weight_only_int8"), "quant_type: 'weight_only_int8': quantized training weights are not"),
    (dict(sharding_parallel_config="enable_stage1_overlap enable_release_grads"),
     "sharding_parallel_config: enable_stage1_overlap: options of Paddle fleet's sharding communication"),
    (dict(sharding_parallel_config="enable_release_grads", release_grads="false"),
     "sharding_parallel_config: enable_release_grads frees the gradients after each step, and release_grads: false"),
    (dict(global_gen_batch_size=8), "global_gen_batch_size: 8: each generation round here generates "
                                    "global_batch_size (4) prompts"),
    (dict(per_device_rollout_batch_size=0), "per_device_rollout_batch_size: must be -1 (no bound) or >= 1, got 0"),
    (dict(use_rule_reward="true", use_rm_server="true"), "use_rule_reward: true scores with the rules, and "
                                                         "use_rm_server: true"),
    (dict(use_rule_reward="true", reward_funcs="[kk,reward_model]"), "use_rule_reward: true scores with the rules "
                                                                     "only, and reward_funcs / reward_routes name "
                                                                     "reward_model"),
    (dict(report_to="wandb", wandb_http_proxy="127.0.0.1:8962"), "wandb_http_proxy: expected a proxy URL"),
    (dict(no_recompute_layers="[0]"), "no_recompute_layers: [0] is set without recompute: true"),
    (dict(recompute="true", no_recompute_layers="[0, -1]"), "no_recompute_layers: layer indices are integers >= 0, "
                                                             "got [-1]"),
    (dict(recompute="true", no_recompute_layers="[1, 1]"), "no_recompute_layers: a layer is listed twice"),
])
def test_a_value_this_build_cannot_honour_is_refused_by_name(micro, tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        _cfg(micro, tmp_path, **extra)
    assert message in str(err.value)


def test_values_that_act_load(micro, tmp_path):
    cfg = _cfg(micro, tmp_path, sharding_parallel_config="enable_release_grads", global_gen_batch_size=4,
               per_device_rollout_batch_size=2, use_rule_reward="true", reward_model_name_or_path=micro["model"])
    assert cfg.sharding_options == ("enable_release_grads",) and cfg.release_grads
    assert cfg.reward_funcs == ["kk"]   # use_rule_reward: the reward model is not added to the rules
    assert _cfg(micro, tmp_path, reward_model_name_or_path=micro["model"]).reward_funcs == ["reward_model"]


def test_offload_keys_on_a_cpu_build_are_named_and_the_run_goes_on(micro, tmp_path, caplog):
    """On a CPU build the states offload_optim / offload_level would move are in host memory already: one warning
    line each, no refusal (PaddleNLP's own grpo_argument.yaml sets offload_level)."""
    cfg = _cfg(micro, tmp_path, offload_optim="true", offload_level="freeze_model")
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        assert memory_problems(cfg) == []
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines if "there is no second memory" in line] == ["offload_optim",
                                                                                             "offload_level"]


def test_per_device_rollout_batch_size_bounds_the_decode_batch(micro, tmp_path):
    """Its prompts x rollout_n rows bound the running decode batch the engine admits (the smaller bound with
    rollout_max_num_seqs)."""
    def rows(**extra):
        return EngineSettings.from_config(_cfg(micro, tmp_path, **extra), 0, [1]).max_num_seqs
    assert rows() == -1
    assert rows(per_device_rollout_batch_size=2) == 8                 # rollout_n 4
    assert rows(per_device_rollout_batch_size=2, rollout_max_num_seqs=4) == 4
    assert rows(per_device_rollout_batch_size=1, rollout_max_num_seqs=12) == 4


def test_release_grads_frees_or_keeps_the_gradients_and_skip_profile_timer_prints_the_stages(micro, tmp_path,
                                                                                              caplog):
    """release_grads true (the default): after the optimizer step the parameters hold no gradient; false: zeroed
    gradients stay allocated. skip_profile_timer false prints each logged step's seconds per stage."""
    held = {}
    for release in ("true", "false"):
        with caplog.at_level(logging.INFO, logger="paddle_rl"):
            trainer = RLTrainer(_cfg(micro, tmp_path / release, release_grads=release, max_steps=1, save_steps=5,
                                     global_mini_batch_size=4, entropy_coeff=0.01,
                                     skip_profile_timer="false" if release == "false" else "true"))
            trainer.train()
        grads = [p.grad for p in trainer.actor.parameters() if not p.stop_gradient]
        held[release] = grads
        timers = [r.getMessage() for r in caplog.records if "timers:" in r.getMessage()]
        if release == "true":
            assert timers == []
        else:
            assert len(timers) == 1 and timers[0].startswith("step 1 timers: step ") and "update " in timers[0]
        caplog.clear()
    assert all(g is None for g in held["true"])
    assert all(g is not None and not np.any(g.numpy()) for g in held["false"])


def _recompute_calls(micro, what, reentrant=True, keep=()):
    """(gradients, number of blocks run through Paddle's reentrant recompute, layers) of one forward and backward of
    the micro model recomputing `what` (with `reentrant`), the layers `keep` not recomputed."""
    import paddle.distributed.fleet.recompute  # noqa: F401 - loads the module whose PyLayer is counted
    from paddle_rl.models import load_model
    from paddle_rl.models.decoder import attention_bias_from_mask
    module = sys.modules["paddle.distributed.fleet.recompute.recompute"]
    calls = []
    original = module.RecomputeFunction.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    module.RecomputeFunction.forward = staticmethod(counted)
    try:
        model = load_model(micro["model"])
        model.train()
        model.set_recompute(what, reentrant, keep)
        ids = paddle.to_tensor([[3, 7, 11, 2, 5, 9, 4, 1]])
        bias = attention_bias_from_mask(paddle.ones_like(ids), 8, causal=True)
        logp = model.head_logprobs(model.hidden_states(ids, paddle.arange(8).unsqueeze(0), bias), ids, 1.0)[0]
        (-logp.mean()).backward()
    finally:
        module.RecomputeFunction.forward = original
    return [p.grad.numpy() for p in model.parameters()], len(calls), model.config.num_hidden_layers


def test_recompute_use_reentrant_runs_paddles_reentrant_recompute(micro):
    """true: the recomputed blocks run through Paddle's reentrant recompute (its RecomputeFunction PyLayer), false:
    the non-reentrant one; the gradients are the same bits, and the same as without recompute."""
    grads = {name: _recompute_calls(micro, what, reentrant)
             for name, what, reentrant in (("plain", None, False), ("hooks", "full", False),
                                           ("reentrant", "full", True), ("reentrant_core", "core_attn_mlp", True))}
    assert grads["plain"][1] == grads["hooks"][1] == 0
    assert grads["reentrant"][1] == grads["reentrant"][2] and grads["reentrant_core"][1] > 0
    for name in ("hooks", "reentrant", "reentrant_core"):
        assert all(np.array_equal(a, b) for a, b in zip(grads[name][0], grads["plain"][0]))


@pytest.mark.parametrize("what", ["full", "core_attn_mlp"])
def test_no_recompute_layers_keep_their_activations(micro, what):
    """The listed layers (global indices) run without recompute, the others as recompute_granularity says; the
    gradients are the same bits either way."""
    plain, none, layers = _recompute_calls(micro, None)
    every, calls_all, _ = _recompute_calls(micro, what)
    kept, calls_kept, _ = _recompute_calls(micro, what, keep=[0])
    assert none == 0 and calls_all > 0 and calls_all % layers == 0
    assert calls_kept == calls_all - calls_all // layers   # layer 0's blocks are not recomputed
    assert _recompute_calls(micro, what, keep=range(layers))[1] == 0
    for grads in (every, kept):
        assert all(np.array_equal(a, b) for a, b in zip(grads, plain))


def test_no_recompute_layers_names_a_layer_the_model_lacks(micro, tmp_path):
    cfg = _cfg(micro, tmp_path, recompute="true", no_recompute_layers="[0, 40]")
    with pytest.raises(ConfigError) as err:
        RLTrainer(cfg)
    assert "no_recompute_layers: layers [40] do not exist: the model has" in str(err.value)


def test_wandb_http_proxy_reaches_the_wandb_run(tmp_path, monkeypatch, micro, caplog):
    """The proxy goes to wandb.init as the run's settings (http and https); without it no settings are passed."""
    calls = []

    class Run:
        def log(self, data, step):
            pass

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kw: ("Settings", kw)
    fake.init = lambda **kw: calls.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _cfg(micro, tmp_path, report_to="wandb", wandb_http_proxy="http://127.0.0.1:8962")
    for proxy in (cfg.wandb_http_proxy, ""):
        MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="wandb", wandb_proxy=proxy).close()
    assert calls[0]["settings"] == ("Settings", {"http_proxy": "http://127.0.0.1:8962",
                                                 "https_proxy": "http://127.0.0.1:8962"})
    assert "settings" not in calls[1]
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):   # no wandb dashboard: said, not silent
        MetricsLog(str(tmp_path / "out"), str(tmp_path / "logs"), report_to="visualdl", wandb_proxy="http://p:1").close()
    assert any("wandb_http_proxy http://p:1 is not used" in r.getMessage() for r in caplog.records)

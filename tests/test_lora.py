"""LoRA: adapters on the fused projections equal PEFT's on the unfused modules (both ways, files written and read by
`peft`), the rollout's merged weights equal the unmerged forward, the reference is the base with the adapters off,
only adapters train, checkpoints hold PEFT adapters (and merged weights on request), kill -9 and resume is exact,
and tensor / data parallelism and sharding equal one process."""
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from extras import extra
from micro_model import kill_after_checkpoint, micro_overrides
from paddle_rl.config import ConfigError, load_config
from paddle_rl.models import LoraSettings, adapters_off, load_model, merged_weights, save_model
from paddle_rl.models.lora import AdapterError, adapters
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
from paddle_rl.trainer.state_files import read_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = dict(lora_rank=4, lora_alpha=8)


def _randomize_b(model, seed=0, scale=0.2):
    """Adapters start with B = 0 (the base model); give them weight so that every check sees them."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * scale).astype(np.float32)))


def _torch_logits(model, ids, mask):
    torch = extra("torch")
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.numpy()


# --------------------------------------------------------------------------------------------- PEFT interop

@pytest.mark.parametrize("kind,tie,targets,rslora", [("llama", False, ["all-linear"], False),
                                                     ("qwen2", True, ["q_proj", "v_proj", "up_proj"], True),
                                                     ("qwen3", False, ["k_proj", "o_proj", "down_proj"], False)])
def test_adapters_equal_peft_on_the_unfused_modules(tmp_path, kind, tie, targets, rslora):
    """Our adapters on fused q/k/v and gate/up, saved in PEFT's layout, give transformers + peft our logits; an
    adapter peft made (random A and B) loads into paddle-rl and gives peft's logits."""
    extra("torch")
    peft = extra("peft")
    from test_model_parity import _hf_model, _inputs
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    cls, base = type(hf), str(tmp_path / "base")
    ids, mask = _inputs()
    valid = mask.astype(bool)

    ours = load_model(base, lora=LoraSettings(rank=4, alpha=8, target_modules=tuple(targets), use_rslora=rslora))
    ours.eval()
    _randomize_b(ours)
    out = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    with adapters_off(ours):
        off = ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(out - off)[valid].max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(off[valid], _torch_logits(hf, ids, mask)[valid], atol=1e-4)  # off: the base
    save_model(ours, str(tmp_path / "ours"))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["use_rslora"] == rslora
    wrapped = peft.PeftModel.from_pretrained(cls.from_pretrained(base), str(tmp_path / "ours")).eval()
    assert np.abs(_torch_logits(wrapped, ids, mask) - out)[valid].max() <= 1e-4

    made = peft.get_peft_model(cls.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets[0] if targets == ["all-linear"] else targets,
        init_lora_weights=False, use_rslora=rslora)).eval()
    made.save_pretrained(str(tmp_path / "peft"))
    expected = _torch_logits(made, ids, mask)
    loaded = load_model(base, adapter=str(tmp_path / "peft"))
    loaded.eval()
    got = loaded(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy()
    assert np.abs(got - expected)[valid].max() <= 1e-4


def test_adapter_folder_errors(micro, tmp_path):
    with pytest.raises(AdapterError, match=r"lora_target_modules: qkv names no linear module .*q_proj"):
        load_model(micro["model"], lora=LoraSettings(target_modules=("qkv",)))
    model = load_model(micro["model"], lora=LoraSettings(rank=2))
    save_model(model, str(tmp_path / "adapter"))
    with pytest.raises(AdapterError, match="holds a LoRA adapter, not a model"):
        load_model(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(AdapterError, match="use_dora: True is not supported"):
        load_model(micro["model"], adapter=str(tmp_path / "adapter"))


# --------------------------------------------------------------------------------------------- rollout / reference

def test_merged_rollout_equals_the_unmerged_forward(micro):
    """The engine decodes with W + A B * scaling; the update's forward (adapters on, unmerged) gives the same
    log-probs of the sampled tokens within 1e-5, and the base weights are bit-identical afterwards."""
    from paddle_rl.layouts import build_layout
    from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key
    model = load_model(micro["model"], lora=LoraSettings(rank=4, alpha=8))
    _randomize_b(model, scale=0.3)
    base = {n: p.numpy().copy() for n, p in model.named_parameters() if p.stop_gradient}
    prompts = [micro["tokenizer"].encode(t) for t in ("Alice says", "Bob is a knave", "who is")]
    keys = [sample_key(3, 1, i, j) for i in range(3) for j in range(4)]
    params = SamplingParams(max_dec_len=12, temperature=0.9)
    out = RolloutEngine(model, 0, [1]).generate(prompts, 4, params, keys)
    out["group"] = np.arange(out.size) // 4
    batch = out.with_prompt_layout(0)
    mask = batch["response_mask"]
    unmerged = build_layout().logprobs(model, batch, 0.9, 12)
    assert np.abs(unmerged - batch["rollout_logp"] * mask).max() <= 1e-5
    with adapters_off(model):
        base_logp = build_layout().logprobs(model, batch, 0.9, 12)
    assert np.abs(base_logp - unmerged).max() > 1e-2  # the rollout did decode with the adapters
    assert all(np.array_equal(base[n], p.numpy()) for n, p in model.named_parameters() if p.stop_gradient)
    assert all(a.merged is None for _, a in adapters(model))  # the merged copies are gone
    with merged_weights(model):  # merged and unmerged full forwards agree too
        ids = paddle.to_tensor(np.array([prompts[1] * 3]))
        merged_logits = model(ids).numpy()
    np.testing.assert_allclose(merged_logits, model(ids).numpy(), atol=1e-5)


def test_reference_is_the_base_and_only_adapters_train(micro, tmp_path):
    """With LoRA the reference is the actor with its adapters off (no second model), its log-probs equal a plain
    base model's, the optimizer holds the adapters only, and the base is unchanged after training."""
    from paddle_rl.trainer import RLTrainer
    from test_parallel import PLUGIN
    plugin = tmp_path / "reward.py"
    plugin.write_text(PLUGIN)
    overrides = micro_overrides(micro, str(tmp_path / "run"), kl_loss_coeff=0.05, do_eval=False, learning_rate=1e-2,
                                reward_plugins=str(plugin), reward_funcs="length_parity", **LORA)
    trainer = RLTrainer(load_config(None, overrides))
    assert trainer.reference is trainer.actor
    trained = trainer.optimizer._parameter_list
    assert trained and all("lora" in n for n, p in trainer.actor.named_parameters() if not p.stop_gradient)
    adapter_size = sum(int(np.prod(p.shape)) for p in trained)
    assert {id(p) for p in trained} == {id(p) for p in trainer.actor.parameters() if not p.stop_gradient}
    base = {n: p.numpy().copy() for n, p in trainer.actor.named_parameters() if p.stop_gradient}
    trainer.train()
    assert all(np.array_equal(base[n], p.numpy()) for n, p in trainer.actor.named_parameters() if p.stop_gradient)
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert rows[-1]["actor/ref_kl"] > 0  # the adapters moved the policy away from the reference (the base)
    state = trainer.layout.optimizer_state_bytes(trainer.optimizer)
    assert state["moments"] == 2 * 4 * adapter_size
    # the reference's log-probs are the base model's
    from paddle_rl.layouts import build_layout
    from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key
    prompts = [micro["tokenizer"].encode("Bob is a knave")]
    batch = RolloutEngine(trainer.actor, 0, [1]).generate(prompts, 4, SamplingParams(max_dec_len=8, temperature=1.0),
                                                          [sample_key(1, 1, 0, j) for j in range(4)])
    batch["group"] = np.zeros(batch.size, dtype=np.int64)
    batch = batch.with_prompt_layout(0)
    with trainer._reference_view(trainer.reference) as reference:
        ref = build_layout().logprobs(reference, batch, 1.0, 4)
    plain = build_layout().logprobs(load_model(micro["model"]), batch, 1.0, 4)
    np.testing.assert_allclose(ref, plain, atol=1e-6)
    # switched off: the whole model trains and a second (reference) model is loaded
    full = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "full"), kl_loss_coeff=0.05)))
    assert full.reference is not full.actor
    assert len(full.optimizer._parameter_list) == len(list(full.actor.parameters())) > len(trained)


def test_lora_path_continues_a_peft_adapter_and_clashing_keys_are_named(micro, tmp_path):
    model = load_model(micro["model"], lora=LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    _randomize_b(model)
    save_model(model, str(tmp_path / "adapter"))
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "run"), do_eval=False, max_steps=1,
                                                         lora_path=str(tmp_path / "adapter"))))
    names = {n.rsplit(".", 3)[-3] for n, p in trainer.actor.named_parameters() if not p.stop_gradient}
    assert names == {"qkv_proj"}
    got = {n: p.numpy() for n, p in trainer.actor.named_parameters() if "lora_B" in n}
    want = {n: p.numpy() for n, p in model.named_parameters() if "lora_B" in n}
    assert all(np.array_equal(got[n], want[n]) for n in want) and len(want) == 2
    assert trainer.actor.lora.rank == 4 and trainer.actor.lora.target_modules == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match=r"lora_path: .*adapter_config.json disagrees .*lora_rank 16 \(the adapter "
                                          r"has 4\)"):
        RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "bad"), lora_path=str(tmp_path / "adapter"),
                                                    lora_rank=16)))
    with pytest.raises(ConfigError, match="merge_lora: needs LoRA"):
        load_config(None, micro_overrides(micro, str(tmp_path / "bad"), merge_lora=True))


# --------------------------------------------------------------------------------------------- checkpoints

def _run_cli(args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "paddle_rl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)


def test_kill_9_and_resume_is_exact_and_checkpoints_are_peft_adapters(micro, tmp_path):
    extra("torch")
    peft = extra("peft")
    transformers = extra("transformers")
    base = micro_overrides(micro, str(tmp_path / "a"), max_steps=4, save_steps=2, eval_steps=2, kl_loss_coeff=0.05,
                           learning_rate=1e-2, merge_lora="true", lora_dropout=0.1, **LORA)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("\n".join(f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}" for o in base) + "\n")
    ref = _run_cli(["train", str(cfg)])
    assert ref.returncode == 0, ref.stderr[-2000:]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]  # noqa
    expected = strip(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))
    ckpt = tmp_path / "a" / "checkpoint-4"
    for name in ("adapter_config.json", "adapter_model.safetensors", "merged/config.json", "merged/model.safetensors",
                 "merged/tokenizer.json", "optimizer.json", "optimizer.safetensors", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    assert not (ckpt / "model.safetensors").exists()  # the frozen base is not copied into every checkpoint
    moments = [k for k in read_state(str(ckpt), "optimizer") if "moment1" in str(k)]
    assert moments and all("adapter" in k for k in moments), moments[:3]

    out_b = tmp_path / "b"
    kill_after_checkpoint(str(cfg), out_b)
    resumed = _run_cli(["train", str(cfg), f"output_dir={out_b}", "resume_from_checkpoint=auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert strip(read_metrics(str(out_b / "metrics.jsonl"))) == expected
    from paddle_rl.models.lora import read_adapter
    a, b = read_adapter(str(ckpt)), read_adapter(str(out_b / "checkpoint-4"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert max(np.abs(v).max() for k, v in a.items() if "lora_B" in k) > 0  # the adapters trained

    # the merged weights are an ordinary checkpoint: transformers alone, and base + adapter through peft, agree
    from test_model_parity import _inputs
    ids, mask = _inputs()
    ids = ids % 200
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt / "merged")).eval()
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(micro["model"]),
                                             str(ckpt)).eval()
    valid = mask.astype(bool)
    want = _torch_logits(merged, ids, mask)
    assert np.abs(_torch_logits(adapted, ids, mask) - want)[valid].max() <= 1e-4
    ours = load_model(micro["model"], adapter=str(ckpt))
    ours.eval()
    assert np.abs(ours(paddle.to_tensor(ids), paddle.to_tensor(mask)).numpy() - want)[valid].max() <= 1e-4


# --------------------------------------------------------------------------------------------- parallel layouts

@pytest.fixture(scope="module")
def single(micro, tmp_path_factory):
    from paddle_rl.trainer import RLTrainer
    from test_parallel import PLUGIN, run_overrides
    root = tmp_path_factory.mktemp("lora_parallel")
    (root / "reward.py").write_text(PLUGIN)
    out = root / "single"
    RLTrainer(load_config(None, run_overrides(micro, str(out), str(root / "reward.py"), merge_lora="true",
                                              **LORA))).train()
    return root


@pytest.mark.parametrize("degrees", [dict(tensor_parallel_degree=2),
                                     pytest.param(dict(data_parallel_degree=2), marks=pytest.mark.slow),
                                     pytest.param(dict(sharding_parallel_degree=2, sharding="stage2"),
                                                  marks=pytest.mark.slow),
                                     dict(pipeline_parallel_degree=2)],
                         ids=["tp2", "dp2", "sharding2", "pp2"])
def test_parallel_layouts_equal_one_process(micro, single, degrees):
    """LoRA under TP (A replicated and B split in column layers, A split and B replicated in row layers), DP,
    sharding stage 2 and a pipeline (the rollout on a gathered, merged copy) through run_rl.py: the losses,
    statistics, adapters and merged weights of one process."""
    from test_parallel import assert_parity, launch, run_overrides
    name = "-".join(f"{k.split('_')[0]}{v}" for k, v in degrees.items())
    out = single / name
    launch([os.path.join(ROOT, "paddle_rl", "run_rl.py"), os.path.join(ROOT, "configs", "tiny_kk_grpo.yaml"),
            *run_overrides(micro, str(out), str(single / "reward.py"), eval_datasets="", logging_dir="",
                           merge_lora="true", **LORA, **degrees)], str(out / "log"))
    assert_parity(str(single / "single"), str(out))
    # the adapters themselves (B starts at zero, so its error is the trained update's)
    from paddle_rl.models.lora import read_adapter
    from test_parallel import rel_err
    ref, got = (read_adapter(str(d / "checkpoint-3")) for d in (single / "single", out))
    assert set(ref) == set(got) and len(ref) == 2 * 7 * 2
    errors = {k: rel_err(ref[k], got[k]) for k in ref}
    worst = max(errors, key=errors.get)
    print(f"{name}: max adapter rel err {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= 1e-5, (worst, errors[worst])


def test_sft_with_lora_learns_and_saves_the_adapter(micro, tmp_path):
    """`paddle-rl sft` with LoRA: the response loss falls with only the adapters trained, and the checkpoint is
    the adapter (which the next RL run takes as lora_path)."""
    from test_sft import _overrides, _records, _sft
    data = _records(micro, tmp_path / "sft.jsonl", count=8)
    # the micro model is random and its embeddings stay frozen, so adapters bring the loss down slowly (6.0 -> 5.6
    # in 30 steps of 0.03 s); with the adapters frozen it would not move at all
    trainer = _sft(_overrides(micro, tmp_path / "out", data, max_steps=30, save_steps=30, learning_rate=2e-2, **LORA))
    rows = read_metrics(str(tmp_path / "out" / "metrics.jsonl"))
    losses = [r["actor/sft_loss"] for r in rows]
    assert losses[-1] < losses[0] - 0.25, losses
    assert all("lora" in n for n, p in trainer.actor.named_parameters() if not p.stop_gradient)
    ckpt = tmp_path / "out" / "checkpoint-30"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    from paddle_rl.trainer import RLTrainer
    follow = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "rl"), do_eval=False,
                                                         lora_path=str(ckpt))))
    got = {n: p.numpy() for n, p in follow.actor.named_parameters() if "lora" in n}
    want = {n: p.numpy() for n, p in trainer.actor.named_parameters() if "lora" in n}
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)

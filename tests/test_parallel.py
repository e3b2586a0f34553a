"""Data, sharding, tensor and pipeline parallelism on 2 real processes (gloo on CPU) equal one process.

Each layout trains the micro model for 3 RL steps from the same seed and is compared with the
single-process run: every logged loss / statistic, the final weights (the checkpoint the parallel
run gathered and wrote on rank 0) and greedy rollout tokens. The parallel runs go through
`python -m paddle.distributed.launch --nproc_per_node 2`; this file is also the worker they launch.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
REL_TOL = 1e-5        # losses, gradient norms and final weights
STAT_TOL = 1e-4       # every other logged statistic (kl of old vs reference log-probs, rewards, lengths, ...)
PLUGIN = '''
def length_parity(completions, **kwargs):
    """A reward that varies between samples so that every group has a non-zero advantage."""
    return [float(len(c) % 5) - 2.0 for c in completions]


def some_groups_flat(completions, prompts, **kwargs):
    """Constant for prompts of even length (their groups have zero variance), else length_parity."""
    return [1.0 if len(p) % 2 == 0 else float(len(c) % 5) - 2.0 for c, p in zip(completions, prompts)]
'''


# --------------------------------------------------------------------------------------------- helpers

def run_overrides(micro, out_dir, plugin, **extra):
    values = dict(actor_model_name_or_path=micro["model"], train_datasets=micro["train"], output_dir=out_dir,
                  max_prompt_len=128, max_dec_len=10, min_dec_len=1, temperature=1.0, rollout_n=4,
                  global_batch_size=4, global_mini_batch_size=2, per_device_train_batch_size=2,
                  per_device_logprob_batch_size=4, learning_rate=2e-3, weight_decay=0.01, max_steps=3,
                  do_eval=False, save_steps=2, seed=5, disable_tqdm=True, report_to="none",
                  reward_plugins=plugin, reward_funcs="length_parity", kl_loss_coeff=0.05, max_grad_norm=0.5,
                  adam_epsilon=1e-6, lr_scheduler_type="constant",  # the config file's own schedule is not the point
                  clip_range_ratio_high=0.2, dynamic_sampling=False)  # nor its clip-higher and dynamic sampling
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def greedy_prompts(micro, count=6):
    with open(micro["test"], encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()][:count]
    return [micro["tokenizer"].encode(r["src"]) for r in records]


def train_and_probe(overrides, out_dir, prompts):
    """Train, then decode `prompts` greedily on the same layout; rank 0 writes greedy.npy, every rank its memory."""
    from paddle_rl.config import load_config
    from paddle_rl.rollout import SamplingParams
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, overrides))
    trainer.train()
    params = SamplingParams(max_dec_len=8, temperature=0.0, stop_token_ids=trainer.stop_ids)
    out = trainer.layout.generate(trainer.engine, prompts, 1, params, None)
    rank = trainer.layout.rank
    with open(os.path.join(out_dir, f"memory-rank{rank}.json"), "w") as f:
        json.dump(trainer.layout.optimizer_state_bytes(trainer.optimizer), f)
    if trainer.critic is not None:
        with open(os.path.join(out_dir, f"critic-memory-rank{rank}.json"), "w") as f:
            json.dump(trainer.layout.optimizer_state_bytes(trainer.critic.optimizer), f)
    if rank == 0:
        np.save(os.path.join(out_dir, "greedy.npy"), out.response_ids * (out.response_mask > 0))
    trainer.layout.barrier()  # exit together (see RLTrainer.train)
    return trainer


def launch(args, log_dir, nproc=2, timeout=400):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")  # a crashing worker logs its Python stack
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", log_dir,
           *args]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        logs = ""
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
            with open(os.path.join(log_dir, name), errors="replace") as f:
                logs += f"\n--- {name}\n" + f.read()[-4000:]
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{logs}")
    return time.time() - start


def read_rows(out_dir):
    from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def rel_err(a, b):
    """||a - b|| / ||a|| (Adam turns float noise in gradients near zero into noise of a few 1e-7 on single
    elements, so a per-element maximum says little; the norm of the difference does)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


def weights(out_dir, step=3):
    """The checkpoint's weights (a LoRA run's merged ones: merge_lora)."""
    from paddle_rl.model_files.safetensors_io import load_state
    path = os.path.join(out_dir, f"checkpoint-{step}")
    return load_state(os.path.join(path, "merged") if os.path.isdir(os.path.join(path, "merged")) else path)


def compare_runs(ref_dir, par_dir):
    """{metric or tensor: relative error}; raises when the logged rows differ in keys or count."""
    ref, par = read_rows(ref_dir), read_rows(par_dir)
    assert [r["step"] for r in par] == [r["step"] for r in ref] == [1, 2, 3]
    errors = {}
    for a, b in zip(ref, par):
        assert set(a) == set(b), set(a) ^ set(b)
        for k in a:
            if isinstance(a[k], float):
                # relative; values under 0.01 (e.g. the first iteration's approx_kl) on an absolute 1e-7
                scale = max(abs(a[k]), abs(b[k]), 1e-2)
                errors[f"step{a['step']}/{k}"] = abs(a[k] - b[k]) / scale
    wa, wb = weights(ref_dir), weights(par_dir)
    assert set(wa) == set(wb)
    for name in wa:
        errors[name] = rel_err(wa[name], wb[name])
    return errors


# --------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def setup(micro, tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    plugin = root / "parity_reward.py"
    plugin.write_text(PLUGIN)
    return {"micro": micro, "root": root, "plugin": str(plugin), "prompts": greedy_prompts(micro)}


@pytest.fixture(scope="module")
def reference(setup):
    """Single-process runs (GRPO and REINFORCE++) and their greedy tokens."""
    out = {}
    for algo in ("grpo", "reinforce_plus_plus"):
        out_dir = str(setup["root"] / f"single-{algo}")
        os.makedirs(out_dir, exist_ok=True)
        extra = {"rl_algorithm": algo}
        if algo == "reinforce_plus_plus":
            extra.update(kl_coeff=0.02, kl_loss_coeff=0.0)
        train_and_probe(run_overrides(setup["micro"], out_dir, setup["plugin"], **extra), out_dir, setup["prompts"])
        out[algo] = out_dir
    return out


def run_layout(setup, name, algo="grpo", nproc=2, **degrees):
    out_dir = str(setup["root"] / name)
    os.makedirs(out_dir, exist_ok=True)
    extra = dict(degrees, rl_algorithm=algo)
    if algo == "reinforce_plus_plus":
        extra.update(kl_coeff=0.02, kl_loss_coeff=0.0)
    spec = {"overrides": run_overrides(setup["micro"], out_dir, setup["plugin"], **extra), "out_dir": out_dir,
            "prompts": setup["prompts"]}
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    seconds = launch([os.path.abspath(__file__), "--worker", spec_path], os.path.join(out_dir, "log"), nproc=nproc)
    return out_dir, seconds


def assert_parity(ref_dir, out_dir):
    errors = compare_runs(ref_dir, out_dir)
    losses = {k: v for k, v in errors.items() if k.split("/", 1)[-1] in LOSS_KEYS}
    tensors = {k: v for k, v in errors.items() if not k.startswith("step")}
    stats = {k: v for k, v in errors.items() if k not in losses and k not in tensors}
    worst = {name: max(group, key=group.get) for name, group in
             (("loss", losses), ("weight", tensors), ("statistic", stats))}
    print(f"{os.path.basename(out_dir)}: " + ", ".join(f"max {name} rel err {errors[k]:.2e} ({k})"
                                                       for name, k in worst.items()))
    assert errors[worst["loss"]] <= REL_TOL, (worst["loss"], errors[worst["loss"]])
    assert errors[worst["weight"]] <= REL_TOL, (worst["weight"], errors[worst["weight"]])
    assert errors[worst["statistic"]] <= STAT_TOL, (worst["statistic"], errors[worst["statistic"]])


def check_parity(setup, reference, out_dir, algo="grpo"):
    assert_parity(reference[algo], out_dir)
    ref_tokens = np.load(os.path.join(reference[algo], "greedy.npy"))
    par_tokens = np.load(os.path.join(out_dir, "greedy.npy"))
    np.testing.assert_array_equal(par_tokens, ref_tokens)
    memory = [json.load(open(os.path.join(out_dir, name))) for name in sorted(os.listdir(out_dir))
              if name.startswith("memory-rank")]
    print(f"{os.path.basename(out_dir)}: Adam moment bytes per rank {[m['moments'] for m in memory]}")
    return memory


# --------------------------------------------------------------------------------------------- tests

def test_degree_product_must_match_world_size():
    from paddle_rl.parallel.topology import TopologyError, resolve_degrees
    with pytest.raises(TopologyError, match="tensor_parallel_degree \\(2\\).*world size 1"):
        resolve_degrees(tensor=2, world_size=1)
    with pytest.raises(TopologyError, match="data_parallel_degree \\(2\\) x tensor_parallel_degree"):
        resolve_degrees(tensor=2, data=2, world_size=2)
    assert resolve_degrees(tensor=2, sharding=2, world_size=8) == {"data": 2, "sharding": 2, "pipe": 1, "tensor": 2}


def test_topology_coordinates_and_groups():
    from paddle_rl.parallel.topology import Topology
    topo = Topology({"data": 2, "sharding": 1, "pipe": 2, "tensor": 2}, rank=5)
    assert topo.coords() == {"data": 1, "sharding": 0, "pipe": 0, "tensor": 1}
    assert topo.axis_ranks(("tensor",)) == [4, 5]
    assert topo.axis_ranks(("pipe",)) == [5, 7]
    assert topo.axis_ranks(("data", "sharding")) == [1, 5]


def test_shard_and_unshard_fused_tensors():
    from paddle_rl.models.layers import ParamSpec
    full = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)
    spec = ParamSpec(("q", "k", "v"), True, 1, (4, 4, 4))  # q | k | v
    shards = [spec.shard(full, r, 2) for r in range(2)]
    np.testing.assert_array_equal(shards[0], full[:, [0, 1, 4, 5, 8, 9]])
    np.testing.assert_array_equal(spec.unshard(shards), full)


def test_local_prompt_share_keeps_minibatches():
    from paddle_rl.layouts import BatchGroup
    from paddle_rl.parallel.topology import Topology
    group = BatchGroup(Topology({"data": 2, "sharding": 1, "pipe": 1, "tensor": 1}, rank=1))
    assert group.local_prompt_indices([10, 11, 12, 13, 14, 15, 16, 17], 4) == [12, 13, 16, 17]


def test_data_parallel_through_run_rl(setup, reference, tmp_path):
    """DP=2 launched like a user would (run_rl.py), GRPO: rank 0 alone writes metrics and the checkpoint."""
    out_dir = str(tmp_path / "dp")
    args = [os.path.join(ROOT, "paddle_rl", "run_rl.py"), os.path.join(ROOT, "configs", "tiny_kk_grpo.yaml"),
            *run_overrides(setup["micro"], out_dir, setup["plugin"], eval_datasets="", logging_dir="")]
    launch(args, str(tmp_path / "log"))
    assert_parity(reference["grpo"], out_dir)
    assert not os.path.exists(os.path.join(out_dir, "checkpoint-3", "optimizer.json"))
    assert sorted(f for f in os.listdir(os.path.join(out_dir, "checkpoint-3")) if f.startswith("optimizer")) == [
        "optimizer.rank00000.json", "optimizer.rank00000.safetensors", "optimizer.rank00001.json",
        "optimizer.rank00001.safetensors"]


def test_data_parallel_reinforce_pp_global_whitening(setup, reference):
    out_dir, _ = run_layout(setup, "dp-rpp", algo="reinforce_plus_plus")
    check_parity(setup, reference, out_dir, algo="reinforce_plus_plus")


PPO_CRITIC = dict(kl_coeff=0.02, kl_loss_coeff=0.0, critic_learning_rate=3e-3, clip_range_value=0.2, lam=0.9,
                  critic_warmup_steps=1, per_device_value_batch_size=3)


@pytest.fixture(scope="module")
def ppo_single(setup):
    """The single-process PPO run (actor and critic) the critic's layouts are compared with."""
    single = str(setup["root"] / "single-ppo")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], single, setup["plugin"], rl_algorithm="ppo", **PPO_CRITIC),
                    single, setup["prompts"])
    return single


def critic_parity(single, out_dir):
    """The critic's checkpointed weights against one process's (max relative error, asserted <= REL_TOL), and the
    critic's Adam moment bytes (one process, then each rank)."""
    from paddle_rl.model_files.safetensors_io import load_state
    critic_a, critic_b = (load_state(os.path.join(d, "checkpoint-3", "critic")) for d in (single, out_dir))
    assert set(critic_a) == set(critic_b) and "score.weight" in critic_a
    worst = max(rel_err(critic_a[k], critic_b[k]) for k in critic_a)
    memory = [json.load(open(os.path.join(out_dir, name)))["moments"] for name in sorted(os.listdir(out_dir))
              if name.startswith("critic-memory-rank")]
    alone = json.load(open(os.path.join(single, "critic-memory-rank0.json")))["moments"]
    print(f"{os.path.basename(out_dir)}: max critic weight rel err {worst:.2e}; critic Adam moment bytes: one "
          f"process {alone}, per rank {memory}")
    assert worst <= REL_TOL
    return alone, memory


def test_data_parallel_ppo_with_a_critic(setup, ppo_single):
    """rl_algorithm ppo under DP=2 equals one process: the critic's values, value loss and gradient (summed over the
    batch group with global normalizers), GAE whitening over the global batch, the critic's weights."""
    out_dir, _ = run_layout(setup, "dp-ppo", algo="ppo", **PPO_CRITIC)
    rows = read_rows(out_dir)
    assert rows[0]["actor/critic_warmup"] == 1.0 and rows[2]["critic/vf_loss"] > 0
    check_parity(setup, {"ppo": ppo_single}, out_dir, algo="ppo")
    alone, memory = critic_parity(ppo_single, out_dir)
    assert memory == [alone, alone]  # replicated: each rank holds the whole critic's moments


@pytest.mark.parametrize("degrees", [pytest.param(dict(sharding_parallel_degree=2, sharding="stage1"),
                                                  marks=pytest.mark.slow),
                                     dict(sharding_parallel_degree=2, sharding="stage2"),
                                     dict(tensor_parallel_degree=2),
                                     pytest.param(dict(tensor_parallel_degree=2, sequence_parallel=True),
                                                  marks=pytest.mark.slow)],
                         ids=["sharding1", "sharding2", "tp2", "tp2-sp"])
def test_ppo_critic_sharded_and_tensor_parallel(setup, ppo_single, degrees):
    """The critic on the actor's grid equals one process: sharding stage 1 / 2 (its own GradientSync and sharded
    optimizer: the Adam moments split between the ranks, parameters broadcast from their owners) and tensor
    parallelism (its decoder split with the actor's group, the value head replicated; the checkpoint gathered), also
    with sequence parallelism (the critic's norms' gradients summed over the tensor group by its own GradientSync)."""
    name = "ppo-" + "-".join(f"{k.split('_')[0]}{v}" for k, v in degrees.items())
    out_dir, _ = run_layout(setup, name, algo="ppo", **PPO_CRITIC, **degrees)
    check_parity(setup, {"ppo": ppo_single}, out_dir, algo="ppo")
    alone, memory = critic_parity(ppo_single, out_dir)
    # each rank holds a part of the critic's optimizer state: its shard (sharding) or its tensor split (TP: the
    # norms and the value head whole on both)
    assert max(memory) <= 0.6 * alone, (alone, memory)
    if "sharding" in degrees:
        assert sum(memory) == alone


def test_data_parallel_ppo_one_update_pass(setup):
    """One mini-batch per step (update_iters 1): the critic update's forward gives the rollout values on each rank
    (no value pass), and DP=2 still equals one process."""
    one_pass = dict(PPO_CRITIC, global_mini_batch_size=4)
    single = str(setup["root"] / "single-ppo-one-pass")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], single, setup["plugin"], rl_algorithm="ppo", **one_pass),
                    single, setup["prompts"])
    out_dir, _ = run_layout(setup, "dp-ppo-one-pass", algo="ppo", **one_pass)
    from paddle_rl.monitor import read_metrics
    assert all("time/values" not in r and "time/critic_update" in r
               for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")))
    check_parity(setup, {"ppo": single}, out_dir, algo="ppo")
    critic_parity(single, out_dir)


def critic_adapter_parity(single: str, out_dir: str, label: str) -> None:
    """The LoRA critic of checkpoint-3 (a PEFT adapter with its value head) equals one process's."""
    from paddle_rl.models.lora import read_adapter
    ref, got = (read_adapter(os.path.join(d, "checkpoint-3", "critic")) for d in (single, out_dir))
    assert set(ref) == set(got) and "score.weight" in ref and any("lora_B" in k for k in ref)
    errors = {k: rel_err(ref[k], got[k]) for k in ref}
    worst = max(errors, key=errors.get)
    print(f"{label}: max critic adapter / head rel err {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= REL_TOL, (worst, errors[worst])


@pytest.mark.slow
def test_lora_critic_tensor_parallel(setup):
    """A LoRA critic (adapters + whole value head) under TP=2 equals one process: its adapters and head (read back
    from checkpoint-3/critic, a PEFT adapter) and the actor's merged weights. Slow (20 s): by default LoRA under
    TP=2 (tests/test_lora.py) and the critic under TP=2 (test_ppo_critic_sharded_and_tensor_parallel) run apart."""
    lora = dict(PPO_CRITIC, lora_rank=4, lora_alpha=8, merge_lora="true")
    single = str(setup["root"] / "single-ppo-lora")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], single, setup["plugin"], rl_algorithm="ppo", **lora),
                    single, setup["prompts"])
    out_dir, _ = run_layout(setup, "ppo-lora-tp2", algo="ppo", tensor_parallel_degree=2, **lora)
    assert_parity(single, out_dir)
    critic_adapter_parity(single, out_dir, "ppo-lora-tp2")


def test_pipeline_parallel_ppo_with_a_critic_and_resume(setup, ppo_single):
    """rl_algorithm ppo under PP=2 equals one process: the critic split into the actor's two stages, its values made
    on the last stage and sent to both (GAE on each), its value loss back through the stages on the 1F1B schedule,
    its gradient norm over both stages, its checkpoint gathered from them. Step 3 resumed from checkpoint-2 (each
    stage reading its layers of the actor and the critic, and its optimizer state) ends on the same weights."""
    out_dir, _ = run_layout(setup, "pp-ppo", algo="ppo", pipeline_parallel_degree=2, **PPO_CRITIC)
    rows = read_rows(out_dir)
    assert rows[0]["actor/critic_warmup"] == 1.0 and all(r["critic/vf_loss"] > 0 for r in rows[1:])
    ref = read_rows(ppo_single)
    for key in ("critic/vf_loss", "critic/vpred_mean", "critic/values_mean", "advantage/mean", "advantage/std"):
        errors = [abs(a[key] - b[key]) / max(abs(a[key]), abs(b[key]), 1e-2) for a, b in zip(ref, rows)]
        print(f"pp-ppo: {key} rel err {max(errors):.2e}")
        assert max(errors) <= REL_TOL, (key, errors)
    check_parity(setup, {"ppo": ppo_single}, out_dir, algo="ppo")
    alone, memory = critic_parity(ppo_single, out_dir)
    assert sum(memory) == alone and max(memory) < alone  # each stage holds its layers' moments
    resumed, _ = run_layout(setup, "pp-ppo-resumed", algo="ppo", pipeline_parallel_degree=2, **PPO_CRITIC,
                            resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    assert [r["step"] for r in read_rows(resumed)] == [3]
    from paddle_rl.model_files.safetensors_io import load_state
    for folder in ("", "critic"):
        wa, wb = (load_state(os.path.join(d, "checkpoint-3", folder)) for d in (out_dir, resumed))
        assert set(wa) == set(wb)
        worst = max(rel_err(wa[k], wb[k]) for k in wa)
        print(f"pp-ppo resumed at step 3: max {folder or 'actor'} weight rel err {worst:.2e}")
        assert worst == 0.0, (folder, worst)


def test_data_parallel_adaptive_kl_counts_the_global_batch(setup):
    """adaptive_kl under DP=2: the controller moves by the sequences of the global batch, as one process does
    (counting a rank's own share would move it batch_degree times slower)."""
    adaptive = dict(adaptive_kl=True, kl_horizon=50)   # the micro model's reward KL is far below kl_target
    single = str(setup["root"] / "single-rpp-adaptive-kl")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], single, setup["plugin"], rl_algorithm="reinforce_plus_plus",
                                  kl_coeff=0.02, kl_loss_coeff=0.0, **adaptive), single, setup["prompts"])
    out_dir, _ = run_layout(setup, "dp-rpp-adaptive-kl", algo="reinforce_plus_plus", **adaptive)
    ref_coeff = [r["actor/reward_kl_coeff"] for r in read_rows(single)]
    par_coeff = [r["actor/reward_kl_coeff"] for r in read_rows(out_dir)]
    # each step: error clip(kl / 0.1 - 1) = -0.2 over 16 sequences -> coeff *= 1 - 0.2 * 16 / 50
    np.testing.assert_allclose(ref_coeff, [0.02 * 0.936 ** k for k in (1, 2, 3)], rtol=1e-9)
    np.testing.assert_allclose(par_coeff, ref_coeff, rtol=1e-9)
    check_parity(setup, {"reinforce_plus_plus": single}, out_dir, algo="reinforce_plus_plus")


def test_data_parallel_dynamic_sampling_agrees_with_one_process(setup):
    """DAPO dynamic sampling under DP2: the ranks see every rank's groups, agree on the generation rounds and keep
    the groups one process keeps (each then trains on its share)."""
    extra = dict(reward_funcs="some_groups_flat", dynamic_sampling=True, max_gen_batches=3,
                 dynamic_sampling_fallback="keep")
    single = str(setup["root"] / "single-dynamic")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], single, setup["plugin"], **extra), single, setup["prompts"])
    rows = read_rows(single)
    assert max(r["batch/gen_rounds"] for r in rows) > 1, "the reward must leave some groups flat"
    out_dir, _ = run_layout(setup, "dp-dynamic", **extra)
    assert [r["batch/gen_rounds"] for r in read_rows(out_dir)] == [r["batch/gen_rounds"] for r in rows]
    check_parity(setup, {"grpo": single}, out_dir)


def test_data_parallel_grpo_reward_kl_with_equal_score_groups(tmp_path):
    """GRPO with the KL in the reward (adaptive_kl, kl_coeff 0.05) on the arithmetic default, whose groups are
    often all right or all wrong: at step 1 the reward KL of old vs reference is rounding (~1e-8, rounded
    differently by each layout's passes), which the group std turned into advantages of unit size; one process and
    DP2 then differed by 0.5% in grad_norm at step 1 and sampled different responses from step 2. An equal-score
    group now gets the centered penalty, not divided by its std (algorithms/advantages.py), and the layouts agree."""
    arith = os.path.join(ROOT, "data", "tiny_arith")
    keys = [f"actor_model_name_or_path={arith}/model", f"train_datasets={arith}/arith/train.jsonl",
            "eval_datasets=", "logging_dir=", "report_to=none", "do_eval=false", "max_steps=3",
            "global_batch_size=8", "global_mini_batch_size=8", "kl_coeff=0.05", "adaptive_kl=true"]
    config = os.path.join(ROOT, "configs", "tiny_arith_grpo.yaml")
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    from paddle_rl.config import load_config
    from paddle_rl.trainer import RLTrainer
    RLTrainer(load_config(config, keys + [f"output_dir={single}"])).train()
    launch([os.path.join(ROOT, "paddle_rl", "run_rl.py"), config, *keys, f"output_dir={dp}",
            "data_parallel_degree=2"], str(tmp_path / "log"))
    ref, par = read_rows(single), read_rows(dp)
    # step 1: the policy is the reference, the KL is rounding, of either sign (-1.8e-9 on an AVX2-only AMD EPYC)
    assert 0 < abs(ref[0]["actor/reward_kl"]) < 1e-6
    for key in ("reward/mean", "reward/accuracy", "response_length/mean"):  # the same samples, step after step
        assert [r[key] for r in par] == [r[key] for r in ref], key
    assert_parity(single, dp)


def test_tensor_parallel(setup, reference):
    out_dir, _ = run_layout(setup, "tp", tensor_parallel_degree=2)
    check_parity(setup, reference, out_dir)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tensor_parallel_sequence_parallel(setup, reference, packed):
    """tensor 2 with `sequence_parallel` through the trainer (3 RL steps: the shared-prompt or packed passes, the
    norms' gradients summed over the tensor group, AdamW, clipping, the rollout on the same model) equals one
    process; tests/test_sequence_parallel.py checks the gradients themselves and breaks the collectives."""
    extra = dict(use_remove_padding=True) if packed else {}
    out_dir, _ = run_layout(setup, "tp-sp-packed" if packed else "tp-sp", tensor_parallel_degree=2,
                            sequence_parallel=True, **extra)
    check_parity(setup, reference, out_dir)
    with open(os.path.join(out_dir, "log", "workerlog.0"), errors="replace") as f:
        assert "tensor 2 (sequence parallel)" in f.read()


@pytest.mark.slow
def test_tensor_parallel_bf16_with_recomputed_attention(setup):
    """bf16 under core_attn_mlp recomputes each attention block from its input's bfloat16 rounding, a second
    forward and a nested backward through the column and row layers' collectives: under tensor parallelism the run
    is the run that keeps the blocks' activations, bit for bit (bf16 against one process differs at bf16's rounding,
    a sum's order moving an operand across a rounding boundary). Slow (27 s): by default the same recompute runs in
    one process (tests/test_lengths_training.py::test_bf16_recomputes_attention_from_its_bfloat16_operand) and bf16
    under TP=2 without it (tests/test_bf16.py::test_tensor_parallel_layers_take_the_bf16_products)."""
    keys = dict(bf16=True, recompute=True, use_remove_padding=True, tensor_parallel_degree=2)
    kept, _ = run_layout(setup, "tp-bf16-kept", recompute_granularity="core_attn", **keys)
    recomputed, _ = run_layout(setup, "tp-bf16-recompute", recompute_granularity="core_attn_mlp", **keys)
    errors = compare_runs(kept, recomputed)
    assert max(errors.values()) == 0.0, max(errors, key=errors.get)
    np.testing.assert_array_equal(np.load(os.path.join(recomputed, "greedy.npy")),
                                  np.load(os.path.join(kept, "greedy.npy")))


def test_sharding_stage1_halves_optimizer_state(setup, reference):
    out_dir, _ = run_layout(setup, "sharding1", sharding_parallel_degree=2, sharding="stage1")
    memory = check_parity(setup, reference, out_dir)
    single = json.load(open(os.path.join(reference["grpo"], "memory-rank0.json")))
    print(f"Adam moments: one process {single['moments']} bytes; sharding stage1 x2 "
          f"{[m['moments'] for m in memory]} bytes per rank")
    assert sum(m["moments"] for m in memory) == single["moments"]
    assert max(m["moments"] for m in memory) <= 0.6 * single["moments"]


def test_sharding_stage2_and_resume(setup, reference):
    out_dir, _ = run_layout(setup, "sharding2", sharding_parallel_degree=2, sharding="stage2")
    memory = check_parity(setup, reference, out_dir)
    single = json.load(open(os.path.join(reference["grpo"], "memory-rank0.json")))
    print(f"Adam moments: one process {single['moments']} bytes; sharding stage2 x2 "
          f"{[m['moments'] for m in memory]} bytes per rank")
    assert sum(m["moments"] for m in memory) == single["moments"]
    assert max(m["moments"] for m in memory) <= 0.6 * single["moments"]
    # resume step 3 from checkpoint-2 (gathered weights + each rank's optimizer shard): same final weights
    resumed, _ = run_layout(setup, "sharding2-resumed", sharding_parallel_degree=2, sharding="stage2",
                            resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    assert [r["step"] for r in read_rows(resumed)] == [3]
    wa, wb = weights(out_dir), weights(resumed)
    assert max(rel_err(wa[k], wb[k]) for k in wa) == 0.0


def test_pipeline_parallel(setup, reference):
    out_dir, _ = run_layout(setup, "pp", pipeline_parallel_degree=2)
    check_parity(setup, reference, out_dir)


def test_rollout_resharded_to_two_ranks_from_data_parallel(setup, reference):
    out_dir, _ = run_layout(setup, "dp-rollout-tp2", rollout_tensor_parallel_degree=2)
    check_parity(setup, reference, out_dir)


def test_rollout_gathered_from_tensor_parallel(setup, reference):
    out_dir, _ = run_layout(setup, "tp-rollout-tp1", tensor_parallel_degree=2, rollout_tensor_parallel_degree=1)
    check_parity(setup, reference, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name,degrees", [
    ("tp2-pp2", dict(tensor_parallel_degree=2, pipeline_parallel_degree=2)),
    ("sharding2-tp2-stage2", dict(tensor_parallel_degree=2, sharding_parallel_degree=2, sharding="stage2")),
])
def test_four_process_layouts(setup, reference, name, degrees):
    """Two axes at once on 4 processes (slow on 2 cores)."""
    out_dir, _ = run_layout(setup, name, nproc=4, **degrees)
    check_parity(setup, reference, out_dir)


def model_variant(setup, name, model):
    """Save `model` (a change of the micro model) with the micro tokenizer as `name`, and run it in one process:
    (setup with that model, the single-process reference run)."""
    from paddle_rl.models.pretrained import copy_tokenizer_files, save_model, write_generation_config
    folder = str(setup["root"] / f"{name}-model")
    save_model(model, folder)
    copy_tokenizer_files(setup["micro"]["model"], folder)
    write_generation_config(folder, setup["micro"]["tokenizer"].eos_token_ids, setup["micro"]["tokenizer"].pad_token_id)
    variant = dict(setup, micro=dict(setup["micro"], model=folder))
    out_dir = str(setup["root"] / f"single-{name}")
    os.makedirs(out_dir, exist_ok=True)
    train_and_probe(run_overrides(variant["micro"], out_dir, setup["plugin"]), out_dir, setup["prompts"])
    return variant, {"grpo": out_dir}


@pytest.fixture(scope="module")
def tied(setup):
    """The micro model with tied input / output embeddings, and its single-process run."""
    from paddle_rl.models import CausalLM, ModelConfig, load_model
    config = ModelConfig.from_pretrained(setup["micro"]["model"])
    config.tie_word_embeddings = True
    untied = load_model(setup["micro"]["model"])
    model = CausalLM(config)
    state = {n: p.numpy() for n, p in untied.named_parameters() if n != "lm_head.weight"}
    for name, param in model.named_parameters():
        param.set_value(state[name])
    return model_variant(setup, "tied", model)


@pytest.mark.parametrize("name,degrees", [("tied-pp", dict(pipeline_parallel_degree=2)),
                                          ("tied-tp", dict(tensor_parallel_degree=2))])
def test_tied_embeddings(tied, name, degrees):
    """Tied embeddings: a vocabulary-parallel table used twice under TP; a copy on the last stage under PP."""
    tied_setup, reference = tied
    out_dir, _ = run_layout(tied_setup, name, **degrees)
    check_parity(tied_setup, reference, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tied", "lora", "one-pass"])
def test_pipeline_parallel_ppo_variants(setup, tied, variant):
    """PPO under PP=2 equals one process with a tied-embedding model (the critic's last stage holds no copy of the
    table: its value head does not read it), with a LoRA critic (adapters on each stage, the value head whole on
    the last; saved as a PEFT adapter gathered from both stages) and with one update pass per step (the critic
    update's forward gives the rollout values on the last stage, which sends them to the first)."""
    base, extra = {"tied": (tied[0], dict(PPO_CRITIC)),
                   "lora": (setup, dict(PPO_CRITIC, lora_rank=4, lora_alpha=8, merge_lora="true")),
                   "one-pass": (setup, dict(PPO_CRITIC, global_mini_batch_size=4))}[variant]
    single = str(setup["root"] / f"single-ppo-{variant}")
    os.makedirs(single, exist_ok=True)
    train_and_probe(run_overrides(base["micro"], single, setup["plugin"], rl_algorithm="ppo", **extra), single,
                    setup["prompts"])
    out_dir, _ = run_layout(base, f"pp-ppo-{variant}", algo="ppo", pipeline_parallel_degree=2, **extra)
    assert_parity(single, out_dir)
    if variant == "one-pass":
        from paddle_rl.monitor import read_metrics
        assert all("time/values" not in r and "time/critic_update" in r
                   for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")))
    if variant != "lora":
        critic_parity(single, out_dir)
        return
    critic_adapter_parity(single, out_dir, "pp-ppo-lora")


@pytest.fixture(scope="module")
def odd_vocab(setup):
    """The micro model with one more (never used) vocabulary entry, so the vocabulary (odd) does not divide
    tensor_parallel_degree 2, and its single-process run."""
    from paddle_rl.models import CausalLM, ModelConfig, load_model
    config = ModelConfig.from_pretrained(setup["micro"]["model"])
    if config.vocab_size % 2 == 0:
        config.vocab_size += 1
    base = load_model(setup["micro"]["model"])
    model = CausalLM(config)
    rng = np.random.default_rng(0)
    for (name, param), (_, old) in zip(model.named_parameters(), base.named_parameters()):
        value = old.numpy()
        if list(value.shape) != list(param.shape):  # the extra embedding row / head column
            axis = [a for a in range(value.ndim) if value.shape[a] != param.shape[a]][0]
            extra = rng.normal(0, 0.02, size=[1 if a == axis else value.shape[a] for a in range(value.ndim)])
            value = np.concatenate([value, extra.astype(value.dtype)], axis=axis)
        param.set_value(value)
    return (*model_variant(setup, "odd-vocab", model), config.vocab_size)


def test_tensor_parallel_pads_an_indivisible_vocabulary(odd_vocab):
    """Vocabulary 2k+1 under tensor_parallel_degree 2: each rank holds k+1 rows (Megatron's padding); the padded
    id is never sampled and never enters log-probs or entropy, so the run equals one process."""
    odd_setup, reference, vocab = odd_vocab
    assert vocab % 2 == 1
    out_dir, _ = run_layout(odd_setup, "odd-vocab-tp", tensor_parallel_degree=2)
    check_parity(odd_setup, reference, out_dir)
    assert weights(out_dir)["model.embed_tokens.weight"].shape[0] == vocab


@pytest.fixture(scope="module")
def moe(setup):
    """The micro model with Qwen2-MoE blocks (4 experts, top-2, a shared expert) in place of its MLPs and the
    load-balancing loss in the training loss (output_router_logits), and its single-process run."""
    from paddle_rl.models import CausalLM, ModelConfig, load_model
    import paddle
    base = load_model(setup["micro"]["model"])
    data = dict(base.config.to_hf_dict(), model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=True,
                output_router_logits=True, router_aux_loss_coef=0.05)
    model = CausalLM(ModelConfig.from_dict(data))
    paddle.seed(4)
    model.init_weights(0.1)
    state = dict(base.named_parameters())
    for name, param in model.named_parameters():
        if name in state:
            param.set_value(state[name].numpy())
        elif name.endswith("mlp.gate"):  # routers far from uniform: no near-ties between the top-k
            param.set_value(paddle.normal(0.0, 1.0, param.shape))
    return model_variant(setup, "moe", model)


def test_tensor_parallel_mixture_of_experts(moe):
    """Qwen2-MoE under tensor_parallel_degree 2: every expert's intermediate dimension split over the ranks, one
    sum per block; routers, the load-balancing loss (logged as actor/router_aux_loss) and the run equal one
    process."""
    moe_setup, reference = moe
    out_dir, _ = run_layout(moe_setup, "moe-tp", tensor_parallel_degree=2)
    check_parity(moe_setup, reference, out_dir)
    assert all(r["actor/router_aux_loss"] > 0 for r in read_rows(out_dir))


# --------------------------------------------------------------------------------------------- worker

def _worker(spec_path):
    from paddle_rl.env import configure_threads
    configure_threads()
    with open(spec_path) as f:
        spec = json.load(f)
    train_and_probe(spec["overrides"], spec["out_dir"], spec["prompts"])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    _worker(sys.argv[2])
    # every output is written and the ranks passed a final barrier: leave without the interpreter's teardown,
    # where 2-process gloo workers now and then abort (see run_rl.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""PPO with a critic under sharding stage 3 (`sharding: stage3`, sharding_parallel_degree 2) on 2 real processes
(gloo) equals one process.

The runs train the bundled tiny arithmetic model (data/tiny_arith/model) with configs/tiny_arith_ppo.yaml's settings,
cut to 3 steps of 4 prompts x 4 samples: the actor and the critic (started from the actor's decoder with a zero value
head) partitioned over the two ranks. The config's one update pass per step (one mini-batch, update_iters 1) makes
the critic's update give the rollout's values itself (`Critic.update_from_rollout`); the slow cases add the separate
value pass, micro-batches by a token budget (idle passes), a resume, and perturbed collectives. Tolerances are
tests/test_parallel.py's (losses and weights 1e-5 relative, other statistics 1e-4). This file is also the worker
the runs launch.
"""
import json
import os
import resource
import sys

import numpy as np
import pytest

from test_parallel import REL_TOL, STAT_TOL, launch, read_rows, rel_err, weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_arith_ppo.yaml")
# the config's settings, cut to a few small steps; share_prompt_prefix false as stage 3 needs on padded micro-batches
# (the single-process run too); adam_epsilon 1e-6 as the other parity runs (it damps Adam's amplification of
# rounding noise in gradients that are zero in exact arithmetic: docs/parallelism.md)
TINY = os.path.join(ROOT, "data", "tiny_arith")
KEYS = dict(actor_model_name_or_path=os.path.join(TINY, "model"),
            train_datasets=os.path.join(TINY, "arith", "train.jsonl"),
            eval_datasets=os.path.join(TINY, "arith", "test.jsonl"), max_steps=3, global_batch_size=4,
            global_mini_batch_size=4, rollout_n=4,
            per_device_train_batch_size=8, per_device_logprob_batch_size=8, critic_warmup_steps=1, do_eval=False,
            save_steps=2, report_to="none", disable_tqdm=True, adam_epsilon=1e-6, share_prompt_prefix=False)
STAGE3 = dict(sharding_parallel_degree=2, sharding="stage3")
LOSSES = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/vpred_mean",
          "critic/grad_norm", "critic/values_mean")


def overrides(out_dir, **extra):
    values = dict(KEYS, output_dir=out_dir, logging_dir=os.path.join(out_dir, "logs"))
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def run(root, name, nproc=1, perturb="", **extra):
    """One run (in this process for nproc 1, else launched on `nproc` gloo processes); its output folder."""
    out_dir = str(root / name)
    os.makedirs(out_dir, exist_ok=True)
    spec = {"overrides": overrides(out_dir, **extra), "out_dir": out_dir, "perturb": perturb}
    if nproc == 1:
        _train(spec)
        return out_dir
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    launch([os.path.abspath(__file__), "--worker", spec_path], os.path.join(out_dir, "log"), nproc=nproc)
    return out_dir


def critic_weights(out_dir, step=3):
    from paddle_rl.model_files.safetensors_io import load_state
    return load_state(os.path.join(out_dir, f"checkpoint-{step}", "critic"))


def errors(ref_dir, out_dir):
    """{metric or tensor: relative error} of every logged float and every weight of the actor and the critic."""
    ref, par = read_rows(ref_dir), read_rows(out_dir)
    assert [r["step"] for r in par] == [r["step"] for r in ref] == [1, 2, 3]
    out = {}
    for a, b in zip(ref, par):
        assert set(a) == set(b), set(a) ^ set(b)
        for k in a:
            if isinstance(a[k], float):
                out[f"step{a['step']}/{k}"] = abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-2)
    for label, read in (("actor", weights), ("critic", critic_weights)):
        wa, wb = read(ref_dir), read(out_dir)
        assert set(wa) == set(wb) and wa
        out.update({f"{label}:{k}": rel_err(wa[k], wb[k]) for k in wa})
    return out


def check_parity(ref_dir, out_dir):
    """Losses, values and weights within REL_TOL, other statistics within STAT_TOL, greedy tokens identical."""
    errs = errors(ref_dir, out_dir)
    groups = {"loss": {k: v for k, v in errs.items() if k.split("/", 1)[-1] in LOSSES},
              "actor weight": {k: v for k, v in errs.items() if k.startswith("actor:")},
              "critic weight": {k: v for k, v in errs.items() if k.startswith("critic:")}}
    groups["statistic"] = {k: v for k, v in errs.items() if not any(k in g for g in groups.values())}
    worst = {name: max(g, key=g.get) for name, g in groups.items()}
    print(f"{os.path.basename(out_dir)}: " + ", ".join(f"max {name} rel err {errs[k]:.2e} ({k})"
                                                       for name, k in worst.items()))
    for name in ("loss", "actor weight", "critic weight"):
        assert errs[worst[name]] <= REL_TOL, (worst[name], errs[worst[name]])
    assert errs[worst["statistic"]] <= STAT_TOL, (worst["statistic"], errs[worst["statistic"]])
    assert all(r["critic/vf_loss"] > 0 for r in read_rows(out_dir))
    np.testing.assert_array_equal(np.load(os.path.join(out_dir, "greedy.npy")),
                                  np.load(os.path.join(ref_dir, "greedy.npy")))


def held(out_dir):
    return [json.load(open(os.path.join(out_dir, name))) for name in sorted(os.listdir(out_dir))
            if name.startswith("held-rank")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("stage3-critic")


@pytest.fixture(scope="module")
def single(root):
    return run(root, "single")


def test_stage3_ppo_with_a_critic_equals_one_process(root, single):
    """The config's one update pass per step (the critic's update gives the rollout's values): the actor's and the
    critic's losses, the values, both models' weights after 3 steps and the greedy tokens equal one process; each rank
    holds half of the critic's parameters (and of its Adam moments) between passes, nothing gathered after the run."""
    rows = read_rows(single)
    assert all("critic/vf_loss" in r for r in rows)
    out_dir = run(root, "stage3", nproc=2, **STAGE3)
    check_parity(single, out_dir)
    parts = held(out_dir)
    total = parts[0]["critic_bytes"]
    print(f"stage3 x2: critic parameter bytes held per rank {[p['critic']['shards'] for p in parts]} of {total}; "
          f"Adam moments {[p['critic_moments'] for p in parts]}; actor {[p['actor']['shards'] for p in parts]} of "
          f"{parts[0]['actor_bytes']}")
    assert all(p["critic"]["whole"] == 0 and p["actor"]["whole"] == 0 for p in parts)
    assert all(p["critic"]["shards"] <= 0.51 * total for p in parts)
    assert sum(p["critic"]["shards"] for p in parts) >= total
    assert all(p["critic_moments"] <= 2 * 0.51 * total for p in parts)
    alone = held(single)[0]
    assert alone["critic_moments"] == 2 * total   # one process: both moments of every critic parameter


@pytest.mark.slow
def test_stage3_value_pass_and_token_budget(root):
    """Two mini-batches per step (the critic's separate value pass, then its update) with padded micro-batches under
    a token budget: the ranks form different numbers of micro-batches and the one with fewer runs idle passes in the
    value, log-prob and update passes; the run equals one process."""
    keys = dict(global_mini_batch_size=2, per_device_value_batch_size=3, max_tokens_per_micro_batch=114)
    alone = run(root, "single-budget", **keys)
    assert all("time/values" in r for r in _timed_rows(alone))
    out_dir = run(root, "stage3-budget", nproc=2, **STAGE3, **keys)
    check_parity(alone, out_dir)
    parts = held(out_dir)
    idle = [p["critic"]["idle_passes"] for p in parts]
    print(f"stage3 value pass + budget: the critic's idle passes per rank {idle} (all models: "
          f"{[p['idle_passes'] for p in parts]})")
    assert sum(idle) > 0


@pytest.mark.slow
def test_stage3_ppo_resume_equals_uninterrupted(root):
    """Step 3 resumed from checkpoint-2 (both models' gathered weights taken back into slices, each rank's optimizer
    slices of both) ends on the uninterrupted run's weights, bit for bit."""
    full = run(root, "stage3-full", nproc=2, **STAGE3)
    resumed = run(root, "stage3-resumed", nproc=2, **STAGE3, resume_from_checkpoint=os.path.join(full, "checkpoint-2"))
    assert [r["step"] for r in read_rows(resumed)] == [3]
    for read in (weights, critic_weights):
        wa, wb = read(full), read(resumed)
        assert max(rel_err(wa[k], wb[k]) for k in wa) == 0.0


@pytest.mark.slow
def test_stage3_lora_critic(root):
    """LoRA on the actor and the critic (the frozen bases partitioned with the adapters; the critic's value head
    trained whole, in slices): the losses, the actor's merged weights, and the critic's adapters and head (a PEFT
    adapter in checkpoint-3/critic) equal one process."""
    from paddle_rl.models.lora import read_adapter
    keys = dict(lora_rank=4, lora_alpha=8, merge_lora="true")
    alone = run(root, "single-lora", **keys)
    out_dir = run(root, "stage3-lora", nproc=2, **STAGE3, **keys)
    ref, par = read_rows(alone), read_rows(out_dir)
    worst = max(abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-2) for a, b in zip(ref, par) for k in a
                if k in LOSSES)
    wa, wb = weights(alone), weights(out_dir)
    actor = max(rel_err(wa[k], wb[k]) for k in wa)
    ca, cb = (read_adapter(os.path.join(d, "checkpoint-3", "critic")) for d in (alone, out_dir))
    assert set(ca) == set(cb) and any("lora_B" in k for k in ca) and any("score" in k for k in ca)
    critic = max(rel_err(ca[k], cb[k]) for k in ca)
    print(f"stage3 LoRA: max loss rel err {worst:.2e}, actor merged weights {actor:.2e}, critic adapters {critic:.2e}")
    assert worst <= REL_TOL and actor <= REL_TOL and critic <= REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("perturb", ["gather", "reduce"])
def test_stage3_critic_parity_fails_when_its_collective_is_perturbed(root, single, perturb):
    """Only the critic's collectives broken (the actor's untouched): each rank using its own slice in place of its
    peer's when gathering the critic (gather), or the critic's gradient slices left unsummed (reduce), moves the
    critic's weights far beyond the tolerance."""
    out_dir = run(root, f"stage3-perturbed-{perturb}", nproc=2, perturb=perturb, **STAGE3)
    wa, wb = critic_weights(single), critic_weights(out_dir)
    worst = max(rel_err(wa[k], wb[k]) for k in wa)
    print(f"critic {perturb} perturbed: max critic weight rel err {worst:.2e}")
    assert worst > 1e-3


@pytest.mark.slow
def test_stage3_critic_memory_against_stage2(root):
    """A 19M-parameter variant of the tiny arithmetic model (hidden 512, intermediate 1024, 8 layers; random
    weights), one PPO step at sharding 2 under stage 2 and stage 3: each rank's parameter bytes of the actor and of
    the critic between passes (stage 3: half of each), the critic's Adam moments, the most gathered at once inside a
    pass, and each rank's peak RSS (printed for docs/parallelism.md)."""
    import paddle
    from paddle_rl.models import CausalLM, ModelConfig
    from paddle_rl.models.pretrained import copy_tokenizer_files, save_model, write_generation_config
    base = os.path.join(TINY, "model")
    config = ModelConfig.from_dict(dict(ModelConfig.from_pretrained(base).to_hf_dict(), hidden_size=512,
                                        intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                                        num_key_value_heads=4, head_dim=64))
    paddle.seed(7)
    model = CausalLM(config)
    model.init_weights()
    folder = str(root / "wide-model")
    save_model(model, folder)
    copy_tokenizer_files(base, folder)
    write_generation_config(folder, [config.eos_token_id], config.pad_token_id)
    del model
    rows = {}
    for stage in ("stage2", "stage3"):
        out_dir = run(root, f"memory-{stage}", nproc=2, sharding_parallel_degree=2, sharding=stage, max_steps=1,
                      save_steps=100, actor_model_name_or_path=folder)
        rows[stage] = held(out_dir)
    total = rows["stage2"][0]["critic_bytes"]
    for stage, parts in rows.items():
        print(f"{stage}: actor {parts[0]['actor_bytes']} bytes, critic {total} bytes; per rank between passes: actor "
              f"{[p.get('actor', {}).get('shards', p['actor_bytes']) for p in parts]}, critic "
              f"{[p.get('critic', {}).get('shards', total) for p in parts]}; critic Adam moments "
              f"{[p['critic_moments'] for p in parts]}; most whole inside a pass "
              f"{[p.get('critic', {}).get('pass_peak_whole', '-') for p in parts]}; peak RSS "
              f"{[p['peak_rss'] for p in parts]}")
    assert all(p["critic"]["shards"] <= 0.501 * total and p["critic"]["whole"] == 0 for p in rows["stage3"])
    assert max(p["critic"]["pass_peak_whole"] for p in rows["stage3"]) < 0.5 * total


def _timed_rows(out_dir):
    from paddle_rl.monitor import read_metrics
    return read_metrics(os.path.join(out_dir, "metrics.jsonl"))


# --------------------------------------------------------------------------------------------- worker

def _perturb(kind):
    """Break one of the critic's stage-3 collectives on purpose (its parameters are named critic_*: Critic builds
    them under that name prefix); the actor's and the reference's stay intact."""
    import paddle
    from paddle_rl.parallel import partitioned as P

    def critic(unit):
        return any(part.param.name.startswith("critic_") for part in unit.parts)
    if kind == "gather":
        gather = P.PartitionedParams._all_gather

        def own_only(self, unit):
            if not critic(unit):
                return gather(self, unit)
            with paddle.no_grad():
                for part in unit.parts:
                    whole = paddle.concat([part.shard.detach()] * self.degree)[:part.numel].reshape(part.param.shape)
                    part.param.get_tensor()._share_data_with(whole.get_tensor())
            self._count(unit, +1)
        P.PartitionedParams._all_gather = own_only
    elif kind == "reduce":
        scatter = P.PartitionedParams._reduce_scatter

        def unsummed(self, unit):
            if not critic(unit):
                return scatter(self, unit)
            reduce = P.dist.reduce
            P.dist.reduce = lambda tensor, dst, group=None: None
            try:
                scatter(self, unit)
            finally:
                P.dist.reduce = reduce
        P.PartitionedParams._reduce_scatter = unsummed


def _train(spec):
    """Train, decode a few held-out prompts greedily on the same layout (rank 0 writes greedy.npy) and write each
    rank's parameter bytes (held-rank<r>.json)."""
    from paddle_rl.config import load_config
    from paddle_rl.rollout import SamplingParams
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(CONFIG, spec["overrides"]))
    trainer.train()
    with open(os.path.join(TINY, "arith", "test.jsonl"), encoding="utf-8") as f:
        prompts = [trainer.tokenizer.encode(json.loads(line)["src"]) for line in f.readlines()[:4]]
    params = SamplingParams(max_dec_len=12, temperature=0.0, stop_token_ids=trainer.stop_ids)
    out = trainer.layout.generate(trainer.engine, prompts, 1, params, None)
    layout, critic = trainer.layout, trainer.critic
    info = {"actor_bytes": sum(int(np.prod(p.shape)) * 4 for p in trainer.actor.parameters()),
            "critic_bytes": sum(int(np.prod(p.shape)) * 4 for p in critic.model.parameters()),
            "critic_moments": layout.optimizer_state_bytes(critic.optimizer)["moments"],
            "idle_passes": getattr(layout, "idle_passes", 0),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if hasattr(layout, "held_bytes"):
        info.update(actor=layout.held_bytes(trainer.actor), critic=layout.held_bytes(critic.model))
    with open(os.path.join(spec["out_dir"], f"held-rank{layout.rank}.json"), "w") as f:
        json.dump(info, f)
    if layout.rank == 0:
        np.save(os.path.join(spec["out_dir"], "greedy.npy"), out.response_ids * (out.response_mask > 0))
    layout.barrier()


def _worker(spec_path):
    from paddle_rl.env import configure_threads
    configure_threads()
    with open(spec_path) as f:
        spec = json.load(f)
    _perturb(spec.get("perturb", ""))
    _train(spec)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

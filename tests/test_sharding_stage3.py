"""Sharding stage 3 (`sharding: stage3`, parameters partitioned) on 2 real processes (gloo) equals one process.

The micro model trains 3 RL steps as in tests/test_parallel.py (its helpers and tolerances); each rank keeps half of
every parameter between passes. The runs use `share_prompt_prefix: false` (stage 3 refuses the padded prompt-sharing
pass: see layouts/partitioned.py), the single-process run too. This file is also the worker the runs launch.
"""
import json
import os
import resource
import sys

import numpy as np
import pytest

from test_parallel import check_parity, compare_runs, launch, read_rows, rel_err, run_overrides, train_and_probe, \
    weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = dict(share_prompt_prefix=False)


@pytest.fixture(scope="module")
def stage3_setup(micro, tmp_path_factory):
    from test_parallel import PLUGIN, greedy_prompts
    root = tmp_path_factory.mktemp("stage3")
    plugin = root / "parity_reward.py"
    plugin.write_text(PLUGIN)
    return {"micro": micro, "root": root, "plugin": str(plugin), "prompts": greedy_prompts(micro)}


@pytest.fixture(scope="module")
def single(stage3_setup):
    """The single-process run with the same keys."""
    out_dir = str(stage3_setup["root"] / "single")
    os.makedirs(out_dir, exist_ok=True)
    train_and_probe(run_overrides(stage3_setup["micro"], out_dir, stage3_setup["plugin"], rl_algorithm="grpo",
                                  **KEYS), out_dir, stage3_setup["prompts"])
    return {"grpo": out_dir}


def run_stage3(setup, name, perturb="", nproc=2, **extra):
    out_dir = str(setup["root"] / name)
    os.makedirs(out_dir, exist_ok=True)
    keys = dict(KEYS, rl_algorithm="grpo", sharding_parallel_degree=2, sharding="stage3")
    keys.update(extra)
    spec = {"overrides": run_overrides(setup["micro"], out_dir, setup["plugin"], **keys), "out_dir": out_dir,
            "prompts": setup["prompts"], "perturb": perturb}
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    launch([os.path.abspath(__file__), "--worker", spec_path], os.path.join(out_dir, "log"), nproc=nproc)
    return out_dir


def held(out_dir):
    return [json.load(open(os.path.join(out_dir, name))) for name in sorted(os.listdir(out_dir))
            if name.startswith("params-rank")]


def test_stage3_refuses_what_it_cannot_run_by_name(micro, tmp_path):
    """The keys stage 3 cannot follow stop the run before any model loads, each named with its reason."""
    from paddle_rl.config import load_config
    from paddle_rl.layouts import Partitioned, build_layout
    from paddle_rl.parallel.topology import Topology, TopologyError
    topo = Topology({"data": 1, "sharding": 2, "pipe": 1, "tensor": 1}, rank=0, sharding_stage=3)
    layout = build_layout(topo)
    assert isinstance(layout, Partitioned)

    def config(rl_algorithm="grpo", **keys):
        return load_config(None, run_overrides(micro, str(tmp_path), "", rl_algorithm=rl_algorithm,
                                               sharding_parallel_degree=2, sharding="stage3", **keys))
    layout.check_config(config(**KEYS))  # accepted
    layout.check_config(config(use_remove_padding=True))  # packed: prompts shared in one pass
    for keys, message in ((dict(), "share_prompt_prefix: true runs the layers a second time"),
                          (dict(KEYS, bf16=True), "bf16: true keeps bfloat16 copies"),
                          (dict(KEYS, fp16=True), "fp16: true unscales"),
                          (dict(KEYS, recompute=True), "recompute_granularity: full reruns a layer")):
        with pytest.raises(TopologyError, match="sharding: stage3: " + message):
            layout.check_config(config(**keys))
    layout.check_config(config(**KEYS, rl_algorithm="ppo"))  # a critic: partitioned too (test_sharding_stage3_critic.py)


def test_stage3_equals_one_process(stage3_setup, single):
    """Losses, statistics, the gathered checkpoint's weights and greedy tokens equal one process; each rank holds
    half of the parameters (and half of the Adam moments) between passes."""
    out_dir = run_stage3(stage3_setup, "stage3")
    memory = check_parity(stage3_setup, single, out_dir)
    alone = json.load(open(os.path.join(single["grpo"], "memory-rank0.json")))
    assert sum(m["moments"] for m in memory) >= alone["moments"]          # padding to an even size per tensor
    assert max(m["moments"] for m in memory) <= 0.52 * alone["moments"]
    parts = held(out_dir)
    total = parts[0]["model_bytes"]
    print(f"stage3 x2: parameter bytes held between passes per rank {[p['shards'] for p in parts]} of {total}")
    assert all(p["whole"] == 0 for p in parts)                           # nothing left gathered
    assert all(p["shards"] <= 0.52 * total for p in parts) and sum(p["shards"] for p in parts) >= total


@pytest.mark.slow
@pytest.mark.parametrize("perturb", ["gather", "reduce", "sequence"])
def test_stage3_parity_fails_when_a_collective_is_perturbed(stage3_setup, single, perturb):
    """The parity check sees the collectives: each rank using its own slice in place of its peer's (gather),
    keeping its own gradient slice unsummed (reduce), or, under tensor 2 with sequence parallelism on 4 processes,
    leaving the norms' gradient shards unsummed over the tensor group (sequence), moves the weights far beyond the
    tolerance."""
    extra = dict(nproc=4, tensor_parallel_degree=2, sequence_parallel=True) if perturb == "sequence" else {}
    out_dir = run_stage3(stage3_setup, f"stage3-perturbed-{perturb}", perturb=perturb, **extra)
    wa, wb = weights(single["grpo"]), weights(out_dir)
    worst = max(rel_err(wa[k], wb[k]) for k in wa)
    print(f"perturbed {perturb}: max weight rel err {worst:.2e}")
    assert worst > 1e-3


@pytest.mark.slow
def test_stage3_resume_equals_uninterrupted(stage3_setup, single):
    """Step 3 resumed from checkpoint-2 (the gathered Hugging Face weights taken back into shards, each rank's
    optimizer shard) ends on the weights of the uninterrupted run, bit for bit."""
    out_dir = run_stage3(stage3_setup, "stage3-full")
    resumed = run_stage3(stage3_setup, "stage3-resumed", resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    assert [r["step"] for r in read_rows(resumed)] == [3]
    wa, wb = weights(out_dir), weights(resumed)
    assert max(rel_err(wa[k], wb[k]) for k in wa) == 0.0


def single_run(setup, name, **keys):
    out_dir = str(setup["root"] / name)
    os.makedirs(out_dir, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], out_dir, setup["plugin"], rl_algorithm="grpo", **keys), out_dir,
                    setup["prompts"])
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_stage3_token_budget(stage3_setup, packed):
    """Micro-batches by a token budget, padded (the ranks' prompts differ in length, so they form different numbers
    of micro-batches: the ranks with fewer run idle passes) or packed (each prompt shared in its row's one pass):
    the run equals one process."""
    keys = dict(use_remove_padding=True, share_prompt_prefix=True, max_tokens_per_micro_batch=48) if packed else \
        dict(KEYS, max_tokens_per_micro_batch=190)
    name = "packed" if packed else "budget"
    alone = single_run(stage3_setup, f"single-{name}", **keys)
    out_dir = run_stage3(stage3_setup, f"stage3-{name}", **keys)
    check_parity(stage3_setup, {"grpo": alone}, out_dir)
    idle = [p["idle_passes"] for p in held(out_dir)]
    print(f"stage3 {name}: idle passes per rank {idle}")
    assert packed or sum(idle) > 0


@pytest.mark.slow
def test_stage3_lora(stage3_setup):
    """LoRA (the adapters trained, the frozen base partitioned too; the reference is the base with the adapters
    off): the losses, the merged weights and the adapters equal one process."""
    from paddle_rl.models.lora import read_adapter
    keys = dict(KEYS, lora_rank=4, lora_alpha=8, merge_lora="true")
    alone = single_run(stage3_setup, "single-lora", **keys)
    out_dir = run_stage3(stage3_setup, "stage3-lora", **keys)
    check_parity(stage3_setup, {"grpo": alone}, out_dir)
    ref, got = (read_adapter(os.path.join(d, "checkpoint-3")) for d in (alone, out_dir))
    assert set(ref) == set(got) and any("lora_B" in k for k in ref)
    assert max(rel_err(ref[k], got[k]) for k in ref) <= 1e-5


def variant_model(setup, name):
    """The micro model with tied embeddings (one table in the outer unit, read by the embedding and the head), or
    with Qwen2-MoE blocks (4 experts, top-2, a shared expert; the load-balancing loss in the training loss: its
    gradient reaches each layer's router outside the layer's output), saved beside the micro tokenizer."""
    import paddle
    from paddle_rl.models import CausalLM, ModelConfig, load_model
    from paddle_rl.models.pretrained import copy_tokenizer_files, save_model, write_generation_config
    base = load_model(setup["micro"]["model"])
    state = {n: p.numpy() for n, p in base.named_parameters()}
    if name == "tied":
        config = ModelConfig.from_pretrained(setup["micro"]["model"])
        config.tie_word_embeddings = True
    else:
        config = ModelConfig.from_dict(dict(base.config.to_hf_dict(), model_type="qwen2_moe", num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24, norm_topk_prob=True,
                                            output_router_logits=True, router_aux_loss_coef=0.05))
    model = CausalLM(config)
    paddle.seed(4)
    model.init_weights(0.1)
    for name_, param in model.named_parameters():
        if name_ in state:
            param.set_value(state[name_])
        elif name_.endswith("mlp.gate"):  # routers far from uniform: no near-ties between the top-k
            param.set_value(paddle.normal(0.0, 1.0, param.shape))
    folder = str(setup["root"] / f"{name}-model")
    save_model(model, folder)
    copy_tokenizer_files(setup["micro"]["model"], folder)
    tokenizer = setup["micro"]["tokenizer"]
    write_generation_config(folder, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    return dict(setup, micro=dict(setup["micro"], model=folder))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied", "moe"])
def test_stage3_model_variants(stage3_setup, name):
    """Tied embeddings and a Mixture-of-Experts model (experts a rank's tokens never reach still gathered with their
    layer, their gradient slices zero) equal one process."""
    setup = variant_model(stage3_setup, name)
    alone = single_run(setup, f"single-{name}", **KEYS)
    out_dir = run_stage3(setup, f"stage3-{name}")
    check_parity(setup, {"grpo": alone}, out_dir)
    if name == "moe":
        assert all(r["actor/router_aux_loss"] > 0 for r in read_rows(out_dir))


@pytest.mark.slow
@pytest.mark.parametrize("keys", [dict(recompute=True, recompute_granularity="core_attn_mlp"),
                                  dict(release_grads=False)], ids=["recompute", "kept-gradients"])
def test_stage3_with_recompute_or_kept_gradients(stage3_setup, single, keys):
    """recompute_granularity core_attn_mlp (the attention core and each MLP block rerun inside the layer's own
    backward, while the layer is gathered), and release_grads false (the slices' gradients zeroed in place between
    steps, not dropped), equal the single-process run."""
    name = "stage3-" + ("recompute" if "recompute" in keys else "kept-gradients")
    out_dir = run_stage3(stage3_setup, name, **keys)
    check_parity(stage3_setup, single, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_stage3_with_tensor_parallel_on_four_processes(stage3_setup, single, sequence_parallel):
    """sharding 2 (stage3) x tensor 2, with and without sequence parallelism (the norms' gradient shards summed over
    the tensor group): each rank keeps half of its tensor-parallel shard of every parameter."""
    out_dir = run_stage3(stage3_setup, "stage3-tp2" + ("-sp" if sequence_parallel else ""), nproc=4,
                         tensor_parallel_degree=2, sequence_parallel=sequence_parallel)
    check_parity(stage3_setup, single, out_dir)


@pytest.mark.slow
def test_stage3_parameter_memory_against_stage2(tmp_path_factory):
    """A 19M-parameter variant of the micro model (hidden 512, 8 layers), one step at sharding 2 under stage 2 and
    stage 3: each rank's parameter bytes between passes (stage 3: half), the most gathered at once inside a pass
    (the embedding, norm and head, and at most two layers) and each rank's peak RSS (printed for docs/parallelism.md)."""
    from micro_model import build_micro
    from test_parallel import PLUGIN, greedy_prompts
    root = tmp_path_factory.mktemp("stage3-memory")
    micro = build_micro(str(root / "model"), hidden=512, layers=8)
    (root / "reward.py").write_text(PLUGIN)
    setup = {"micro": micro, "root": root, "plugin": str(root / "reward.py"), "prompts": greedy_prompts(micro, 2)}
    rows = {}
    for stage in ("stage2", "stage3"):
        out_dir = run_stage3(setup, stage, sharding=stage, max_steps=1, save_steps=100)
        rows[stage] = held(out_dir)
    total = rows["stage2"][0]["model_bytes"]
    for stage, parts in rows.items():
        print(f"{stage}: parameters {total} bytes; per rank held between passes "
              f"{[p.get('shards', total) for p in parts]}, most whole inside a pass "
              f"{[p.get('pass_peak_whole', total) for p in parts]}, peak RSS {[p['peak_rss'] for p in parts]}")
    assert all(p["shards"] <= 0.501 * total and p["whole"] == 0 for p in rows["stage3"])
    layer = max(p["pass_peak_whole"] for p in rows["stage3"])
    assert layer < 0.5 * total   # never the whole model inside a pass


# --------------------------------------------------------------------------------------------- worker

def _perturb(kind):
    """Break one collective of stage 3 on purpose (the tests above check that parity then fails)."""
    import paddle
    from paddle_rl.parallel import partitioned as P
    if kind == "gather":
        def own_only(self, unit):
            with paddle.no_grad():
                for part in unit.parts:
                    whole = paddle.concat([part.shard.detach()] * self.degree)[:part.numel].reshape(part.param.shape)
                    part.param.get_tensor()._share_data_with(whole.get_tensor())
        P.PartitionedParams._all_gather = own_only
    elif kind == "reduce":
        P.dist.reduce = lambda tensor, dst, group=None: None
    elif kind == "sequence":
        init = P.PartitionedSync.__init__

        def unsummed(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.token_partial = set()
        P.PartitionedSync.__init__ = unsummed


def _worker(spec_path):
    from paddle_rl.env import configure_threads
    configure_threads()
    with open(spec_path) as f:
        spec = json.load(f)
    _perturb(spec.get("perturb", ""))
    trainer = train_and_probe(spec["overrides"], spec["out_dir"], spec["prompts"])
    layout = trainer.layout
    out = dict(layout.held_bytes(trainer.actor), idle_passes=layout.idle_passes) \
        if hasattr(layout, "held_bytes") else {}
    out["model_bytes"] = sum(int(np.prod(p.shape)) * 4 for p in trainer.actor.parameters())
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(spec["out_dir"], f"params-rank{layout.rank}.json"), "w") as f:
        json.dump(out, f)
    layout.barrier()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

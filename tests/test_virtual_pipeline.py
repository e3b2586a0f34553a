"""virtual_pp_degree: the interleaved 1F1B pipeline (each stage holds k chunks of layers) equals one process.

The schedule is checked on its own first (every stage's planned actions replayed under blocking send / recv, the
chunks' layers, the refusals); then a 4-layer micro model trains 3 RL steps under pipeline_parallel_degree 2 x
virtual_pp_degree 2 on 2 real processes (gloo) and is compared with one process as tests/test_parallel.py compares
its layouts: every logged loss and statistic, the final weights (gathered from both stages' chunks), greedy tokens;
the PPO critic likewise, and step 3 resumed from checkpoint-2. A run whose chunks hold the wrong layers (each stage
its consecutive half, run in the interleaved schedule) differs, so the parity fails when the assignment is
perturbed. This file is also the worker those runs launch.
"""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_parallel import (PPO_CRITIC, REL_TOL, assert_parity, check_parity, compare_runs,  # noqa: E402
                           critic_adapter_parity, critic_parity, launch, read_rows, rel_err, run_overrides,
                           train_and_probe)

VPP = dict(pipeline_parallel_degree=2, virtual_pp_degree=2)


# --------------------------------------------------------------------------------------------- the schedule

def replay(plan, stages, virtual, num_micro, forward_only=False):
    """Run every stage's actions as blocking processes would: a send and its receive happen together (both stages
    at them, the same message); a forward or backward needs its input received (or made by the stage itself, in
    its own order). Returns the number of rounds; raises AssertionError on a deadlock or a mismatched transfer."""
    last = stages * virtual - 1
    pos = [0] * stages
    have = [set() for _ in range(stages)]
    done = {}
    rounds = 0
    while any(pos[r] < len(plan[r]) for r in range(stages)):
        rounds += 1
        moved = False
        for r in range(stages):
            if pos[r] == len(plan[r]):
                continue
            a = plan[r][pos[r]]
            if a.kind in "FB":
                v = a.chunk * stages + r
                if a.kind == "F":
                    assert v == 0 or ("act", v - 1, a.micro) in have[r], (r, a)
                else:
                    assert ("F", a.chunk, a.micro) in done.get(r, set()), (r, a)
                    assert v == last or ("grad", v + 1, a.micro) in have[r], (r, a)
                done.setdefault(r, set()).add((a.kind, a.chunk, a.micro))
                pos[r] += 1
                moved = True
            elif a.kind == "send":
                peer = plan[a.peer][pos[a.peer]] if pos[a.peer] < len(plan[a.peer]) else None
                if peer is not None and peer.kind == "recv" and peer.peer == r:
                    assert peer.message == a.message, (r, a, peer)
                    have[a.peer].add(a.message)
                    pos[r] += 1
                    pos[a.peer] += 1
                    moved = True
        assert moved, f"deadlock at {[plan[r][pos[r]] if pos[r] < len(plan[r]) else None for r in range(stages)]}"
    for r in range(stages):
        kinds = ("F",) if forward_only else ("F", "B")
        assert done[r] == {(k, j, i) for k in kinds for j in range(virtual) for i in range(num_micro)}
    return rounds


def test_every_stage_holds_its_interleaved_chunks():
    from paddle_rl.models.decoder import stage_chunks
    assert stage_chunks(8, 2, 0, 2) == [[0, 1], [4, 5]] and stage_chunks(8, 2, 1, 2) == [[2, 3], [6, 7]]
    assert stage_chunks(12, 3, 1, 2) == [[2, 3], [8, 9]]
    assert stage_chunks(8, 2, 1) == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"virtual_pp_degree 2: num_hidden_layers \(6\) must be divisible by "
                                         r"pipeline_parallel_degree x virtual_pp_degree \(2 x 2 = 4\)"):
        stage_chunks(6, 2, 0, 2)


def test_the_planned_schedule_runs_under_blocking_transfers():
    from paddle_rl.parallel.pipeline import compute_order, plan_interleaved
    for stages in (2, 3, 4):
        for virtual in (2, 3):
            for num_micro in (stages, 2 * stages, 3 * stages):
                replay(plan_interleaved(stages, virtual, num_micro), stages, virtual, num_micro)
            for num_micro in (1, stages + 1, 5):
                replay(plan_interleaved(stages, virtual, num_micro, forward_only=True), stages, virtual, num_micro,
                       forward_only=True)
    # Megatron's order on 2 stages x 2 chunks, 4 micro-batches: stage 0 warms up with (2-0-1)*2 + (2-1)*2 = 4
    # forwards (chunk 0 of micro-batches 0, 1, then chunk 1 of them), stage 1 with 2
    order = [(a.kind, a.chunk, a.micro) for a in compute_order(2, 2, 4, 0)]
    assert order[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0)]
    assert [(a.kind, a.chunk, a.micro) for a in compute_order(2, 2, 4, 1)][:4] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0)]


def test_the_schedule_has_the_bubble_of_the_literature():
    """The play of the schedule (forward 1, backward 2 per chunk, sends not waiting): each stage idles
    (p - 1) / (m k + p - 1) of the time, Narayanan et al.'s bubble (p - 1) / (m k) of the ideal time; chunks
    taken in the wrong order within each group (chunk 1 before chunk 0) cannot finish."""
    from paddle_rl.parallel.pipeline import Action, compute_order, plan_interleaved
    for stages, virtual, micro in ((2, 1, 4), (2, 2, 4), (2, 2, 8), (2, 4, 8), (4, 2, 8), (4, 4, 16)):
        clocks = []
        plan_interleaved(stages, virtual, micro, clocks=clocks)
        idle = 1 - 3 * micro * virtual / max(clocks)
        assert idle == pytest.approx((stages - 1) / (micro * virtual + stages - 1), abs=1e-12), (stages, virtual)
    swapped = [[Action(a.kind, 1 - a.chunk, a.micro) for a in compute_order(2, 2, 4, r)] for r in range(2)]
    with pytest.raises(ValueError, match="cannot finish"):
        plan_interleaved(2, 2, 4, orders=swapped)


def test_a_perturbed_schedule_is_refused_before_it_runs():
    from paddle_rl.parallel.pipeline import Action, compute_order, plan_interleaved
    orders = [compute_order(2, 2, 4, r) for r in range(2)]
    # stage 1 runs chunk 1 before chunk 0 of micro-batch 0: its input would come from its own later forward
    orders[1] = [Action("F", 1, 0), Action("F", 0, 0)] + [a for a in orders[1] if (a.kind, a.micro) != ("F", 0)]
    with pytest.raises(ValueError, match="pipeline schedule cannot finish: stage 0 waits for"):
        plan_interleaved(2, 2, 4, orders=orders)


def test_a_model_whose_layers_the_chunks_do_not_split_is_refused_before_it_loads(micro):
    from paddle_rl.config import load_config
    from paddle_rl.trainer.preflight import path_problems
    config = load_config(None, [f"actor_model_name_or_path={micro['model']}", "pipeline_parallel_degree=2",
                                "virtual_pp_degree=2"])
    problems = path_problems(config, data=False)
    assert any(p.startswith("virtual_pp_degree 2: num_hidden_layers (2) must be divisible by pipeline_parallel_degree "
                            "x virtual_pp_degree (2 x 2 = 4)") for p in problems), problems
    config.virtual_pp_degree = 1
    assert not any("virtual_pp_degree" in p for p in path_problems(config, data=False))


def test_virtual_stages_are_refused_without_a_pipeline_and_with_an_odd_micro_batch_count():
    from paddle_rl.config import ConfigError, load_config
    from paddle_rl.layouts import Pipelined
    from paddle_rl.parallel.topology import Topology, TopologyError, build_topology
    with pytest.raises(ConfigError, match="virtual_pp_degree 2 needs pipeline_parallel_degree > 1"):
        load_config(None, ["actor_model_name_or_path=x", "virtual_pp_degree=2"])
    with pytest.raises(TopologyError, match="virtual_pp_degree 2 needs pipeline_parallel_degree > 1"):
        build_topology(virtual_pp=2)
    topo = Topology({"data": 1, "sharding": 1, "pipe": 2, "tensor": 1}, rank=0, ranks_of={"pp": [0, 1]},
                    virtual_pp=2)
    layout = Pipelined(topo)
    from paddle_rl.parallel.pipeline import Link
    with pytest.raises(ValueError, match=r"virtual_pp_degree 2: a mini-batch of 3 micro-batches; the interleaved "
                                         r"schedule needs a multiple of pipeline_parallel_degree \(2\)"):
        layout._train(Link(topo), [None] * 3, None, None, "per_device_train_batch_size")


# --------------------------------------------------------------------------------------------- 2 processes

def four_layer_model(micro, root, layers=4):
    """The micro model's tokenizer and data with a random 4-layer decoder (2 stages x 2 chunks of one layer)."""
    import paddle
    from paddle_rl.models import CausalLM, ModelConfig
    from paddle_rl.models.pretrained import copy_tokenizer_files, save_model, write_generation_config
    config = ModelConfig.from_pretrained(micro["model"])
    config.num_hidden_layers = layers
    paddle.seed(7)
    model = CausalLM(config)
    model.init_weights()
    folder = os.path.join(root, f"model-{layers}-layers")
    save_model(model, folder)
    copy_tokenizer_files(micro["model"], folder)
    write_generation_config(folder, micro["tokenizer"].eos_token_ids, micro["tokenizer"].pad_token_id)
    return dict(micro, model=folder)


@pytest.fixture(scope="module")
def setup(micro, tmp_path_factory):
    from test_parallel import PLUGIN, greedy_prompts
    root = tmp_path_factory.mktemp("virtual-pipeline")
    plugin = root / "parity_reward.py"
    plugin.write_text(PLUGIN)
    return {"micro": four_layer_model(micro, str(root)), "root": root, "plugin": str(plugin),
            "prompts": greedy_prompts(micro)}


def single(setup, name, **extra):
    out_dir = str(setup["root"] / f"single-{name}")
    os.makedirs(out_dir, exist_ok=True)
    train_and_probe(run_overrides(setup["micro"], out_dir, setup["plugin"], **extra), out_dir, setup["prompts"])
    return out_dir


def run_vpp(setup, name, perturb="", nproc=2, degrees=VPP, **extra):
    out_dir = str(setup["root"] / name)
    os.makedirs(out_dir, exist_ok=True)
    spec = {"overrides": run_overrides(setup["micro"], out_dir, setup["plugin"], **degrees, **extra),
            "out_dir": out_dir, "prompts": setup["prompts"], "perturb": perturb}
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    launch([os.path.abspath(__file__), "--worker", spec_path], os.path.join(out_dir, "log"), nproc=nproc)
    return out_dir


@pytest.fixture(scope="module")
def grpo_single(setup):
    return single(setup, "grpo", rl_algorithm="grpo")


@pytest.mark.slow
def test_virtual_pipeline_equals_one_process(setup, grpo_single):
    """PP 2 x VPP 2 (stage 0: layers 0 and 2, stage 1: layers 1 and 3; 4 micro-batches per mini-batch) equals
    one process: losses, statistics, weights after each step (checkpoint-3 gathered from both stages), greedy
    tokens."""
    out_dir = run_vpp(setup, "vpp")
    check_parity(setup, {"grpo": grpo_single}, out_dir)


@pytest.mark.slow
def test_virtual_pipeline_fails_parity_with_chunks_in_the_wrong_order(setup, grpo_single):
    """The same run with each stage holding its consecutive half of the layers (stage 0: 0, 1; stage 1: 2, 3) but
    run in the interleaved schedule (layers in the order 0, 2, 1, 3): the losses differ from one process."""
    out_dir = run_vpp(setup, "vpp-perturbed", perturb="contiguous-chunks")
    errors = compare_runs(grpo_single, out_dir)
    worst = max((v for k, v in errors.items() if k.split("/", 1)[-1] == "actor/pg_loss"), default=0.0)
    print(f"vpp with the chunks in the wrong order: pg_loss rel err {worst:.2e}")
    assert worst > 100 * REL_TOL


@pytest.mark.slow
def test_virtual_pipeline_ppo_critic_and_resume(setup):
    """PPO under PP 2 x VPP 2: the critic split into the same chunks (value head after the last chunk), its value
    pass (6 micro-batches of per_device_value_batch_size 3, on the forward-only interleaved schedule) and update
    equal one process; step 3 resumed from checkpoint-2 ends on the same actor and critic weights, bit for bit."""
    ppo_single = single(setup, "ppo", rl_algorithm="ppo", **PPO_CRITIC)
    out_dir = run_vpp(setup, "vpp-ppo", rl_algorithm="ppo", **PPO_CRITIC)
    rows = read_rows(out_dir)
    assert rows[0]["actor/critic_warmup"] == 1.0 and all(r["critic/vf_loss"] > 0 for r in rows[1:])
    assert_parity(ppo_single, out_dir)
    alone, memory = critic_parity(ppo_single, out_dir)
    assert sum(memory) == alone and max(memory) < alone
    resumed = run_vpp(setup, "vpp-ppo-resumed", rl_algorithm="ppo", **PPO_CRITIC,
                      resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    assert [r["step"] for r in read_rows(resumed)] == [3]
    from paddle_rl.model_files.safetensors_io import load_state
    for folder in ("", "critic"):
        wa, wb = (load_state(os.path.join(d, "checkpoint-3", folder)) for d in (out_dir, resumed))
        assert set(wa) == set(wb)
        worst = max(rel_err(wa[k], wb[k]) for k in wa)
        print(f"vpp-ppo resumed at step 3: max {folder or 'actor'} weight rel err {worst:.2e}")
        assert worst == 0.0, (folder, worst)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["lora", "tied"])
def test_virtual_pipeline_lora_and_tied_embeddings(setup, variant):
    """PPO with LoRA on the actor and the critic (adapters on every chunk, the value head whole after the last;
    the critic saved as a PEFT adapter gathered from both stages), and GRPO with tied embeddings (the table on stage
    0 for chunk 0 and a copy on stage 1 for the head after its last chunk, their gradients summed), under PP 2 x
    VPP 2, equal one process."""
    if variant == "lora":
        extra = dict(PPO_CRITIC, rl_algorithm="ppo", lora_rank=4, lora_alpha=8, merge_lora="true")
        base = setup
    else:
        import paddle
        from paddle_rl.models import CausalLM, ModelConfig, load_model
        from paddle_rl.models.pretrained import copy_tokenizer_files, save_model, write_generation_config
        config = ModelConfig.from_pretrained(setup["micro"]["model"])
        config.tie_word_embeddings = True
        untied = {n: p.numpy() for n, p in load_model(setup["micro"]["model"]).named_parameters()}
        model = CausalLM(config)
        for name, param in model.named_parameters():
            param.set_value(paddle.to_tensor(untied[name]))
        folder = str(setup["root"] / "model-4-layers-tied")
        save_model(model, folder)
        copy_tokenizer_files(setup["micro"]["model"], folder)
        write_generation_config(folder, setup["micro"]["tokenizer"].eos_token_ids,
                                setup["micro"]["tokenizer"].pad_token_id)
        base, extra = dict(setup, micro=dict(setup["micro"], model=folder)), dict(rl_algorithm="grpo")
    reference = single(base, variant, **extra)
    out_dir = run_vpp(base, f"vpp-{variant}", **extra)
    assert_parity(reference, out_dir)
    if variant == "lora":
        critic_adapter_parity(reference, out_dir, "vpp-lora")
    else:
        np.testing.assert_array_equal(np.load(os.path.join(out_dir, "greedy.npy")),
                                      np.load(os.path.join(reference, "greedy.npy")))


@pytest.fixture(scope="module")
def six_layers(setup):
    """A 6-layer variant and its single-process run (3 micro-batches per mini-batch)."""
    six = dict(setup, micro=four_layer_model(setup["micro"], str(setup["root"]), layers=6))
    return six, single(six, "six-layers", rl_algorithm="grpo", per_device_train_batch_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2])
def test_three_stages_with_and_without_chunks(six_layers, virtual):
    """3 processes, a 6-layer model, 3 micro-batches per mini-batch: pipeline 3 (1F1B) and pipeline 3 x virtual 2
    equal one process. Each pair of neighbouring stages transfers on a group of its own (on one group shared by the
    3 stages the transfers were paired across neighbours and hung)."""
    six, reference = six_layers
    degrees = dict(pipeline_parallel_degree=3, virtual_pp_degree=virtual)
    out_dir = run_vpp(six, f"pp3-vpp{virtual}", nproc=3, degrees=degrees, rl_algorithm="grpo",
                      per_device_train_batch_size=3)
    check_parity(six, {"grpo": reference}, out_dir)


# --------------------------------------------------------------------------------------------- worker

def _worker(spec_path):
    from paddle_rl.env import configure_threads
    configure_threads()
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("perturb") == "contiguous-chunks":
        from paddle_rl.models import decoder
        # each stage's consecutive layers split into its chunks (the non-interleaved assignment)
        decoder.stage_chunks = lambda layers, stages, stage, virtual=1: [
            list(range(stage * layers // stages + j * layers // (stages * virtual),
                       stage * layers // stages + (j + 1) * layers // (stages * virtual))) for j in range(virtual)]
    train_and_probe(spec["overrides"], spec["out_dir"], spec["prompts"])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, ROOT)
    _worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

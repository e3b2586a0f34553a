"""`paddle-rl bench` workloads through the real trainer: W2's EOS schedule forces exactly its lengths, and the
rollout decodes each row only while it lives (decode_row_steps <= generated tokens)."""
import argparse

import pytest

from paddle_rl import bench
from paddle_rl.rewards.rules import RULE_REWARDS


@pytest.fixture
def bench_rule():
    """The benchmark's reward is the built-in distinct_chars rule: nothing is registered at run time."""
    before = set(RULE_REWARDS)
    yield
    assert set(RULE_REWARDS) == before and "distinct_chars" in before


def args_for(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_long_tail_lengths_have_the_promised_shape():
    lengths = bench.long_tail_lengths(64)
    assert len(lengths) == 64 and max(lengths) == 1024 and min(lengths) >= 1
    assert 90 <= sorted(lengths)[31] <= 100   # median about 96
    assert bench.long_tail_lengths(64, cap=48) == [min(n, 48) for n in lengths]


def test_w2_generates_the_schedule_and_decodes_live_rows_only(bench_rule):
    result = bench.run(args_for("--workload", "w2", "--response-len", "40", "--steps", "1", "--warmup", "0",
                                "--prompts", "2", "--rollout-n", "4", "--kl-loss-coeff", "0", "--peaks", "fp32"))
    lengths = bench.long_tail_lengths(8, cap=40)
    assert result["generated_tokens"] == sum(lengths)
    assert result["response_length_mean"] == sum(lengths) / 8
    # every row is in a decode step only until its last token: L - 1 steps for a row of L tokens
    assert result["decode_row_steps"] == sum(n - 1 for n in lengths)
    assert result["trained_tokens"] == sum(lengths)
    for key in ("step_s", "rollout_s", "ref_logprob_s", "update_s", "effective_gflops", "rollout_gflops",
                "peak_gflops", "peak_rss_mb"):
        assert key in result
    # the memory peak of each stage (and of the update's parts), none above the process's
    rss, tensors = result["stage_peak_rss_mb"], result["stage_peak_tensor_mb"]
    for stage in ("before_step", "rollout", "update", "update_forward_backward",
                  "update_optimizer_step"):
        assert 0 < rss[stage] <= result["peak_rss_mb"] and tensors[stage] > 0, stage
    assert max(rss.values()) <= result["peak_rss_mb"] and "peak by stage" in bench.report(result)
    # the page faults of each stage (the first update grows the heap: it takes some), and every step's record
    assert result["stage_page_faults"]["update"] > 0 and "page faults   " in bench.report(result)
    assert [s["timed"] for s in result["steps"]] == [True] and result["steps"][0]["step_s"] == result["step_s"]


def test_ppo_reports_the_critic_stages(bench_rule):
    """rl_algorithm ppo: the critic's value pass and update are stages of their own in the JSON and the table,
    with their cost against the actor's update. W1 has one update pass per step, so the update's forward gives the
    values (values 0 s); with two mini-batches the value pass runs on its own."""
    common = ("--workload", "w1", "--response-len", "8", "--steps", "1", "--warmup", "0", "--prompts", "2",
              "--rollout-n", "4", "--peaks", "fp32")   # the emulated bf16 peaks are not what this test reads
    fused = bench.run(args_for(*common, "--set", "rl_algorithm=ppo"))
    two = bench.run(args_for(*common, "--set", "rl_algorithm=ppo", "--set", "global_mini_batch_size=1"))
    for result in (fused, two):
        assert result["critic_update_s"] > 0 and result["update_s"] > 0
        assert result["critic_s"] == result["values_s"] + result["critic_update_s"]
        assert result["critic_over_update"] == result["critic_s"] / result["update_s"]
        assert result["critic_optimizer_state_mb"] > 0 and result["critic_update_gflops"] > 0
        table = bench.report(result)
        assert "  values " in table and "  critic_update " in table and "x the actor's update" in table
    assert fused["values_s"] == 0 and "given by the critic update" in bench.report(fused)
    assert two["values_s"] > 0 and two["values_gflops"] > 0
    # GRPO has no critic: no critic stages
    grpo = bench.run(args_for(*common))
    assert "values_s" not in grpo and "critic_s" not in grpo and "  values " not in bench.report(grpo)


def test_matmul_peaks_cover_the_workload_shapes_before_and_after():
    """The peaks: a square product and each linear shape of the model, per kind; the summary keeps the best of each
    kind over shapes and both measurements, and the report shows fp32 and bf16 side by side."""
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300)
    assert bench.linear_shapes(shape) == {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 192),
                                          "down_proj": (96, 64), "lm_head": (64, 300)}
    before, after = bench.matmul_peaks(shape, repeat=1), bench.matmul_peaks(shape, repeat=1)
    names = ["square 1024", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert [r["shape"] for r in before] == [n for n in names for _ in bench.PEAK_KINDS]
    assert all(r["gflops"] > 0 for r in before if r["kind"] != "torch_bf16")
    summary = bench.peak_summary(before, after)
    for kind in ("fp32", "bf16_linear", "bf16_packed", "int8_packed"):
        readings = [r[f"gflops_{w}"] for r in summary["matmul_peaks"] if r["kind"] == kind for w in ("before", "after")]
        assert summary[f"{kind}_peak_gflops"] == max(readings)
        assert summary[f"{kind}_peak_before_gflops"] == max(r["gflops"] for r in before if r["kind"] == kind)
    lines = "\n".join(bench.peak_lines(summary))
    assert "fp32 paddle.matmul" in lines and "bf16 suite bf16_linear" in lines and "outside reference" in lines
    assert "int8 suite packed kernel" in lines
    # the drift: the largest relative move of a kind's best between the two measurements, warned above 15%
    moves = [abs(summary[f"{k}_peak_after_gflops"] - summary[f"{k}_peak_before_gflops"]) / summary[f"{k}_peak_gflops"]
             for k in bench.PEAK_KINDS if summary[f"{k}_peak_before_gflops"] and summary[f"{k}_peak_after_gflops"]]
    assert summary["peak_drift"] == max(moves)
    slower = [dict(r, gflops=None if r["gflops"] is None else r["gflops"] / 2) for r in before]
    halved = bench.peak_summary([dict(r) for r in before], slower)
    assert halved["peak_drift"] == pytest.approx(0.5)
    assert "speed moved during the run: a peak changed by 50%" in "\n".join(bench.peak_lines(halved))
    steady = bench.peak_summary([dict(r) for r in before], [dict(r) for r in before])
    assert steady["peak_drift"] == 0.0 and "speed moved" not in "\n".join(bench.peak_lines(steady))


def test_a_local_rollout_server_is_timed_against_the_inline_rollout(bench_rule):
    """rollout_server_urls=local: the bench starts a server on 127.0.0.1 with the run's config, runs the workload
    inline and on the server step by step in turn, and reports both steps and the push: its bytes are the model's
    float32 tensors (W1: 5,001,472 parameters) and a safetensors header."""
    result = bench.run(args_for("--workload", "w1", "--response-len", "4", "--steps", "1", "--warmup", "0",
                                "--prompts", "2", "--rollout-n", "2", "--kl-loss-coeff", "0", "--peaks", "fp32",
                                "--set", "rollout_server_urls=local"))
    served = result["rollout_server"]
    assert served["urls"] == ["local"] and served["local_servers"] == 1 and served["steps_timed"] == 1
    assert 5_001_472 * 4 < served["weights_push_bytes"] < 5_001_472 * 4 + 2 ** 16
    assert served["step_s"] > 0 and served["weights_push_s"] > served["weights_serialize_s"] > 0
    assert served["step_over_inline"] == served["step_s"] / result["step_s"]
    assert served["inline_steps_s"] == [result["step_s"]] and served["steps_s"] == [served["step_s"]]
    assert result["generated_tokens"] == 2 * 2 * 4   # the inline trainer's steps (not the server run's too)
    assert "x inline" in bench.report(result) and "MiB per server" in bench.report(result)


def test_w5_trains_on_humaneval_records_scored_by_the_code_rule(bench_rule, tmp_path, monkeypatch):
    """W5: HumanEval's records (`paddle-rl fetch humaneval`; here four tasks in its layout, cached where fetch
    writes), 4 prompts x 4 samples by default, the `code` rule in its sandbox as the reward; on the bundled tiny
    model (`--model-path`), so the run is short. Its prompts are the records' own instruction around each task."""
    import gzip
    import json

    from paddle_rl.model_files.benchmarks import humaneval_records
    from paddle_rl.rewards.sandbox import isolation
    if isolation() is None:
        pytest.skip("bubblewrap (bwrap) cannot isolate programs here")
    tasks = [{"task_id": f"Tiny/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n", "entry_point": f"f{i}",
              "canonical_solution": "    return x\n", "test": f"def check(candidate):\n    assert candidate({i}) == {i}\n"}
             for i in range(4)]
    data = gzip.compress("".join(json.dumps(t) + "\n" for t in tasks).encode())
    monkeypatch.setenv("PADDLE_RL_DATA", str(tmp_path))
    with open(tmp_path / "humaneval.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in humaneval_records(data, "tasks"))
    args = args_for("--workload", "w5", "--model-path", bench.os.path.join(bench.os.path.dirname(
        bench.os.path.dirname(bench.__file__)), "data", "tiny_arith", "model"), "--response-len", "4",
                    "--steps", "1", "--warmup", "0", "--kl-loss-coeff", "0", "--peaks", "fp32")
    spec = bench.resolve_args(args)
    assert (args.prompts, args.rollout_n) == (4, 4) and spec["settings"]["reward_funcs"] == ["code"]
    result = bench.run(args)
    assert result["workload"] == "w5" and result["prompts"] == 4 and result["rollout_n"] == 4
    # every response scored by the code rule (the tiny model's text is no program that passes: accuracy 0)
    assert result["accuracy"] == 0.0 and result["reward_s"] > 0
    assert result["cores"] >= 1 and result["cpu_model"] and "reward" in bench.report(result)
    assert "machine " in bench.report(result)


TINY_W1 = ("--workload", "w1", "--response-len", "4", "--steps", "1", "--warmup", "0", "--prompts", "2",
           "--rollout-n", "2")


def test_the_report_echoes_the_switches_and_rates_each_stage_against_its_precisions_peak(bench_rule):
    """The switches given by --set appear in the config echo with the path each takes; every stage that ran has
    its GFLOP/s and its share of the peak of its precision (float32 here), in the JSON and the table; the old-log-prob
    stage that takes the rollout's own log-probs (W1: reuse_rollout_logprobs auto) runs no pass and has no rate."""
    result = bench.run(args_for(*TINY_W1, "--peaks", "fp32", "--set", "use_fused_rope=false", "--set",
                                "use_flash_attention=true"))
    assert result["kernel_switches"] == {"use_flash_attention": True, "use_fused_rms_norm": None,
                                         "use_fused_rope": False, "use_fused_head_and_loss_fn": None,
                                         "use_fused_linear": None}
    assert result["kernel_paths"] == {"use_flash_attention": "fused", "use_fused_rms_norm": "fused",
                                      "use_fused_rope": "composed", "use_fused_head_and_loss_fn": "fused",
                                      "use_fused_linear": "fused"}
    table = bench.report(result)
    assert "  config        use_fused_rope=false use_flash_attention=true" in table
    assert "use_fused_rope=false (composed)" in table and "use_flash_attention=true (fused)" in table
    assert "use_fused_rms_norm unset (fused)" in table
    rates, fractions = result["stage_gflops"], result["stage_peak_fraction"]
    assert sorted(rates) == ["ref_logprob", "rollout", "update"]   # no old-log-prob pass ran
    assert rates["update"] == result["update_gflops"] and rates["rollout"] == result["rollout_gflops"]
    for stage, rate in rates.items():
        assert result["stage_peak_kind"][stage] == "fp32" and rate > 0
        assert fractions[stage] == rate / result["fp32_peak_gflops"]
        assert f"    {stage:<14} {rate:8.1f} = {100 * fractions[stage]:3.0f}% of fp32 paddle.matmul" in table
    assert f"machine {result['cpu_model']}, {result['cores']} cores, flags" in table
    # the kinds --peaks left out are not timed, and say so
    assert result["peak_kinds"] == ["fp32"] and result["torch_bf16_peak_gflops"] is None
    assert f"    {'bf16 torch.matmul (outside reference)':<40} not timed (--peaks)" in table


def test_stage_peak_kinds_follow_each_stages_precision():
    kinds = bench.stage_peak_kinds
    assert kinds("float32", "", False, False) == dict.fromkeys(bench.RATED_STAGES, "fp32")
    bf16 = kinds("bfloat16", "", True, False)
    assert bf16["rollout"] == "bf16_packed" and bf16["update"] == bf16["ref_logprob"] == "bf16_linear"
    assert kinds("float32", "weight_only_int8", False, False)["rollout"] == "int8_packed"
    assert kinds("float32", "weight_only_int4", False, False)["rollout"] is None   # no int4 peak is measured
    assert kinds("float32", "", False, True)["update"] is None                     # nor an fp16 one
    rates = bench.stage_rates({"rollout": 4e9, "update": 6e9, "ref_logprob": 0.0}, {"rollout": 2.0, "update": 3.0},
                              {"rollout": "bf16_packed", "update": None, "ref_logprob": "fp32"},
                              {"bf16_packed_peak_gflops": 8.0})
    assert rates["stage_gflops"] == {"rollout": 2.0, "update": 2.0}
    assert rates["stage_peak_fraction"] == {"rollout": 0.25, "update": None}
    lines = "\n".join(bench.stage_rate_lines(dict(rates)))
    assert "25% of bf16 suite packed kernel (rollout) 8.0" in lines and "no peak measured" in lines


def test_update_rerun_counts_what_the_recompute_runs_again():
    """The update's FLOPs are three forwards; `update_recompute` adds the blocks its backward runs again: the MLP's
    gate / up products (core_attn_mlp), the whole layer (full), in the layers not in no_recompute_layers; rated
    apart."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
    args = (shape, 40.0, 160.0, 8, False, False)
    plain, mlp = bench.step_flops(*args), bench.step_flops(*args, recompute="core_attn_mlp")
    assert plain["update_recompute"] == 0.0 and mlp["update"] == plain["update"] and mlp["step"] == plain["step"]
    # tokens x layers x the MLP's gate and up products (the down projection's forward is not run again), all three
    # where Paddle's recompute reruns the block (LoRA, tensor parallelism)
    assert mlp["update_recompute"] == 200.0 * 4 * 2 * 2 * 64 * 128
    assert bench.step_flops(*args, recompute="core_attn_mlp", down_rerun=True)["update_recompute"] == \
        200.0 * 4 * 2 * 3 * 64 * 128
    assert bench.step_flops(*args, recompute="core_attn_mlp", recomputed_layers=1)["update_recompute"] == \
        mlp["update_recompute"] / 4
    full = bench.step_flops(*args, recompute="full")["update_recompute"]
    reference = bench.step_flops(shape, 40.0, 160.0, 8, True, False)["ref_logprob"]
    assert full == pytest.approx(reference - 160.0 * 2 * 64 * 100)   # a forward of every token, without the head
    rates = bench.stage_rates(mlp, {"update": 2.0}, dict.fromkeys(bench.RATED_STAGES, "fp32"), {"fp32_peak_gflops": 1.0})
    assert rates["stage_gflops"]["update_rerun"] == pytest.approx((mlp["update"] + mlp["update_recompute"]) / 2e9)
    assert "update_rerun" not in bench.stage_rates(plain, {"update": 2.0}, dict.fromkeys(bench.RATED_STAGES, "fp32"),
                                                   {"fp32_peak_gflops": 1.0})["stage_gflops"]


def test_switches_flip_each_switch_one_at_a_time_through_its_path(bench_rule, monkeypatch):
    """--switches: the baseline (the config's switches) and one run per switch flipped, each step under its run's
    switches: the composed linear / RMSNorm and the blocked attention are called in the flipped runs' steps only
    (the switches seen at each call), and the table has a row per run with its ratio to the baseline."""
    from paddle_rl import ops
    from paddle_rl.ops import linear_bias, norm as norm_module
    seen = {}

    def count(target, name):
        fn = getattr(target, name)

        def counted(*a, **k):
            seen.setdefault(name, []).append(ops.kernel_switches())
            return fn(*a, **k)
        monkeypatch.setattr(target, name, counted)
    for target, name in ((linear_bias, "affine_reference"), (norm_module, "rms_norm_reference"),
                         (ops, "blocked_attention")):
        count(target, name)
    result = bench.switch_runs(args_for(*TINY_W1, "--switches", "use_fused_linear,rms_norm,use_flash_attention"))
    names = [r["name"] for r in result["runs"]]
    assert names == ["baseline", "use_fused_linear=false", "use_fused_rms_norm=false", "use_flash_attention=true"]
    assert result["refused"] == {} and result["kernel_paths"]["use_flash_attention"] == "composed"
    assert seen["affine_reference"] and all(s["linear"] is False for s in seen["affine_reference"])
    assert seen["rms_norm_reference"] and all(s["rms_norm"] is False for s in seen["rms_norm_reference"])
    assert seen["blocked_attention"] and all(s["attention"] is True for s in seen["blocked_attention"])
    base = result["runs"][0]
    assert base["step_ratio"] == 1.0 and base["kernel_switches"]["use_fused_linear"] is None
    for run in result["runs"][1:]:
        assert run["kernel_switches"][run["key"]] is run["value"] and len(run["steps_s"]) == 1
        assert run["step_ratio"] == run["step_s"] / base["step_s"] and run["update_s"] > 0
        assert run["stage_ratios"]["update"] == run["update_s"] / base["update_s"]
        assert 0 < run["peak_tensor_mb"] < run["peak_rss_mb"] <= result["peak_rss_mb"]
    table = bench.switch_report(result)
    for run in result["runs"]:
        assert f"  {run['name']:<36} {run['step_s']:8.3f}" in table and f"{run['step_ratio']:10.3f}" in table
    assert "x baseline" in table and "machine " in table


def test_a_flip_that_cannot_act_is_refused_by_name():
    """With the custom ops off, unset RMSNorm runs the composed ops; its flip (true) is refused by the config's own
    check, named, and not run."""
    flips = bench.flipped_configs({"actor_model_name_or_path": "m", "use_custom_ops": "off"}, ["rms_norm", "linear"],
                                  {"kernel_paths": {"use_fused_rms_norm": "composed", "use_fused_linear": "fused"}},
                                  None)
    assert list(flips["refused"]) == ["use_fused_rms_norm"]
    assert "use_fused_rms_norm: true runs the fused kernel" in flips["refused"]["use_fused_rms_norm"]
    assert [r["name"] for r in flips["runs"]] == ["use_fused_linear=false"]


@pytest.mark.slow   # ~30 s: Paddle in the child process and transformers in this one
def test_trls_w1_loads_the_benchs_own_model_files(tmp_path):
    """tools/bench_trl.py's W1 is the bench's: the bench's builder makes the files (in a child process), and
    transformers loads every tensor of the 5M-parameter model from them, none missing or left over; the prompts are
    the bench's, one token per word. (trl itself is not imported.)"""
    import importlib.util
    import os

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_trl", os.path.join(root, "tools", "bench_trl.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    work = tool.build_w1(str(tmp_path), 2, 8, 0)
    model, info = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert sum(p.numel() for p in model.parameters()) == 5_001_472
    prompts = tool.w1_prompts(work["data"], 3)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(work["model_dir"], "tokenizer.json"))
    assert [len(tokenizer(p)["input_ids"]) for p in prompts] == [len(p.split()) for p in prompts]
    assert all(4 <= len(p.split()) <= 12 for p in prompts)

"""The argument set: PaddleNLP files load, typos get suggestions, bad values are named before any model loads."""
import logging
import math
import os

import pytest

from paddle_rl.config import ConfigError, load_config, parse_overrides
from paddle_rl.trainer.preflight import check_paths

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "paddlenlp_grpo_argument.yaml")
MODEL = "actor_model_name_or_path=some/model"


def test_paddlenlp_grpo_argument_file_loads_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        cfg = load_config(FIXTURE)
    assert cfg.rl_algorithm == "grpo" and cfg.tensor_parallel_degree == 2 and cfg.sharding == "stage2"
    assert cfg.learning_rate == 5e-7 and cfg.weight_decay == 0.01  # YAML reads "5e-7" as a string
    assert cfg.global_mini_batch_size == 2  # PaddleNLP's mini_batch_size
    assert cfg.mini_batch_prompts == 2 and cfg.rollout_n == 8 and cfg.max_dec_len == 4096
    warnings = [r.getMessage() for r in caplog.records if "not acted on" in r.getMessage()]
    assert len(warnings) <= 1
    listed = warnings[0].split(": ", 1)[1].split(", ") if warnings else []
    for key in ("use_flash_attention", "use_fused_linear", "fp16_opt_level", "amp_master_grad", "offload_level",
                "release_grads", "recompute_use_reentrant", "quant_type", "sharding_parallel_config",
                "per_device_rollout_batch_size", "global_gen_batch_size", "skip_profile_timer", "wandb_http_proxy",
                "rollout_n", "bf16", "use_fp32_compute"):
        assert key not in listed  # they act (or refuse a value by name)
    assert cfg.fp16_opt_level == "O2" and cfg.sharding_options == ("enable_release_grads",)
    assert cfg.amp_custom_white_list.split()[-1] == "fused_gemm_epilogue"


def test_unknown_key_suggests_the_closest_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_model_name_or_path: m\nrollout_nn: 4\nlearning_rat: 1.0e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    text = str(err.value)
    assert "unknown key 'rollout_nn' (did you mean 'rollout_n'?)" in text
    assert "'learning_rat' (did you mean 'learning_rate'?)" in text
    assert str(path) in text


@pytest.mark.parametrize("override,message", [
    ("rollout_n=0", "rollout_n: must be >= 1"),
    ("global_mini_batch_size=3", "global_mini_batch_size: 3 does not divide global_batch_size 8"),
    ("max_dec_len=-5", "max_dec_len: must be >= 1"),
    ("min_dec_len=-1", "min_dec_len: must be >= 0"),
    ("max_prompt_len=-1", "max_prompt_len: must be > 0"),
    ("top_p=1.5", "top_p: must be in (0, 1]"),
    ("lr_scheduler_type=warmup_cosine", "lr_scheduler_type: 'warmup_cosine' is not one of"),
    ("rl_algorithm=a2c", "rl_algorithm: 'a2c' is not one of"),
    ("rollout_n=four", "rollout_n: expected an integer"),
    ("do_eval=maybe", "do_eval: expected true or false"),
    ("kv_cache_dtype=int8", "kv_cache_dtype: must be auto, float32, bfloat16 or float16, got 'int8'"),
    ("recompute_granularity=selective", "recompute_granularity: must be one of full, full_attn, core_attn, core_attn_mlp"),
    ("recompute_granularity=core_attn", "recompute_granularity: core_attn is set without recompute: true"),
])
def test_invalid_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, override])
    assert message in str(err.value)


def test_missing_model_is_named():
    with pytest.raises(ConfigError, match="actor_model_name_or_path: required"):
        load_config(None, ["rollout_n=2"])


def test_check_paths_names_missing_files(tmp_path):
    cfg = load_config(None, [f"actor_model_name_or_path={tmp_path / 'nope'}", f"train_datasets={tmp_path / 'x.jsonl'}",
                             "do_eval=true"])
    with pytest.raises(ConfigError) as err:
        check_paths(cfg)
    text = str(err.value)
    assert "actor_model_name_or_path: folder not found" in text
    assert f"train_datasets: file not found: {tmp_path / 'x.jsonl'}" in text
    assert "eval_datasets: required when do_eval is true" in text


def test_overrides_parse_yaml_scalars_and_lists():
    assert parse_overrides(["a=1", "b=0.5", "c=true", "d=[kk, format]", "e=x=y"]) == {
        "a": 1, "b": 0.5, "c": True, "d": ["kk", "format"], "e": "x=y"}
    cfg = load_config(FIXTURE, ["rollout_n=4", "learning_rate=1e-5", "reward_funcs=kk"])
    assert cfg.rollout_n == 4 and cfg.learning_rate == 1e-5 and cfg.reward_funcs == ["kk"]
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["rollout_n"])


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout_n: 4\nkl_coeff: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(str(path))


def test_yaml_no_and_string_lists_keep_their_meaning():
    cfg = load_config(None, [MODEL, "save_strategy=no", "evaluation_strategy=no",
                             "bf16=true", "amp_custom_black_list=[reduce_sum, softmax]"])
    assert cfg.save_strategy == "no" and cfg.evaluation_strategy == "no"
    assert cfg.amp_custom_black_list == "reduce_sum softmax"


# ---- PaddleNLP's "derive it" values (-1), max_length, report_to
DERIVED = os.path.join(os.path.dirname(__file__), "fixtures", "paddlenlp_grpo_argument_derived.yaml")


def test_paddlenlp_file_with_derived_degrees_and_mini_batch_loads(caplog):
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        cfg = load_config(DERIVED)
    assert cfg.sharding_parallel_degree == -1 and cfg.sharding == "stage1" and cfg.tensor_parallel_degree == 2
    assert cfg.global_mini_batch_size == -1 and cfg.mini_batch_prompts == cfg.global_batch_size == 4
    assert cfg.max_steps == -1 and cfg.max_length == 4608 and cfg.learning_rate == 5e-7
    assert cfg.amp_custom_black_list.startswith("reduce_sum softmax_with_cross_entropy")
    assert not [r for r in caplog.records if "not acted on" in r.getMessage()]  # every key acts or refuses


def test_sharding_degree_minus_one_takes_the_ranks_tensor_and_pipeline_leave():
    from paddle_rl.parallel.topology import TopologyError, resolve_degrees
    cfg = load_config(DERIVED)
    degrees = resolve_degrees(cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.sharding_parallel_degree,
                              cfg.data_parallel_degree, world_size=8)
    assert degrees == {"data": 1, "sharding": 4, "pipe": 1, "tensor": 2}  # PaddleNLP: data = what sharding leaves
    assert resolve_degrees(tensor=2, sharding=-1, data=2, world_size=8) == {"data": 2, "sharding": 2, "pipe": 1,
                                                                           "tensor": 2}
    assert resolve_degrees(sharding=-1, world_size=1) == {"data": 1, "sharding": 1, "pipe": 1, "tensor": 1}
    with pytest.raises(TopologyError, match=r"sharding_parallel_degree -1 .* tensor_parallel_degree \(4\) .* "
                                            r"does not divide the world size 6"):
        resolve_degrees(tensor=4, sharding=-1, world_size=6)
    with pytest.raises(TopologyError, match=r"data_parallel_degree \(3\) = 3 leave"):
        resolve_degrees(sharding=-1, data=3, world_size=4)


def test_sharding_degree_minus_one_without_a_stage_means_no_sharding():
    assert load_config(DERIVED, ["sharding="]).sharding_parallel_degree == 1  # PaddleNLP: -1 needs a stage
    assert load_config(DERIVED, ["sharding=stage3"]).sharding == "stage3"  # -1: the ranks left (topology)
    # refused at degree 1, where it would do nothing (PaddleNLP drops it there without a word)
    with pytest.raises(ConfigError, match="stage3 partitions .* at degree 1 there is nothing to partition"):
        load_config(None, [MODEL, "sharding=stage3", "sharding_parallel_degree=1"])
    with pytest.raises(ConfigError, match="stage3 with pipeline_parallel_degree > 1 is not implemented"):
        load_config(None, [MODEL, "sharding=stage3", "sharding_parallel_degree=2", "pipeline_parallel_degree=2"])
    from paddle_rl.parallel.topology import TopologyError, build_topology
    with pytest.raises(TopologyError, match="stage3 partitions .* at degree 1"):  # -1 resolved to 1 on one process
        build_topology(sharding=-1, sharding_stage="stage3")
    with pytest.raises(ConfigError, match="sharding_parallel_degree: must be >= 1 or -1, got -2"):
        load_config(None, [MODEL, "sharding_parallel_degree=-2"])


def test_max_length_must_hold_prompt_and_response():
    assert load_config(FIXTURE).max_length == 4608  # 512 + 4096 exactly
    with pytest.raises(ConfigError) as err:
        load_config(FIXTURE, ["max_dec_len=8192"])
    assert "max_length: 4608 is shorter than max_prompt_len (512) + max_dec_len (8192) = 8704" in str(err.value)
    with pytest.raises(ConfigError, match="max_length: must be > 0 or -1, got 0"):
        load_config(None, [MODEL, "max_length=0"])
    assert load_config(None, [MODEL, "max_length=-1", "max_dec_len=100000"]).max_length == -1


@pytest.mark.parametrize("value,message", [
    ("tensorbord", "report_to: 'tensorbord' not one of visualdl, tensorboard, wandb, all, none"),
    ("none,wandb", "report_to: none and all stand alone"),
])
def test_report_to_names_are_checked(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, f"report_to={value}"])
    assert message in str(err.value)


def test_report_to_accepts_lists():
    cfg = load_config(None, [MODEL, "report_to=[tensorboard, VisualDL]"])
    assert cfg.report_targets == ("tensorboard", "visualdl")


def test_kv_cache_dtype_spellings():
    assert load_config(None, [MODEL, "kv_cache_dtype=bf16"]).kv_cache_dtype == "bfloat16"
    assert load_config(None, [MODEL, "kv_cache_dtype=FP16"]).kv_cache_paddle_dtype == "float16"
    assert load_config(None, [MODEL]).kv_cache_paddle_dtype is None   # auto: the model's compute dtype


def test_recompute_granularity_reaches_the_model():
    assert load_config(None, [MODEL, "recompute=true", "recompute_granularity=core_attn"]).recompute_what == "core_attn"
    assert load_config(None, [MODEL, "recompute=true"]).recompute_what == "full"
    assert load_config(None, [MODEL]).recompute_what is None


def test_rollout_precision_keys():
    """rollout_dtype (float32 | bfloat16) and rollout_quant_type act: the KV cache follows rollout_dtype unless
    kv_cache_dtype names one; unknown values name the key and what it allows."""
    cfg = load_config(None, [MODEL, "rollout_dtype=bf16", "rollout_quant_type=weight_only_int8"])
    assert cfg.rollout_dtype == "bfloat16" and cfg.rollout_quant_type == "weight_only_int8"
    assert cfg.kv_cache_paddle_dtype == "bfloat16"
    assert load_config(None, [MODEL, "rollout_dtype=bfloat16", "kv_cache_dtype=float32"]).kv_cache_paddle_dtype == "float32"
    assert load_config(None, [MODEL]).rollout_dtype == "float32"
    with pytest.raises(ConfigError, match="rollout_quant_type: must be '' .off., weight_only_int8 or weight_only_int4, "
                                          "got 'a8w8'"):
        load_config(None, [MODEL, "rollout_quant_type=a8w8"])
    with pytest.raises(ConfigError, match="rollout_dtype: must be auto, float32 or bfloat16, got 'float16'"):
        load_config(None, [MODEL, "rollout_dtype=float16"])


def test_warmup_stable_decay_schedule():
    """lr_scheduler_type warmup_stable_decay: the warm-up, the peak, then a cosine decay over the last lr_decay_steps
    optimizer steps to min_lr_ratio; lr_decay_steps is required with it and refused without it."""
    from paddle_rl.optim import lr_factor
    f = lr_factor("warmup_stable_decay", 45, 3, 0.1, 15)
    assert [f(i) for i in (0, 1, 2)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(f(i) == 1.0 for i in range(2, 31))        # the first 30 steps as a constant schedule
    assert f(37) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))
    assert f(44) < 0.12 and f(45) == pytest.approx(0.1)
    cfg = load_config(None, [MODEL, "lr_scheduler_type=warmup_stable_decay", "lr_decay_steps=15"])
    assert cfg.lr_scheduler_type == "warmup_stable_decay" and cfg.lr_decay_steps == 15
    with pytest.raises(ConfigError, match="lr_decay_steps: warmup_stable_decay needs lr_decay_steps > 0"):
        load_config(None, [MODEL, "lr_scheduler_type=warmup_stable_decay"])
    with pytest.raises(ConfigError, match="lr_decay_steps: read by lr_scheduler_type warmup_stable_decay only"):
        load_config(None, [MODEL, "lr_scheduler_type=cosine", "lr_decay_steps=15"])

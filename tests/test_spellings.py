"""Other frameworks' spellings of a run (config/spellings.py): ms-swift's `swift rlhf` flags, verl's dotted keys,
the train.sh flags of verl-based recipes; each seed's example command (program name, model and data paths
replaced by local ones) trains on a bundled model, and one short run writes the same metrics under every spelling."""
import json
import os
import subprocess
import sys

import pytest

from micro_model import micro_overrides
from paddle_rl.cli import parse_args
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH_MODEL = os.path.join(ROOT, "data", "tiny_arith", "model")
ARITH_TEST = os.path.join(ROOT, "data", "tiny_arith", "arith", "test.jsonl")
ENV = dict(os.environ, PYTHONPATH=ROOT)


def cli_config(argv):
    """The config a `paddle-rl train ...` command line reads (flags and all)."""
    args = parse_args(["train", *argv])
    return load_config(args.config, args.overrides, warn_unused=False)


def run_in_process(config, out):
    from paddle_rl.trainer import RLTrainer
    RLTrainer(config).train()
    rows = read_metrics(str(out / "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def arith_questions():
    """(question, answer) of the bundled arithmetic test set, the question without its chat template."""
    with open(ARITH_TEST, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [(r["src"].split("user\n", 1)[1].split("<|im_end|>", 1)[0], r["tgt"]) for r in records]


# ---- one run, three spellings, the same metrics

def test_the_same_run_under_each_spelling_writes_the_same_metrics(micro, tmp_path):
    """Our keys, ms-swift's flags and verl's dotted keys for one GRPO run (prompts per step and per optimizer step,
    samples, lengths, KL in the loss, clip, lr, steps, evaluation): identical metrics, step by step."""
    common = dict(max_steps=3, eval_steps=2, save_steps=2, report_to="none", learning_rate=1e-3)
    ours = run_in_process(load_config(None, micro_overrides(
        micro, str(tmp_path / "ours"), **common, kl_loss_coeff=0.04, clip_range_ratio=0.25, loss_agg_mode="seq-mean-token-mean",
        algorithm_preset="trl", lora=False), warn_unused=False), tmp_path / "ours")
    swift = cli_config([
        "--rlhf_type", "grpo", "--model", micro["model"], "--dataset", micro["train"], "--val_dataset", micro["test"],
        "--reward_funcs", "kk", "--num_generations", "4", "--max_completion_length", "12", "--max_length", "128",
        "--temperature", "1.0", "--beta", "0.04", "--epsilon", "0.25", "--loss_type", "grpo", "--tuner_type", "full",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--steps_per_generation", "4",
        "--learning_rate", "1e-3", "--max_steps", "3", "--eval_steps", "2", "--save_steps", "2", "--seed", "11",
        "--output_dir", str(tmp_path / "swift"), "--report_to", "none", "--per_device_eval_batch_size", "16",
        "--disable_tqdm", "true", "per_device_logprob_batch_size=8"])
    assert (swift.global_batch_size, swift.global_mini_batch_size, swift.max_prompt_len) == (4, 2, 128)
    verl = cli_config([
        f"actor_rollout_ref.model.path={micro['model']}", f"data.train_files={micro['train']}",
        f"data.val_files={micro['test']}", "data.train_batch_size=4", "data.max_prompt_length=128",
        "data.max_response_length=12", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "actor_rollout_ref.actor.kl_loss_type=k3", "actor_rollout_ref.actor.clip_ratio=0.25",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=3", "trainer.test_freq=2",
        "trainer.save_freq=2", f"trainer.default_local_dir={tmp_path / 'verl'}", "trainer.logger=[console]",
        "reward_funcs=[kk]", "seed=11", "algorithm_preset=trl", "per_device_eval_batch_size=16",
        "per_device_logprob_batch_size=8", "disable_tqdm=true"])
    assert len(ours) == 4 and "eval/accuracy" in ours[0]
    assert run_in_process(swift, tmp_path / "swift") == ours
    assert run_in_process(verl, tmp_path / "verl") == ours


# ---- each seed's command on a bundled model

def test_ms_swift_grpo_command_trains(tmp_path):
    """ms-swift's `swift rlhf --rlhf_type grpo ...` command, run as `paddle-rl train ...` with the model and the
    dataset replaced by local ones (the bundled arithmetic model; its questions as ms-swift `messages` +
    `solution` records), bounded to one step."""
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "solution": a}) + "\n"
                            for q, a in arith_questions()))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "paddle_rl", "train", "--rlhf_type", "grpo", "--model", ARITH_MODEL, "--dataset",
         str(data), "--reward_funcs", "accuracy", "format", "--num_generations", "8", "--max_completion_length",
         "2048", "--beta", "0.04", "--torch_dtype", "bfloat16", "--tuner_type", "lora",
         "--per_device_train_batch_size", "8", "--max_steps", "1", "--output_dir", str(out), "--report_to", "none"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "num_generations 8 -> rollout_n 8" in result.stderr and "tuner_type lora -> lora True" in result.stderr
    assert "torch_dtype bfloat16 -> bf16 True" in result.stderr and "ms-swift default -> temperature 0.9" in result.stderr
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["reward/mean"] == pytest.approx(rows[0]["reward/accuracy_mean"] + rows[0]["reward/format_mean"])
    assert (out / "checkpoint-1" / "adapter_config.json").is_file()   # LoRA: a PEFT adapter


def test_verl_train_sh_command_trains(tmp_path):
    """train.sh's `--model --rollout_n --epochs --reward_func FILE` after the bundled defaults table
    (configs/verl_train_sh.yaml), its data a JSON array of {prompt, ground_truth, data_source} with plain-string
    prompts (templated as user turns), its reward a verl compute_score file; bounded to one step."""
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"prompt": q, "ground_truth": a, "data_source": "arith"}
                                for q, a in arith_questions()[:64]]))
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "import re\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    found = re.findall(r'<answer>\\s*(-?\\d+)\\s*</answer>', solution_str)\n"
        "    return 1.0 if found and found[-1] == str(ground_truth) else 0.0\n")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "paddle_rl", "train", "configs/verl_train_sh.yaml", "--model", ARITH_MODEL,
         "--rollout_n", "8", "--epochs", "20", "--reward_func", str(reward), f"data.train_files={data}",
         "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_response_length=48",
         "trainer.total_training_steps=1", f"trainer.default_local_dir={out}", "trainer.logger=[console]"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("actor_rollout_ref.rollout.n 5 -> rollout_n 5", "epochs 20 -> num_train_epochs 20",
                 f"reward_func {reward} -> reward_funcs compute_score",
                 "actor_rollout_ref.actor.use_kl_loss True actor_rollout_ref.actor.kl_loss_coef 0.001 -> "
                 "kl_loss_coeff 0.001"):
        assert line in result.stderr, line
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]
    # the compute_score file scored the 32 samples (8 per prompt): the warm-started model gets some right
    assert 0 < rows[0]["reward/compute_score_mean"] <= 1


# ---- what is translated, ignored, refused

def test_translations_refusals_and_precedence(tmp_path):
    config = cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, "--rlhf_type", "grpo",
                         "--vllm_gpu_memory_utilization", "0.5", "--deepspeed", "zero2", "--use_vllm", "true",
                         "--vllm_mode", "server", "--vllm_server_host", "10.0.0.2", "10.0.0.3",
                         "--vllm_server_port", "8000", "--importance_sampling_level", "sequence",
                         "--scale_rewards", "batch", "--system", "Be brief.", "--truncation_strategy", "delete",
                         "--per_device_train_batch_size", "8", "--num_generations", "8"])
    assert config.rollout_server_urls == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert (config.sharding, config.sharding_parallel_degree) == ("stage2", -1)   # every rank, as ZeRO shards
    zero3 = cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, "--deepspeed", "zero3"])
    assert (zero3.sharding, zero3.sharding_parallel_degree) == ("stage3", -1)   # parameters partitioned too
    assert (config.policy_loss, config.scale_rewards, config.system_prompt) == ("gspo", "batch", "Be brief.")
    assert config.prompt_overflow == "drop"
    assert any(line.startswith("vllm_gpu_memory_utilization 0.5: vLLM's share") for line in config.untranslated)
    for argv, message in (
            (["--rlhf_type", "dpo"], "rlhf_type dpo: this suite trains from rewards"),
            (["--deepspeed", "zero3_offload"], "deepspeed zero3_offload: zero0, zero1, zero2 or zero3"),
            (["--torch_dtype", "float64"], "torch_dtype float64: bfloat16, float16 or float32"),
            (["--chord_sft_dataset", "x.jsonl"], "chord_sft_dataset x.jsonl: CHORD"),
            (["--top_entropy_quantile", "0.2"], "top_entropy_quantile 0.2: a loss on the highest-entropy tokens"),
            (["--use_vllm", "true"], "vllm_mode is required with use_vllm"),
            (["actor_rollout_ref.actor.fsdp_config.param_offload=true"], "param_offload True: parameter offload"),
            (["actor_rollout_ref.rollout.nonsense=3"], "actor_rollout_ref.rollout.nonsense: a verl key with no "
                                                       "translation here"),
            (["--num_generations", "8", "rollout_n=4"], "num_generations 8 sets rollout_n to 8, and rollout_n is 4"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, *argv])
    # dr_grpo divides by the length bound, whichever spelling gave it
    for length in (["--max_completion_length", "96"], ["max_dec_len=96"]):
        config = cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, "--loss_type", "dr_grpo", *length])
        assert (config.loss_agg_mode, config.loss_scale_factor) == ("seq-mean-token-sum-norm", 96.0)
    # a later source wins: the file's max_dec_len, then the command line's max_completion_length
    file = tmp_path / "c.yaml"
    file.write_text(f"actor_model_name_or_path: {ARITH_MODEL}\ntrain_datasets: {ARITH_TEST}\nmax_dec_len: 128\n"
                    f"data:\n  max_prompt_length: 64\n")
    config = cli_config([str(file), "--max_completion_length", "32"])
    assert (config.max_dec_len, config.max_prompt_len) == (32, 64)
    # forms: --key=value, a bare switch, several values, negative numbers, key=value after flags
    args = parse_args(["train", str(file), "--reward_funcs=kk", "--dynamic_sample", "--reward_weights", "1", "-0.5",
                       "--reward_funcs", "kk", "format", "seed=3"])
    assert args.overrides == ["reward_funcs=kk", "dynamic_sample=true", 'reward_weights=[1, -0.5]',
                              'reward_funcs=["kk", "format"]', "seed=3"]


def test_system_prompt_goes_into_templated_prompts_only(tmp_path):
    """ms-swift's --system (a string, or a .txt file): the first turn of every prompt the template renders; a prompt
    already in chat form cannot take it and is refused by name."""
    from paddle_rl.data.loader import DatasetError, load_prompt_dataset
    from paddle_rl.models import Tokenizer
    tok = Tokenizer.from_pretrained(ARITH_MODEL)
    (tmp_path / "system.txt").write_text("Answer in digits.")
    config = cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, "--system", str(tmp_path / "system.txt")])
    assert config.system_prompt == "Answer in digits."
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "What is 1 + 2 + 3?", "ground_truth": "6"}) + "\n")
    item = load_prompt_dataset(str(plain), tok, system_prompt=config.system_prompt)[0]
    assert item["prompt"] == tok.apply_chat_template([{"role": "system", "content": "Answer in digits."},
                                                      {"role": "user", "content": "What is 1 + 2 + 3?"}])
    with pytest.raises(DatasetError, match=r"test\.jsonl:1: 'src' is used as written .* so system_prompt cannot be "
                                           r"added"):
        load_prompt_dataset(ARITH_TEST, tok, system_prompt="Answer in digits.")


def test_rollout_server_takes_swift_rollout_flags(micro):
    """`swift rollout --model M --port P --vllm_tensor_parallel_size 1` as `paddle-rl rollout-server ...`."""
    from paddle_rl.rollout_server.cli import build_service
    args = parse_args(["rollout-server", "--model", micro["model"], "--port", "8123",
                       "--vllm_tensor_parallel_size", "1", "--vllm_gpu_memory_utilization", "0.9"])
    assert args.port == 8123 and args.config is None
    assert args.overrides == [f"model={micro['model']}", "vllm_tensor_parallel_size=1",
                              "vllm_gpu_memory_utilization=0.9"]
    service, folder = build_service(args.config, args.overrides)
    assert folder == micro["model"] and service.identity["vocab_size"] > 0


def test_train_sh_data_sources_pick_their_rules():
    """configs/verl_train_sh.yaml's data_source table: qa, trivia, classification, gsm8k and math records each scored
    by their rule, right and wrong (the recipe's own reward table, without --reward_func)."""
    from paddle_rl.rewards import RewardSample, build_local_reward
    config = cli_config([os.path.join(ROOT, "configs", "verl_train_sh.yaml"), "--model", ARITH_MODEL,
                         f"data.train_files={ARITH_TEST}"])
    cases = [("qa", "Paris", "<answer> the Paris </answer>", "<answer> Lyon </answer>"),
             ("trivia", ["Jay-Z", "Shawn Carter"], "<answer>jay z</answer>", "<answer>Kanye</answer>"),
             ("classification", "positive", "<answer> Positive </answer>", "<answer> negative </answer>"),
             ("gsm8k", "72", "so #### 72", "so #### 71"),
             ("math_reasoning", "\\frac{1}{2}", "<answer> 0.5 </answer>", "<answer> 0.25 </answer>")]
    samples = [RewardSample("p", response, {"data_source": source, "ground_truth": truth}, 8)
               for source, truth, right, wrong in cases for response in (right, wrong)]
    result = build_local_reward(config)(samples)
    assert [float(s) for s in result.scores] == [1.0, 0.0] * len(cases)


def test_swift_float16_is_fp16_training():
    """ms-swift's --torch_dtype float16 trains in float16 mixed precision: fp16 true (loss scaling on), bf16 false."""
    config = cli_config(["--model", ARITH_MODEL, "--dataset", ARITH_TEST, "--torch_dtype", "float16"])
    assert config.fp16 and not config.bf16 and config.scale_loss == 2.0 ** 15

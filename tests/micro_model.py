"""A micro model + tokenizer + KK data for tests (random weights: fast, not meant to learn)."""
import os
import signal
import subprocess
import sys
import time

import paddle

from make_tiny_model import build_data, build_tokenizer, sft_response
from paddle_rl.models import CausalLM, ModelConfig
from paddle_rl.models.pretrained import save_model, write_generation_config


def build_micro(root: str, hidden: int = 32, layers: int = 2, seed: int = 3) -> dict:
    data_dir, model_dir = os.path.join(root, "kk"), os.path.join(root, "model")
    splits = build_data(data_dir, [2, 3], seed, n_sft=40, n_train=64, n_test=16)
    corpus = [r["src"] + sft_response(r["tgt"]) for recs in splits.values() for r in recs]
    tokenizer = build_tokenizer(corpus, 400, model_dir)
    config = ModelConfig(model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    paddle.seed(seed)
    model = CausalLM(config)
    model.init_weights()
    save_model(model, model_dir)
    write_generation_config(model_dir, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    return {"root": root, "model": model_dir, "train": os.path.join(data_dir, "train.jsonl"),
            "test": os.path.join(data_dir, "test.jsonl"), "tokenizer": tokenizer}


def micro_overrides(micro: dict, output_dir: str, **extra) -> list:
    values = dict(actor_model_name_or_path=micro["model"], train_datasets=micro["train"],
                  eval_datasets=micro["test"], output_dir=output_dir, max_prompt_len=128, max_dec_len=12,
                  min_dec_len=1, temperature=1.0, rollout_n=4, global_batch_size=4, global_mini_batch_size=2,
                  per_device_train_batch_size=4, per_device_logprob_batch_size=8, per_device_eval_batch_size=16,
                  learning_rate=1e-3, max_steps=3, do_eval=True, eval_steps=2, save_steps=2, seed=11,
                  disable_tqdm=True, report_to="visualdl")
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_file(overrides: list, path) -> str:
    """`key=value` overrides as a YAML config file (what a user's run reads)."""
    with open(path, "w") as f:
        f.write("\n".join(f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}" for o in overrides) + "\n")
    return str(path)


def train_process(config: str, *overrides) -> subprocess.CompletedProcess:
    """`paddle-rl train CONFIG [overrides]` in a process of its own, to the end."""
    return subprocess.run([sys.executable, "-m", "paddle_rl", "train", config, *overrides], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)


def kill_after_checkpoint(config: str, output_dir, step: int = 2, delay: float = 0.0) -> None:
    """Start `paddle-rl train CONFIG output_dir=...` and kill it with SIGKILL once checkpoint-`step` is written (and
    `delay` seconds more): the run is cut in the middle of the next step."""
    proc = subprocess.Popen([sys.executable, "-m", "paddle_rl", "train", config, f"output_dir={output_dir}"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not os.path.isdir(os.path.join(str(output_dir), f"checkpoint-{step}")) and time.time() < deadline \
            and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"

"""TRL's side of W1, W3 and W4 through its GRPOTrainer, for a same-sitting comparison with `paddle-rl bench`.

    pip install trl "torch==2.13.0"   # outside the suite's requirements (pulls datasets); the CPU torch stays
    python tools/bench_trl.py --workload w1 [--bf16] [--steps 2]
    python tools/bench_trl.py --workload w3 --model-path ~/.cache/paddle_rl/models/SmolLM2-135M-Instruct [--bf16]
    python tools/bench_trl.py --workload w4 --model-path DIR [--bf16]

The same work as `paddle-rl bench --workload ...` (paddle_rl/bench.py, docs/performance.md):
- W1: the bench's random-init 5M-parameter Qwen2 model, WordLevel tokenizer and synthetic prompts of 28-36 tokens,
  built by the bench's own builder (`build_workload`, in a child process: Paddle stays out of this one) in a
  temporary folder and loaded by transformers from the same safetensors; 8 prompts x 8 samples, exactly 64 tokens.
- W3: a chat model (`--model-path`, e.g. SmolLM2-135M-Instruct), the bench's 8 chat prompts x 8, exactly 128 tokens.
- W4: the same model and prompts sampled naturally: temperature 1, at most 512 tokens, no minimum.
Every workload: beta 0.04 (the reference model runs), one optimizer step per generation batch (the prompts' groups
as micro-batches of rollout_n rows), gradient checkpointing off (`--gradient-checkpointing`: on, TRL's default, for a
memory comparison), the reward the number of distinct characters
(the bench's `distinct_chars` rule scores their share; the advantages' groups see the same order). `--bf16`:
TrainingArguments bf16=True (torch autocast, bf16 matmuls). `--prompts`, `--rollout-n`, `--response-len` change the
sizes as the bench's options do.

Prints each step's seconds and CPU seconds (a TrainerCallback around the step: generation, the reference pass, the
update; CPU seconds read a shared machine's step better), the completions' mean length, and the process's peak RSS,
then one JSON line. The machine is named as the bench names it (CPU model, flags, cores).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paddle_rl.bench import CHAT_PROMPTS, DEFAULT_PROMPTS, DEFAULT_ROLLOUT_N, WORKLOADS, machine  # noqa: E402

TRL_WORKLOADS = ("w1", "w3", "w4")


def build_w1(folder: str, prompts: int, prompt_len: int, seed: int) -> dict:
    """W1's model folder and prompts, made by the bench's builder in a child process (it needs Paddle; this process
    runs torch alone) -> {model_dir, data}."""
    code = ("import json, sys; from paddle_rl.bench import build_workload; "
            "print(json.dumps(build_workload(sys.argv[1], 'w1', int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code, folder, str(prompts), str(prompt_len), str(seed)], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def w1_prompts(data: str, count: int) -> list:
    """The first `count` prompts of the bench's W1 file (text, one token per word)."""
    with open(data, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [records[i % len(records)]["src"] for i in range(count)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=TRL_WORKLOADS, default="w3")
    p.add_argument("--model-path", default=None, help="W3 / W4: a Hugging Face chat model folder (e.g. the converted "
                                                      "SmolLM2-135M-Instruct)")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments bf16=True (torch autocast, bf16 matmuls)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="TRL's default gradient checkpointing on (off without it, as the bench's timing runs)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS)
    p.add_argument("--rollout-n", type=int, default=DEFAULT_ROLLOUT_N)
    p.add_argument("--response-len", type=int, default=None, help="the workload's (exact for W1 and W3, the maximum "
                                                                  "for W4)")
    p.add_argument("--prompt-len", type=int, default=32, help="W1: prompt length (+-4 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--output-dir", default=None, help="TRL's output folder (default: a temporary one)")
    args = p.parse_args(argv)
    spec = WORKLOADS[args.workload]
    length = args.response_len or spec["response_len"]
    if args.workload != "w1" and not args.model_path:
        p.error(f"--workload {args.workload} needs --model-path (a chat model folder)")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="bench_trl_")
    count = args.prompts * args.steps
    if args.workload == "w1":
        work = build_w1(tmp.name, args.prompts * max(args.steps, 1), args.prompt_len, args.seed)
        model_dir = work["model_dir"]
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                            eos_token="<|im_end|>", pad_token="<|endoftext|>")
        prompts = w1_prompts(work["data"], count)
    else:
        model_dir = args.model_path
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(count)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": prompts})

    def distinct_chars(completions, **_):
        return [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]

    exact = spec["exact"]
    config = GRPOConfig(
        output_dir=args.output_dir or os.path.join(tmp.name, "out"), report_to="none", use_cpu=True, bf16=args.bf16,
        seed=args.seed, per_device_train_batch_size=args.rollout_n, gradient_accumulation_steps=args.prompts,
        num_generations=args.rollout_n, max_completion_length=length,
        generation_kwargs={"min_new_tokens": length} if exact else {}, temperature=1.0, top_p=1.0,
        beta=0.04, learning_rate=1e-6, max_steps=args.steps, logging_steps=1, save_strategy="no",
        gradient_checkpointing=args.gradient_checkpointing, shuffle_dataset=False,   # TRL's default is on
        dataloader_num_workers=0)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.cpu_seconds, self.begin = [], [], None

        def on_step_begin(self, *a, **k):
            self.begin = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.begin[0])
            self.cpu_seconds.append(time.process_time() - self.begin[1])
            print(f"step {len(self.seconds)}: {self.seconds[-1]:.1f} s, {self.cpu_seconds[-1]:.1f} CPU s", flush=True)

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_chars, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history if "completions/mean_length" in log]
    tmp.cleanup()
    print(json.dumps({"tool": "trl", "workload": args.workload, "model": args.model_path or "w1 (the bench's)",
                      "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing, "prompts": args.prompts, "rollout_n": args.rollout_n,
                      "response_len": length, "exact_length": exact, "completion_mean_lengths": lengths,
                      "threads": args.threads, "step_seconds": timer.seconds, "step_cpu_seconds": timer.cpu_seconds,
                      "wall_seconds": wall, "peak_rss_mb": round(peak_mb), **machine(),
                      "torch": torch.__version__, "trl": __import__("trl").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

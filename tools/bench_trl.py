"""W3 through TRL's GRPOTrainer, for a same-sitting comparison with `paddle-rl bench --workload w3`.

    pip install trl        # outside the suite's requirements (pulls datasets); torch==2.13.0 CPU stays
    python tools/bench_trl.py --model-path ~/.cache/paddle_rl/models/SmolLM2-135M-Instruct [--bf16] [--steps 2]

The same work as W3: the 8 chat prompts of paddle_rl/bench.py x 8 generations, exactly 128 completion tokens
(min_new_tokens = max_completion_length), beta 0.04 (the reference model runs), one optimizer step per generation
batch of 64 (8 micro-batches of 8), gradient checkpointing off, the reward the number of distinct characters (the
bench's `distinct_chars` rule). Prints each step's seconds and CPU seconds (a TrainerCallback around the step:
generation, the reference and old log-prob passes, the update; CPU seconds read a shared machine's step better) and
the process's peak RSS, then one JSON line.
"""
import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.bench import CHAT_PROMPTS  # noqa: E402  (imports no Paddle)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a Hugging Face model folder (e.g. the converted SmolLM2)")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments bf16=True (torch autocast, bf16 matmuls)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--output-dir", default="/tmp/bench_trl")
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, torch_dtype=torch.float32)
    prompts = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    data = Dataset.from_dict({"prompt": prompts * args.steps})

    def distinct_chars(completions, **_):
        return [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]

    length = 128
    config = GRPOConfig(
        output_dir=args.output_dir, report_to="none", use_cpu=True, bf16=args.bf16, seed=0,
        per_device_train_batch_size=8, gradient_accumulation_steps=8, num_generations=8,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length}, temperature=1.0,
        beta=0.04, learning_rate=1e-6, max_steps=args.steps, logging_steps=1, save_strategy="no",
        gradient_checkpointing=False, shuffle_dataset=False, dataloader_num_workers=0)

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
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tool": "trl", "bf16": args.bf16, "threads": args.threads, "step_seconds": timer.seconds, "step_cpu_seconds": timer.cpu_seconds,
                      "wall_seconds": time.perf_counter() - start, "peak_rss_mb": round(peak_mb),
                      "torch": torch.__version__, "trl": __import__("trl").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

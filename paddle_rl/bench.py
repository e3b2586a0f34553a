"""`paddle-rl bench`: time RL steps of a workload through the real trainer.

    paddle-rl bench                                   # W1 (3 timed steps)
    paddle-rl bench --workload w2 --steps 2
    paddle-rl bench --workload w3 --model-path DIR     # DIR: a converted SmolLM2-135M-Instruct folder
    paddle-rl bench --workload w4 --model-path DIR --steps 1
    paddle-rl bench --rollout-n 16 --response-len 128 --set recompute=true

Workloads (docs/performance.md):
- W1: a random-init Qwen2-architecture decoder (hidden 256, 4 layers, 4 heads, 2 KV heads, ffn 688, vocab 4096,
  untied head), 8 prompts of ~32 tokens x rollout_n 8, exactly 64 response tokens (min_dec_len = max_dec_len),
  kl_loss_coeff 0.04 (reference model on), one optimizer step per rollout, fp32.
- W2: W1's model and prompts; response lengths forced by an EOS schedule to a fixed long-tailed set (the 64
  quantiles of a log-normal with median 96, sigma 1, cut at 1024; the same set every step, assigned to samples
  by their sampling keys), so every run generates exactly the same lengths.
- W3: a real model (`--model-path`), 8 chat prompts x 8 samples, exactly 128 response tokens, kl_loss_coeff 0.04.
- W4: the same model and prompts sampled naturally: temperature 1.0, max_dec_len 512, no minimum length.
- W5: code RL at a size users train: Qwen2.5-Coder-0.5B-Instruct (`paddle-rl fetch qwen2.5-coder-0.5b-instruct`;
  `--model-path` for another), the first 4 HumanEval tasks (`paddle-rl fetch humaneval`, the records `paddle-rl
  eval --benchmark humaneval` scores) x 4 samples sampled naturally (temperature 1.0, max_dec_len 256), scored by
  the `code` rule in its sandbox; full training by default, `--set lora=true` for LoRA, `--set bf16=true`.
W2-W5 train packed (use_remove_padding: true) in micro-batches of at most 8192 tokens (max_tokens_per_micro_batch),
with the attention core and the MLP blocks recomputed in the backward (recompute: true, recompute_granularity:
core_attn_mlp; the gradients are core_attn's bit for bit, W3's peak RSS 11.4 -> 6.7 GB; the MLP's down projection
is not run again, only its gradients taken).

`--rollout-precisions float32,bfloat16,weight_only_int8` times the workload's rollout alone (no training) in
--steps rounds that run each rollout precision in turn (the best round of each counts: a shared machine's load
drifts between runs), per rollout precision (rollout_dtype, or a rollout_quant_type with float32 activations; `bfloat16+weight_only_int8`
both) on the same prompts, keys and forced lengths (W3: exactly response_len; W4: the 64 quantiles of a log-normal
with median 270 cut at 512, mean 294), and reports each one's seconds and its speed-up over the first.

`--set rollout_server_urls=local` (or URLs of servers of the same model; each `local` entry is a `paddle-rl
rollout-server` the bench starts on 127.0.0.1 with the run's config): a second trainer of the same config and seeds
generates on the servers, and the two run step by step in turn (the same work, the same drift of a shared machine's
load); printed below the inline run: its step, its ratio to the inline step, the servers' generation, the weight
push's seconds (serialising apart) and bytes per server.

`--switches [LIST]` times the fused-kernel switches (use_flash_attention, use_fused_rms_norm, use_fused_rope,
use_fused_head_and_loss_fn, use_fused_linear; all, or those listed): the workload with the config's switches and with
each flipped, one at a time, --warmup + --steps rounds alternated in one process (`switch_runs`); a table of seconds
per step and stage, the ratio to the baseline, peak RSS and Paddle tensors' peak per run, then one JSON object.

Prints the configuration (the --set overrides, each fused-kernel switch and the path it takes), seconds per step and
its split by stage, generated and trained tokens, rows processed by decode steps, effective GFLOP/s against the fp32
matmul peak measured in the same process, each stage's GFLOP/s and its share of the peak of the precision it runs in
(`stage_peak_fraction`), peak RSS and each stage's peak RSS and Paddle tensors (monitor/memory.py); the last line is
one JSON object. Matmul peaks (`matmul_peaks`): square products and the workload's own linear shapes, measured before the
trainer is built and again after the run, the best of each kind kept: fp32 (paddle.matmul; `matmul_peak_gflops`,
the effective rates' yardstick), the suite's bf16 training product and packed bf16 rollout kernel, and PyTorch's
bf16 matmul as an outside reference where torch is importable (`<kind>_peak_gflops`, `_before_` / `_after_`;
`--peaks` picks the kinds).
"""
# Each workload imports what it runs inside its function: `paddle-rl bench --help` and the parser of every other
# command stay without Paddle and the model code.
import argparse
import json
import logging
import math
import os
import resource
import sys
import tempfile
import time
from typing import Optional

import yaml

from .config import ConfigError, load_config
from .env import configure_threads, cpu_info, malloc_mode
from .model_files.hub import fetch_benchmark, resolve_model
from .monitor import memory
from .soak import soak_main

MODELS = {
    "w1": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False),
    # SmolLM2-135M's shapes (W3 / W4's model) at random init: a rollout's time depends on the shapes alone
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
STAGES = ("rollout", "reward", "ref_logprob", "old_logprob", "advantage", "update")
CRITIC_STAGES = ("values", "critic_update")  # rl_algorithm ppo: the critic's value pass and its update
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
# what each workload sets (command-line options override); `lengths`: the response lengths of W2's schedule
# W2-W4 train packed (use_remove_padding) in micro-batches of at most 8192 tokens, with the attention probabilities
# recomputed in the backward (kept, they grow with the sequence: W4's peak RSS was 1.23x W3's, 1.16x without
# them), as a user at real lengths would, and the MLP blocks too (their activations were ~60% of the update's:
# W3 11.4 -> 6.7 GB peak RSS, the same gradients)
REAL_LENGTHS = {"use_remove_padding": True, "max_tokens_per_micro_batch": 8192, "recompute": True,
                "recompute_granularity": "core_attn_mlp"}
WORKLOADS = {
    "w1": dict(model="w1", response_len=64, exact=True, settings={}),
    "w2": dict(model="w1", response_len=1024, exact=False, lengths="long_tail", settings=REAL_LENGTHS),
    "w3": dict(model="path", response_len=128, exact=True, settings=REAL_LENGTHS),
    "w4": dict(model="path", response_len=512, exact=False, settings=REAL_LENGTHS),
    "w5": dict(model="path", model_path="qwen2.5-coder-0.5b-instruct", data="humaneval", prompts=4, rollout_n=4,
               response_len=256, exact=False,
               settings={**REAL_LENGTHS, "reward_funcs": ["code"], "max_prompt_len": 1024}),
}
# the prompts and samples of a workload that does not set them (--prompts / --rollout-n override)
DEFAULT_PROMPTS, DEFAULT_ROLLOUT_N = 8, 8
CHAT_PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of the seasons on Earth?",
    "Give me some tips for learning a new language.",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "How do plants make their food?",
    "Write a poem about the ocean.",
]


def long_tail_lengths(count: int, median: float = 96.0, sigma: float = 1.0, cap: int = 1024):
    """`count` response lengths: the quantiles (i + 0.5) / count of a log-normal with this median and sigma, cut
    to [1, cap] (W2: median 96, the longest 1024 for 64 samples)."""
    from statistics import NormalDist
    normal = NormalDist()
    return [int(min(cap, max(1, round(median * math.exp(sigma * normal.inv_cdf((i + 0.5) / count))))))
            for i in range(count)]


class ForcedLengths:
    """A stage of the rollout engine (rollout/engine.py) that makes each sample stop at exactly the length
    `schedule(keys)` gives it (an EOS schedule): the stop tokens banned until the row is one token short of it, then
    every token but the first stop token (drawn with log-prob 0). Touches only the stop tokens' columns and the rows
    at their target."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.targets = {}

    def start(self, seqs, keys, params) -> None:
        import numpy as np
        targets = np.asarray(self.schedule(keys), dtype=np.int64)
        if targets.min() < 1 or targets.max() > params.max_dec_len:
            raise ValueError(f"forced lengths must lie in [1, max_dec_len {params.max_dec_len}]")
        self.targets = {seq.row: int(targets[seq.row]) for seq in seqs}

    def logits(self, seqs, logits, generated, stop_ids):
        import numpy as np
        # deferred: Paddle and ops/ load when a workload runs; the bench's parser and report stay without them
        import paddle
        from .ops.sampling import NEG_INF
        targets = np.array([self.targets[s.row] for s in seqs])
        before = generated + 1 < targets
        if before.any():
            ban = paddle.to_tensor(before.reshape(-1, 1))
            for col in stop_ids:
                logits[:, col:col + 1] = paddle.where(ban, paddle.full([1, 1], NEG_INF, logits.dtype),
                                                      logits[:, col:col + 1])
        first = int(stop_ids[0])
        for r in np.flatnonzero(~before):
            row = paddle.full([logits.shape[-1]], NEG_INF, logits.dtype)
            row[first] = logits[int(r), first]
            logits[int(r)] = row
        return logits


def keyed_schedule(lengths):
    """A forced-length schedule for the rollout engine: the i-th smallest sampling key of a generate call gets
    the i-th length, so the lengths do not depend on batch order (keys are fixed by seed, step, prompt, sample)."""
    import numpy as np

    def schedule(keys) -> np.ndarray:
        order = sorted(range(len(keys)), key=lambda i: tuple(int(x) for x in keys[i]))
        out = np.empty(len(keys), dtype=np.int64)
        for rank, i in enumerate(order):
            out[i] = lengths[rank % len(lengths)]
        return out
    return schedule


def build_workload(folder: str, model: str, prompts: int, prompt_len: int, seed: int = 0) -> dict:
    """Random model + WordLevel tokenizer (one token per word) + a jsonl of synthetic prompts in `folder`."""
    import numpy as np
    import paddle
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    # deferred: models/ loads Paddle, only when a workload runs
    from .models import CausalLM, ModelConfig
    from .models.pretrained import save_model, write_generation_config

    shape = MODELS[model]
    vocab_size = shape["vocab_size"]
    words = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    model_dir = os.path.join(folder, "model")
    os.makedirs(model_dir, exist_ok=True)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}, f)
    paddle.seed(seed)
    config = ModelConfig(model_type="qwen2", max_position_embeddings=4096, eos_token_id=1, pad_token_id=0, **shape)
    net = CausalLM(config)
    net.init_weights()
    save_model(net, model_dir)
    write_generation_config(model_dir, [1], 0)
    del net
    rng = np.random.default_rng(seed)
    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(max(prompts, 1) * 4):
            length = int(rng.integers(max(1, prompt_len - 4), prompt_len + 5))
            text = " ".join(f"w{int(t)}" for t in rng.integers(0, vocab_size - len(SPECIALS), size=length))
            f.write(json.dumps({"src": text, "tgt": "none"}) + "\n")
    return {"model_dir": model_dir, "data": data}


# Matmul peaks: measured on square products and on the workload's own linear shapes, before the run and after it
# (one fp32 square taken before the trainer once read 83 GFLOP/s where 162-203 were reached minutes later on the
# shared machine): the best of each kind counts.
PEAK_SQUARES = (1024,)
PEAK_FLOPS = 5e8        # rows of each shape chosen for about this many FLOPs per product
PEAK_KINDS = {
    "fp32": "paddle.matmul, float32",
    "bf16_linear": "the suite's bf16 training product (ops.bf16_linear: bfloat16-rounded operands, float32 sums)",
    "bf16_packed": "the suite's packed bfloat16 rollout kernel (ops.packed_linear_lowp, bfloat16 activations)",
    "int8_packed": "the suite's packed weight_only_int8 rollout kernel (ops.packed_linear_lowp, float32 activations)",
    "torch_bf16": "PyTorch's bfloat16 matmul (an outside reference, not used by the suite)",
}


def linear_shapes(shape: dict) -> dict:
    """The model's linear layers as (K, N): y [rows, N] = x [rows, K] @ W [K, N]."""
    h, f = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads
    return {"qkv_proj": (h, (heads + 2 * kv) * head_dim), "o_proj": (heads * head_dim, h),
            "gate_up_proj": (h, 2 * f), "down_proj": (f, h), "lm_head": (h, shape["vocab_size"])}


def _peak_shapes(shape: Optional[dict]) -> list:
    """(name, M, K, N): the squares, then the workload's linear shapes with rows for about PEAK_FLOPS."""
    out = [(f"square {n}", n, n, n) for n in PEAK_SQUARES]
    for name, (k, n) in (linear_shapes(shape) if shape else {}).items():
        out.append((name, int(min(4096, max(64, round(PEAK_FLOPS / (2 * k * n))))), k, n))
    return out


def _best_seconds(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _peak_products(kind: str, m: int, k: int, n: int):
    """A callable computing one [m, k] x [k, n] product of `kind` to the end (its result read back), or None
    where the kind cannot run here."""
    import paddle

    # deferred: ops/ loads Paddle, only when a measurement runs
    from . import ops
    x, w = paddle.randn([m, k]), paddle.randn([k, n]) * 0.05
    if kind == "fp32":
        return lambda: paddle.matmul(x, w).numpy()
    if kind == "bf16_linear":
        return lambda: ops.bf16_linear(x, w).numpy()   # the kernel where bf16_kernel names one, else the emulation
    if kind in ("bf16_packed", "int8_packed"):
        if not ops.packing_helps(w):
            return None   # the custom ops are off: no packed kernel
        packed = ops.pack_weight_lowp(w, format="bfloat16", bf16_act=True) if kind == "bf16_packed" else \
            ops.pack_weight_lowp(w, format="weight_only_int8", bf16_act=False)
        return lambda: ops.packed_linear_lowp(x, packed).numpy()
    try:
        import torch  # an outside reference only: torch is no dependency of the suite
    except ImportError:
        return None
    tx, tw = torch.randn(m, k, dtype=torch.bfloat16), (torch.randn(k, n) * 0.05).to(torch.bfloat16)
    return lambda: torch.matmul(tx, tw).float().numpy()


def matmul_peaks(shape: Optional[dict] = None, repeat: int = 3, kinds=tuple(PEAK_KINDS)) -> list:
    """GFLOP/s of each kind (PEAK_KINDS) on each of `_peak_shapes(shape)`, best of `repeat`: rows of
    {kind, shape, m, k, n, gflops} (gflops None where the kind cannot run here)."""
    rows = []
    for name, m, k, n in _peak_shapes(shape):
        for kind in kinds:
            # the packed kernels serve the rollout's few rows per decode step: timed at 64 rows at most
            rows_m = min(m, 64) if kind in ("bf16_packed", "int8_packed") else m
            fn = _peak_products(kind, rows_m, k, n)
            gflops = None if fn is None else 2.0 * rows_m * k * n / _best_seconds(fn, repeat) / 1e9
            rows.append({"kind": kind, "shape": name, "m": rows_m, "k": k, "n": n, "gflops": gflops})
    return rows


def chosen_peak_kinds(value: Optional[str]) -> tuple:
    """--peaks: `all` (None) or a comma-separated list of PEAK_KINDS -> the kinds to time (fp32 always: the effective
    rates' yardstick)."""
    if value in (None, "", "all"):
        return tuple(PEAK_KINDS)
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in PEAK_KINDS]
    if unknown:
        raise SystemExit(f"bench: --peaks: {', '.join(unknown)}: not among {', '.join(PEAK_KINDS)}")
    return tuple(k for k in PEAK_KINDS if k in kinds or k == "fp32")


def matmul_peak(size: int = 1024, repeat: int = 5) -> float:
    """GFLOP/s of one square fp32 matmul in this process (best of `repeat`)."""
    fn = _peak_products("fp32", size, size, size)
    return 2 * size ** 3 / _best_seconds(fn, repeat) / 1e9


PEAK_DRIFT_WARN = 0.15   # the report warns when a kind's peak moved more than this between before and after


def peak_summary(before: list, after: list) -> dict:
    """The JSON fields of two `matmul_peaks` measurements (before and after the run): per kind the best over
    shapes and both times, and each shape's two readings."""
    out = {"matmul_peaks": [dict(b, gflops_before=b.pop("gflops"), gflops_after=a["gflops"])
                            for b, a in zip([dict(r) for r in before], after)]}
    for kind in PEAK_KINDS:
        def best(rows):
            values = [r["gflops"] for r in rows if r["kind"] == kind and r["gflops"] is not None]
            return max(values) if values else None
        b, a = best(before), best(after)
        out[f"{kind}_peak_before_gflops"], out[f"{kind}_peak_after_gflops"] = b, a
        out[f"{kind}_peak_gflops"] = max(v for v in (b, a) if v is not None) if b is not None or a is not None \
            else None
    # how far the machine's own speed moved between the two measurements: the largest relative change of a kind's
    # best (a shared host's cores can run a product at half the speed minutes later; step times of runs far apart
    # then differ by as much, whatever the code)
    moves = [abs(out[f"{k}_peak_after_gflops"] - out[f"{k}_peak_before_gflops"]) / out[f"{k}_peak_gflops"]
             for k in PEAK_KINDS if out[f"{k}_peak_before_gflops"] and out[f"{k}_peak_after_gflops"]]
    out["peak_drift"] = max(moves) if moves else None
    return out


def linear_gflops(shape: dict, tokens: int, repeat: int = 2) -> dict:
    """GFLOP/s of the decoder's linear layers' three products (y = x W, dx = dy W^T, dW = x^T dy) at the model's
    shapes over `tokens` rows (best of `repeat`, summed over the layers' shapes): Paddle's float32 matmul against
    the bf16 training products (ops.bf16_matmul: the kernel ops.bf16_kernel names, or its emulation)."""
    # deferred: Paddle and ops/ load only when a measurement runs
    import paddle
    from . import ops
    h, f = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    qkv = h + 2 * shape["num_key_value_heads"] * d
    shapes = [(h, qkv), (h, h), (h, 2 * f), (f, h)]    # qkv_proj, o_proj, gate_up_proj, down_proj: [K, N]
    seconds = {"float32": 0.0, "bf16": 0.0}
    flops = 0.0
    kernel = None
    for k, n in shapes:
        x, w, dy = paddle.randn([tokens, k]), paddle.randn([k, n]), paddle.randn([tokens, n])
        kernel = ops.bf16_kernel(x, w)
        products = {"float32": (lambda: paddle.matmul(x, w), lambda: paddle.matmul(dy, w, transpose_y=True),
                                lambda: paddle.matmul(x, dy, transpose_x=True)),
                    "bf16": (lambda: ops.bf16_matmul(x, w), lambda: ops.bf16_matmul(dy, w, trans_b=True),
                             lambda: ops.bf16_matmul(x, dy, trans_a=True))}
        for name, fns in products.items():
            for fn in fns:
                fn().numpy()
                best = float("inf")
                for _ in range(repeat):
                    start = time.perf_counter()
                    fn().numpy()
                    best = min(best, time.perf_counter() - start)
                seconds[name] += best
        flops += 3 * 2.0 * tokens * k * n
    return {"tokens": tokens, "bf16_kernel": kernel, "float32_gflops": flops / seconds["float32"] / 1e9,
            "bf16_gflops": flops / seconds["bf16"] / 1e9, "speedup": seconds["float32"] / seconds["bf16"]}


def step_flops(shape: dict, prompt_tokens: float, response_tokens: float, rows: int, reference: bool,
               old_pass: bool, groups: int = 1, shared_prompts: bool = False, shared_update: bool = None,
               critic: bool = False, value_pass: bool = True, recompute: Optional[str] = None,
               recomputed_layers: Optional[int] = None, down_rerun: bool = False) -> dict:
    """Matmul FLOPs per stage (weights and attention; norms and element-wise work left out). `rows` sequences
    in `groups` prompt groups; the rollout prefills each distinct prompt once, and so do the log-prob passes
    with `shared_prompts` and the update with `shared_update` (default: as `shared_prompts`). `critic`: the
    critic's update and, with `value_pass`, its value pass (the same decoder, a one-column head instead of the
    vocabulary's). The update counts its forward and backward (three forwards); `update_recompute` is what the
    actor's backward runs again under `recompute` (a recompute_granularity) in `recomputed_layers` of its layers
    (default: all): full the whole layer, full_attn the attention block, core_attn_mlp the MLP's gate and up
    products (the down projection's gradients are taken without its forward), or all three with `down_rerun` (LoRA,
    tensor parallelism, sandwich norms: where Paddle's recompute reruns the whole block); the attention core of
    core_attn / core_attn_mlp is left out: the packed and blocked kernels do not run it twice."""
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    head_dim = h // heads
    projections = h * (heads + 2 * kv) * head_dim + heads * head_dim * h   # one layer's q/k/v and o, per token / 2
    per_token = 2 * layers * (projections + 3 * h * f)
    head = 2 * h * vocab
    seq = (prompt_tokens + response_tokens) / max(rows, 1)
    attention = 2 * 2 * layers * heads * head_dim * seq / 2  # per token, causal average context
    distinct_prompt_tokens = prompt_tokens * max(groups, 1) / max(rows, 1)
    shared_update = shared_prompts if shared_update is None else shared_update

    def forward(shared, head_flops=head):
        prompt = distinct_prompt_tokens if shared else prompt_tokens
        return (prompt + response_tokens) * (per_token + attention) + response_tokens * head_flops

    rollout = distinct_prompt_tokens * per_token + response_tokens * (per_token + attention + head)
    out = {"rollout": rollout, "ref_logprob": forward(shared_prompts) if reference else 0.0,
           "old_logprob": forward(shared_prompts) if old_pass else 0.0, "update": 3 * forward(shared_update)}
    rerun = {"full": per_token / layers + attention / layers, "full_attn": 2 * projections + attention / layers,
             "core_attn_mlp": 2 * (3 if down_rerun else 2) * h * f}.get(recompute, 0.0)   # per token and layer
    update_tokens = (distinct_prompt_tokens if shared_update else prompt_tokens) + response_tokens
    update_recompute = update_tokens * rerun * (layers if recomputed_layers is None else recomputed_layers)
    if critic:
        out.update(values=forward(shared_prompts, 2 * h) if value_pass else 0.0,
                   critic_update=3 * forward(shared_update, 2 * h))
    out["step"] = sum(out.values())
    out["update_recompute"] = update_recompute   # not in "step": the stage rates above count the work, not its reruns
    return out


def _read_metrics(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_workload(folder: str, model_dir: str, prompts: int) -> dict:
    """W3 / W4: a real model folder and a jsonl of `prompts` chat prompts (CHAT_PROMPTS, rendered with the
    model's chat template by the data loader)."""
    data = os.path.join(folder, "chat_prompts.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(max(prompts, 1)):
            text = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
            f.write(json.dumps({"messages": [{"role": "user", "content": text}], "tgt": "none"}) + "\n")
    return {"model_dir": resolve_model(model_dir), "data": data}


def code_workload(folder: str, model_dir: str, prompts: int) -> dict:
    """W5: the first `prompts` HumanEval records of `paddle-rl fetch humaneval` (fetched once), the instruction
    the benchmark's records carry, templated as a user turn by the data loader; their tests are the `code` rule's
    ground truth."""
    source = fetch_benchmark("humaneval")
    data = os.path.join(folder, "humaneval_prompts.jsonl")
    with open(source, encoding="utf-8") as f, open(data, "w", encoding="utf-8") as out:
        lines = [line for line in f if line.strip()][:max(prompts, 1)]
        out.writelines(lines)
    return {"model_dir": resolve_model(model_dir), "data": data}


def model_shape(model_dir: str) -> dict:
    # deferred: models/ loads Paddle, only when a workload runs
    from .models import ModelConfig
    config = ModelConfig.from_pretrained(model_dir)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    return {k: getattr(config, k) for k in keys}


def resolve_args(args) -> dict:
    """The workload's settings with the command line's options over them."""
    spec = dict(WORKLOADS[args.workload])
    if args.model is not None:
        spec["model"] = args.model
    if args.model_path is None and spec.get("model_path"):
        args.model_path = spec["model_path"]
    if args.prompts is None:
        args.prompts = spec.get("prompts", DEFAULT_PROMPTS)
    if args.rollout_n is None:
        args.rollout_n = spec.get("rollout_n", DEFAULT_ROLLOUT_N)
    if spec["model"] == "path" and not args.model_path:
        raise SystemExit(f"paddle-rl bench: workload {args.workload} needs --model-path (a converted model folder, "
                         "e.g. `paddle-rl fetch smollm2-135m-instruct`)")
    if args.response_len is not None:
        spec["response_len"] = args.response_len
    return spec


def prepare_workload(args, spec: dict, tmp: str) -> tuple:
    """The workload's model folder and prompts in `tmp` -> (work {model_dir, data}, the model's shape)."""
    if spec["model"] == "path":
        make = code_workload if spec.get("data") == "humaneval" else chat_workload
        work = make(tmp, args.model_path, args.prompts)
        return work, model_shape(work["model_dir"])
    return build_workload(tmp, spec["model"], args.prompts, args.prompt_len, args.seed), MODELS[spec["model"]]


def workload_overrides(args, spec: dict, work: dict, tmp: str, steps: int) -> dict:
    """The run's configuration keys: the workload's, then the command line's `--set KEY=VALUE` (YAML values)."""
    rows = args.prompts * args.rollout_n
    overrides = {
        "actor_model_name_or_path": work["model_dir"], "train_datasets": work["data"],
        "prompt_key": "src", "response_key": "tgt", "output_dir": os.path.join(tmp, "out"),
        "max_prompt_len": max(args.prompt_len + 8, 256), "max_dec_len": spec["response_len"],
        "min_dec_len": spec["response_len"] if spec["exact"] else 0, "temperature": 1.0, "top_p": 1.0,
        "rollout_n": args.rollout_n, "global_batch_size": args.prompts, "global_mini_batch_size": -1,
        "update_iters": 1, "per_device_train_batch_size": rows, "per_device_logprob_batch_size": rows,
        "per_device_value_batch_size": rows,
        "kl_loss_coeff": args.kl_loss_coeff, "learning_rate": 1e-5, "max_steps": steps, "save_strategy": "no",
        "do_eval": False, "report_to": "none", "disable_tqdm": True, "reward_funcs": ["distinct_chars"],
        "seed": args.seed, **spec["settings"],
    }
    for item in args.set or []:
        key, value = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def run(args) -> dict:
    # strided views make Paddle's CPU transposes/reshapes copy element by element (~10x slower than a real
    # transpose): the decoder's attention is much faster with them off (see docs/performance.md)
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")
    configure_threads()

    import numpy as np

    # deferred: the trainer loads Paddle, only when a workload runs (after configure_threads)
    from .models.decoder import mlp_recompute_reruns_down
    from .trainer import RLTrainer
    from .trainer.logprobs import reuses_rollout_logprobs

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = resolve_args(args)
    steps = args.warmup + args.steps
    rows = args.prompts * args.rollout_n
    lengths = long_tail_lengths(rows, cap=spec["response_len"]) if spec.get("lengths") == "long_tail" else None
    with tempfile.TemporaryDirectory(prefix="paddle_rl_bench_") as tmp:
        start = time.perf_counter()
        work, shape = prepare_workload(args, spec, tmp)
        build_s = time.perf_counter() - start
        overrides = workload_overrides(args, spec, work, tmp, steps)
        server_urls = server_list(overrides.pop("rollout_server_urls", None))
        config = load_config(None, overrides)
        if server_urls and lengths is not None:
            raise SystemExit("bench: W2's EOS schedule is applied to the trainer's own engine; it cannot reach a "
                             "rollout server (use w1, w3 or w4 with rollout_server_urls)")
        load_before = os.getloadavg()[0]
        peak_kinds = chosen_peak_kinds(args.peaks)
        peaks_before = matmul_peaks(shape, kinds=peak_kinds)
        trainer = RLTrainer(config)
        if lengths is not None:
            if config.async_rollout:
                raise SystemExit("bench: W2's EOS schedule is applied to the trainer's own engine; it cannot reach "
                                 "the asynchronous rollout's worker (use w1, w3 or w4 with async_rollout)")
            trainer.engine.stages.append(ForcedLengths(keyed_schedule(lengths)))
        if server_urls:
            records, served, cpu_s = side_by_side(args, tmp, overrides, server_urls, trainer)
        else:
            cpu_start = time.process_time()
            trainer.train()
            cpu_s = time.process_time() - cpu_start
            records, served = _read_metrics(os.path.join(config.output_dir, "metrics.jsonl")), None
        peaks = peak_summary(peaks_before, matmul_peaks(shape, kinds=peak_kinds))
        peak = peaks["fp32_peak_gflops"]
        optimizer_bytes = trainer.layout.optimizer_state_bytes(trainer.optimizer)["total"]
        trainable = sum(int(np.prod(p.shape)) for p in trainer.actor.parameters() if not p.stop_gradient)
        critic = trainer.critic is not None
        critic_optimizer_bytes = trainer.layout.optimizer_state_bytes(trainer.critic.optimizer)["total"] \
            if critic else 0
        switches = kernel_switches(config, trainer.actor)
        # the old-log-prob stage runs a forward unless it takes the rollout's own log-probs (reuse_rollout_logprobs)
        old_pass = not reuses_rollout_logprobs(config, trainer.mini_batches_per_step)
        down_rerun = mlp_recompute_reruns_down(trainer.actor) or config.sequence_parallel
        del trainer
    timed = records[args.warmup:] or records[-1:]

    def mean(key):
        values = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return float(np.mean(values)) if values else 0.0

    step_s = mean("time/step")
    # the generation's own seconds: with async_rollout the worker's (time/rollout is then the trainer's wait)
    generate_s = mean("async/worker_generate_s") if config.async_rollout else mean("time/rollout")
    response_tokens = mean("response_length/mean") * rows
    prompt_tokens = mean("prompt_length/mean") * rows
    flops = step_flops(shape, prompt_tokens, response_tokens, rows, config.kl_loss_coeff > 0 or config.kl_coeff > 0,
                       old_pass and "time/old_logprob" in timed[-1], groups=args.prompts,
                       shared_prompts=config.share_prompt_prefix and args.rollout_n > 1,
                       shared_update=config.share_prompt_prefix and args.rollout_n > 1
                       and config.recompute_what not in ("full", "full_attn"), critic=critic,
                       value_pass=mean("time/values") > 0, recompute=config.recompute_what,
                       recomputed_layers=shape["num_hidden_layers"] - len(config.no_recompute_layers),
                       down_rerun=down_rerun)
    result = {
        "workload": args.workload, "model": spec["model"] if spec["model"] != "path" else args.model_path,
        "prompts": args.prompts, "rollout_n": args.rollout_n, "prompt_len": mean("prompt_length/mean"),
        "response_len": spec["response_len"], "exact_length": spec["exact"], "steps_timed": len(timed),
        "step_s": step_s, **{f"{s}_s": mean(f"time/{s}") for s in STAGES},
        # every step's seconds and stages', the untimed first ones too (a run's first steps grow its memory)
        "steps": [{"step_s": r.get("time/step", 0.0), **{f"{s}_s": r.get(f"time/{s}", 0.0) for s in STAGES},
                   "update_page_faults": r.get("memory/update_page_faults", 0.0), "timed": i >= args.warmup}
                  for i, r in enumerate(records)],
        "generated_tokens": mean("perf/generated_tokens"), "trained_tokens": mean("perf/trained_tokens"),
        "decode_row_steps": mean("perf/decode_row_steps"),
        "response_length_mean": mean("response_length/mean"), "clipped_share": mean("response_length/clipped_share"),
        "generated_tokens_per_s": mean("perf/generated_tokens_per_s"),
        "trained_tokens_per_s": mean("perf/trained_tokens_per_s"),
        "s_per_generated_token": generate_s / max(mean("perf/generated_tokens"), 1e-9),
        "s_per_trained_token": mean("time/update") / max(mean("perf/trained_tokens"), 1e-9),
        "effective_gflops": flops["step"] / max(step_s, 1e-9) / 1e9,
        "rollout_gflops": flops["rollout"] / max(generate_s, 1e-9) / 1e9, "generate_s": generate_s,
        "update_gflops": flops["update"] / max(mean("time/update"), 1e-9) / 1e9,
        "peak_gflops": peak, "matmul_peak_gflops": peak, **peaks, "peak_kinds": list(peak_kinds),
        "peak_rss_mb": memory.process_peak_mb(),  # the trainer's process
        # the peak RSS within each stage (monitor/memory.py), the timed steps' largest
        **{f"stage_peak_{kind}_mb": {k[len("memory/"):-len(f"_peak_{kind}_mb")]: max(r.get(k, 0.0) for r in timed)
                                     for k in timed[-1] if k.startswith("memory/") and k.endswith(f"_peak_{kind}_mb")}
           for kind in ("rss", "tensor")},
        "per_stage_rss": memory.per_stage(),
        # the page faults taken in each stage (first touches of memory the process got), mean of the timed steps
        "stage_page_faults": {k[len("memory/"):-len("_page_faults")]: mean(k) for k in timed[-1]
                              if k.startswith("memory/") and k.endswith("_page_faults")},
        "worker_peak_rss_mb": max([r.get("async/worker_peak_rss_mb", 0.0) for r in records] + [0.0]),
        "weights_push_s": mean("time/weights_push"), "worker_weights_load_s": mean("async/worker_weights_load_s"),
        "optimizer_state_mb": optimizer_bytes / 2**20, "trainable_params": trainable,
        "threads": os.environ.get("OMP_NUM_THREADS"), "setup_s": build_s,
        "cpu_s_per_step": cpu_s / max(len(records), 1), "load_avg": [load_before, os.getloadavg()[0]],
        "stride_kernel": os.environ.get("FLAGS_use_stride_kernel"), "malloc": malloc_mode(),
        "custom_ops": _custom_ops_status(), "overrides": args.set or [],
        "rollout_dtype": config.rollout_dtype, "rollout_quant_type": config.rollout_quant_type,
        **machine(), "bf16": bool(config.bf16), "lora": bool(config.lora),
        "reward_mean": mean("reward/mean"), "accuracy": mean("reward/accuracy"), **switches,
    }
    stage_seconds = {"rollout": generate_s, **{s: mean(f"time/{s}") for s in STAGES[2:] + CRITIC_STAGES}}
    result.update(stage_rates(flops, stage_seconds, stage_peak_kinds(
        config.rollout_dtype, config.rollout_quant_type, bool(config.bf16), bool(config.fp16)), peaks))
    if config.bf16:  # the bf16 products against float32's at this model's linear shapes, after the timed steps
        micro = int(config.max_tokens_per_micro_batch or 0) if config.use_remove_padding else 0
        tokens = int(round(mean("perf/trained_tokens")))
        result["linear"] = linear_gflops(shape, min(tokens, micro) if micro > 0 else tokens)
    if served is not None:
        result["rollout_server"] = served
        served["step_over_inline"] = served["step_s"] / max(step_s, 1e-9)
    if critic:
        # the critic's passes, and their cost against the actor's update: its forward + backward over the same
        # tokens and micro-batches
        critic_s = mean("time/values") + mean("time/critic_update")
        result.update({f"{s}_s": mean(f"time/{s}") for s in CRITIC_STAGES})
        result.update(critic_s=critic_s, critic_over_update=critic_s / max(mean("time/update"), 1e-9),
                      values_gflops=flops["values"] / mean("time/values") / 1e9 if mean("time/values") else 0.0,
                      critic_update_gflops=flops["critic_update"] / max(mean("time/critic_update"), 1e-9) / 1e9,
                      critic_optimizer_state_mb=critic_optimizer_bytes / 2**20)
    return result


def kernel_switches(config, model) -> dict:
    """The fused-kernel switches as the run has them: `kernel_switches` each key's value (None: unset), and
    `kernel_paths` the path it selects in the model's training passes here ("fused" or "composed"; unset: what
    ops/switches.py's `unset_choices` says this build and layout take)."""
    # deferred: ops/ loads Paddle, only when a workload runs
    from . import ops
    unset = ops.switches.unset_choices(bool(config.use_remove_padding))
    if getattr(model, "unchunked_head", None):   # tensor parallel or soft-capped logits: the whole logits
        unset["head"] = False
    values = config.kernel_switches
    return {"kernel_switches": {ops.switches.KEYS[name]: value for name, value in values.items()},
            "kernel_paths": {ops.switches.KEYS[name]: "fused" if (unset[name] if value is None else value)
                             else "composed" for name, value in values.items()}}


# the stages whose matmul rate the report sets against a peak: the rollout, the log-prob passes, the update, the critic
RATED_STAGES = ("rollout", "ref_logprob", "old_logprob", "update") + CRITIC_STAGES


def stage_peak_kinds(rollout_dtype: str, rollout_quant_type: str, bf16: bool, fp16: bool) -> dict:
    """The peak kind (PEAK_KINDS) of the precision each stage's products run in, None where none is measured: the
    rollout's packed kernels (weight_only_int8: the int8 kernel; bfloat16: the bf16 kernel; weight_only_int4 has
    no measured peak) or float32; the training passes' bf16 product under bf16, float32 otherwise (fp16's emulated
    products have no measured peak)."""
    if rollout_quant_type == "weight_only_int8":
        rollout = "int8_packed"
    elif rollout_quant_type:
        rollout = None
    else:
        rollout = "bf16_packed" if rollout_dtype == "bfloat16" else "fp32"
    training = "bf16_linear" if bf16 else None if fp16 else "fp32"
    return {stage: rollout if stage == "rollout" else training for stage in RATED_STAGES}


def stage_rates(flops: dict, seconds: dict, kinds: dict, peaks: dict) -> dict:
    """Each stage's effective GFLOP/s (its matmul FLOPs over its seconds; stages that did not run left out) and its
    share of the in-run peak of its precision: `stage_gflops`, `stage_peak_kind`, `stage_peak_gflops`,
    `stage_peak_fraction` (None where that peak was not measured)."""
    out = {"stage_gflops": {}, "stage_peak_kind": {}, "stage_peak_gflops": {}, "stage_peak_fraction": {}}
    for stage in RATED_STAGES:
        if not flops.get(stage) or not seconds.get(stage):
            continue
        rate = flops[stage] / seconds[stage] / 1e9
        kind = kinds[stage]
        peak = peaks.get(f"{kind}_peak_gflops") if kind else None
        out["stage_gflops"][stage] = rate
        out["stage_peak_kind"][stage] = kind
        out["stage_peak_gflops"][stage] = peak
        out["stage_peak_fraction"][stage] = rate / peak if peak else None
    if flops.get("update_recompute") and "update" in out["stage_gflops"]:
        # the update's products with the forward blocks its backward runs again (recompute) counted too
        rate = (flops["update"] + flops["update_recompute"]) / seconds["update"] / 1e9
        peak = out["stage_peak_gflops"]["update"]
        out["stage_gflops"]["update_rerun"] = rate
        out["stage_peak_kind"]["update_rerun"] = out["stage_peak_kind"]["update"]
        out["stage_peak_gflops"]["update_rerun"] = peak
        out["stage_peak_fraction"]["update_rerun"] = rate / peak if peak else None
    return out


def switch_names(value: str) -> list:
    """--switches' list (`all`, or keys such as use_fused_rope, or the short names attention, rms_norm, rope, head,
    linear) -> ops/switches.py names, in the order given."""
    # deferred: ops/ loads Paddle, only when a workload runs
    from . import ops
    keys = ops.switches.KEYS
    if value in (None, "", "all"):
        return list(keys)
    by_key = {key: name for name, key in keys.items()}
    out = []
    for item in (x.strip() for x in value.split(",") if x.strip()):
        name = item if item in keys else by_key.get(item)
        if name is None:
            raise SystemExit(f"bench: --switches: {item!r} is none of {', '.join(keys.values())}")
        out.append(name)
    return out


def switch_runs(args) -> dict:
    """The workload with the config's fused-kernel switches (the baseline) and with each chosen switch flipped, one
    at a time, in one process and one sitting: one trainer runs `--warmup` + `--steps` rounds, each round a step of
    every run in turn (reversed every other round, so a load that drifts through the sitting falls on both sides),
    each step under its run's switches (ops.kernels_selected: the passes read them per call; each run's config is
    read and checked as a run of its own would be, so a flip that cannot act is refused by name). Flipping a switch
    sets the key to the opposite of the path it takes in the baseline (unset: ops/switches.py's `unset_choices`).
    Per run: seconds per step and stage (mean of the timed rounds), their ratio to the baseline's, and the peak
    RSS and peak of Paddle's tensors within the run's steps (monitor/memory.py's stage peaks)."""
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")
    configure_threads()

    import numpy as np

    # deferred: the trainer and ops/ load Paddle, only when a workload runs (after configure_threads)
    from . import ops
    from .trainer import RLTrainer

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = resolve_args(args)
    names = switch_names(args.switches)
    rounds = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="paddle_rl_bench_") as tmp:
        work, shape = prepare_workload(args, spec, tmp)
        overrides = workload_overrides(args, spec, work, tmp, rounds * (1 + len(names)))
        if server_list(overrides.get("rollout_server_urls")) or spec.get("lengths") == "long_tail":
            raise SystemExit("bench: --switches runs the trainer's own engine without an EOS schedule (w1, w3, w4 or "
                             "w5, without rollout_server_urls)")
        with said_once() as said:   # each variant's read repeats the baseline's warnings: those are said once
            config = load_config(None, overrides)
            said.seal()
            load_before = os.getloadavg()[0]
            trainer = RLTrainer(config)
            baseline = kernel_switches(config, trainer.actor)
            variants = flipped_configs(overrides, names, baseline, trainer.actor)
        runs = [{"name": "baseline", "key": None, "value": None, "config": config}] + variants["runs"]
        refused = variants["refused"]
        steps = {r["name"]: [] for r in runs}
        try:
            for index in range(rounds):
                for r in runs if index % 2 == 0 else runs[::-1]:
                    with ops.kernels_selected(**r["config"].kernel_switches):
                        metrics = trainer.train_step()
                    trainer.stepped()
                    if index >= args.warmup:
                        steps[r["name"]].append(metrics)
        finally:
            trainer.close()
        del trainer
    base = None
    out = []
    for r in runs:
        timed = steps[r["name"]]

        def mean(key):
            values = [m[key] for m in timed if isinstance(m.get(key), (int, float))]
            return float(np.mean(values)) if values else 0.0

        def peak(kind):
            return max((v for m in timed for k, v in m.items() if k.startswith("memory/")
                        and k.endswith(f"_peak_{kind}_mb") and not k.startswith("memory/before_step")), default=0.0)
        row = {"name": r["name"], "key": r["key"], "value": r["value"], "steps_s": [m["time/step"] for m in timed],
               "step_s": mean("time/step"),
               **{f"{s}_s": mean(f"time/{s}") for s in STAGES + CRITIC_STAGES if f"time/{s}" in timed[-1]},
               "peak_rss_mb": peak("rss"), "peak_tensor_mb": peak("tensor"),
               "kernel_switches": {ops.switches.KEYS[n]: v for n, v in r["config"].kernel_switches.items()}}
        base = base or row
        row["step_ratio"] = row["step_s"] / max(base["step_s"], 1e-9)
        row["stage_ratios"] = {s: row[f"{s}_s"] / base[f"{s}_s"] for s in STAGES + CRITIC_STAGES
                               if f"{s}_s" in row and base.get(f"{s}_s")}
        out.append(row)
    return {"mode": "switches", "workload": args.workload,
            "model": spec["model"] if spec["model"] != "path" else args.model_path, "prompts": args.prompts,
            "rollout_n": args.rollout_n, "response_len": spec["response_len"], "exact_length": spec["exact"],
            "rounds": rounds, "rounds_timed": args.steps, "overrides": args.set or [], **baseline, "runs": out,
            "refused": refused, **machine(), "threads": os.environ.get("OMP_NUM_THREADS"),
            "custom_ops": _custom_ops_status(), "load_avg": [load_before, os.getloadavg()[0]],
            "peak_rss_mb": memory.process_peak_mb(), "per_stage_rss": memory.per_stage()}


def flipped_configs(overrides: dict, names: list, baseline: dict, model) -> dict:
    """One config per chosen switch, the switch set to the opposite of the path the baseline takes, read and checked
    as a run's own: {"runs": [{name, key, value, config}], "refused": {key: why}} (a flip that cannot act here: the
    config's refusal, ops' SwitchError, or the head's reason on a model that reads whole logits)."""
    # deferred: ops/ loads Paddle, only when a workload runs
    from . import ops
    runs, refused = [], {}
    for name in names:
        key = ops.switches.KEYS[name]
        flipped = baseline["kernel_paths"][key] != "fused"
        keys = {k: v for k, v in overrides.items() if not (name == "linear" and k == "fused_linear")}
        try:
            variant = load_config(None, {**keys, key: flipped})
            with ops.kernels_selected(**variant.kernel_switches):
                pass   # a True switch whose kernels are not in use is refused here (SwitchError)
            if name == "head" and flipped and getattr(model, "unchunked_head", None):
                raise ops.SwitchError(model.unchunked_head)
        except (ConfigError, ops.SwitchError) as e:
            refused[key] = str(e)
            continue
        runs.append({"name": switch_text(key, flipped), "key": key, "value": flipped, "config": variant})
    return {"runs": runs, "refused": refused}


class said_once(logging.Filter):
    """A block in which the `paddle_rl` logger's messages are said once: until `seal()` every message passes and
    is noted; after it, a message noted before is dropped (a config read again with one key changed repeats its
    warnings), any other passes."""

    def __init__(self):
        super().__init__()
        self.seen, self.sealed = set(), False

    def seal(self) -> None:
        self.sealed = True

    def filter(self, record) -> bool:
        message = record.getMessage()
        if not self.sealed:
            self.seen.add(message)
            return True
        return message not in self.seen

    def __enter__(self):
        logging.getLogger("paddle_rl").addFilter(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("paddle_rl").removeFilter(self)


def switch_report(result: dict) -> str:
    """The table of `--switches`: one row per run (the baseline, then each flipped switch), seconds per step and
    stage, the step's ratio to the baseline's, the peak RSS and Paddle tensors' peak within its steps."""
    exact = "exactly" if result["exact_length"] else "at most"
    stages = [s for s in STAGES + CRITIC_STAGES
              if any(r.get(f"{s}_s") for r in result["runs"]) and s not in ("reward", "advantage")]
    lines = [f"fused-kernel switches on {result['workload']} ({result['model']}): {result['prompts']} prompts x "
             f"rollout_n {result['rollout_n']}, response {exact} {result['response_len']} tokens; {result['rounds']} "
             f"rounds alternated in one process, the last {result['rounds_timed']} timed",
             f"machine {result['cpu_model']}, {result['cores']} cores, flags {' '.join(result['cpu_flags']) or '-'}; "
             f"OMP_NUM_THREADS={result['threads']}, custom ops {result['custom_ops']}, load average "
             f"{result['load_avg'][0]:.1f} -> {result['load_avg'][1]:.1f}",
             *config_lines(result)]
    head = f"  {'run':<36} {'step s':>8} " + " ".join(f"{s:>12}" for s in stages) + \
        f" {'x baseline':>10} {'peak RSS MB':>11} {'tensors MB':>10}"
    lines.append(head)
    for r in result["runs"]:
        lines.append(f"  {r['name']:<36} {r['step_s']:8.3f} " + " ".join(f"{r.get(f'{s}_s', 0.0):12.3f}" for s in stages)
                     + f" {r['step_ratio']:10.3f} {r['peak_rss_mb']:11.0f} {r['peak_tensor_mb']:10.0f}")
    for key, why in result["refused"].items():
        lines.append(f"  {key}: not flipped: {why}")
    if not result.get("per_stage_rss", True):
        lines.append("  (peak RSS cumulative: /proc/self/clear_refs not writable)")
    return "\n".join(lines)


LOCAL_SERVER = "local"   # a rollout_server_urls entry the bench starts itself: a server on 127.0.0.1


def server_list(value) -> list:
    """rollout_server_urls of `--set` (a YAML list or a comma-separated string), `local` entries kept by name."""
    if value in (None, "", []):
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(u).strip() for u in items if str(u).strip()]


def start_local_server(tmp: str, overrides: dict, index: int):
    """`paddle-rl rollout-server` on 127.0.0.1 with the run's own config (its actor and rollout keys) -> (process,
    URL, log path), once /health answers."""
    import socket
    import subprocess

    import httpx
    import yaml
    path = os.path.join(tmp, f"rollout_server_{index}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(overrides, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = os.path.join(tmp, f"rollout_server_{index}.log")
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "paddle_rl", "rollout-server", path, "--port", str(port),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PADDLE_RL_ROLLOUT_API_KEY": ""})
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8") as f:
                raise SystemExit(f"bench: the local rollout server exited ({proc.returncode}):\n{f.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"bench: the local rollout server did not answer /health in 600 s (log {log_path})")


def side_by_side(args, tmp: str, overrides: dict, urls: list, inline) -> tuple:
    """The workload twice in one process, step by step in turn: `inline` (the trainer generating itself) and a
    second trainer of the same config and seeds whose rollout runs on `urls` (`local` entries started here on
    127.0.0.1 and stopped at the end). Taking turns, both see the same drift of a shared machine's load, and both
    do the same work (the same prompts and keys). -> (the inline steps' metrics, the server run's summary, the
    inline steps' process CPU seconds)."""
    import signal

    import numpy as np

    # deferred: the trainer loads Paddle, only when a workload runs (after configure_threads)
    from .trainer import RLTrainer
    logging.getLogger("httpx").setLevel(logging.WARNING)   # a line per request otherwise
    started, inline_rows, server_rows, cpu_s = [], [], [], 0.0
    try:
        resolved = []
        for url in urls:
            if url == LOCAL_SERVER:
                proc, url, _ = start_local_server(tmp, overrides, len(started))
                started.append(proc)
            resolved.append(url)
        config = load_config(None, dict(overrides, rollout_server_urls=resolved,
                                        output_dir=os.path.join(tmp, "out_servers")))
        served = RLTrainer(config)
        load_before = os.getloadavg()[0]
        try:
            while inline.step < inline.total_steps:
                cpu_start = time.process_time()
                inline_rows.append(inline.train_step())
                inline.rollout.stepped()
                cpu_s += time.process_time() - cpu_start
                server_rows.append(served.train_step())
                served.rollout.stepped()
                logging.getLogger("paddle_rl").info(
                    "step %d: inline %.2f s, on servers %.2f s", inline.step, inline_rows[-1]["time/step"],
                    server_rows[-1]["time/step"])
        finally:
            served.rollout.close()
            inline.rollout.close()
        load_after = os.getloadavg()[0]
    finally:
        for proc in started:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except Exception:   # noqa: BLE001 - a server that does not stop is killed
                proc.kill()
    timed, base = server_rows[args.warmup:], inline_rows[args.warmup:]

    def mean(key):
        values = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return float(np.mean(values)) if values else 0.0
    ratios = [s["time/step"] / i["time/step"] for s, i in zip(timed, base)]
    summary = {"urls": urls, "local_servers": len(started), "steps_timed": len(timed), "step_s": mean("time/step"),
               "steps_s": [r["time/step"] for r in timed], "inline_steps_s": [r["time/step"] for r in base],
               "generate_steps_s": [r.get("time/rollout_server_generate", 0.0) for r in timed],
               "inline_rollout_steps_s": [r["time/rollout"] for r in base],
               "step_ratio_median": float(np.median(ratios)) if ratios else 0.0,
               "rollout_s": mean("time/rollout"), "server_generate_s": mean("time/rollout_server_generate"),
               "weights_push_s": mean("time/weights_push"), "weights_serialize_s": mean("time/weights_serialize"),
               "weights_push_bytes": mean("rollout_server/weights_push_bytes"),
               **{f"{s}_s": mean(f"time/{s}") for s in STAGES if s != "rollout"},
               "load_avg": [load_before, load_after]}
    return inline_rows, summary, cpu_s


def cpu_flags() -> list:
    """The CPU's vector-extension flags that decide the kernels' paths."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    flags = cpu_info()["flags"]
    return [w for w in wanted if w in flags]


def machine() -> dict:
    """The CPU model, its kernel-deciding flags and the cores this process may run on: beside every figure."""
    return {"cpu_model": cpu_info()["model"], "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0))}


def _precision(name: str):
    """`float32` | `bfloat16` | a quant type | `<dtype>+<quant type>` -> (rollout_dtype, rollout_quant_type)."""
    # deferred: ops/ loads Paddle, only when a rollout comparison runs
    from . import ops
    parts = name.split("+")
    quants = [q for q in ops.ROLLOUT_QUANT_TYPES if q]
    if len(parts) == 1 and name in ops.ROLLOUT_DTYPES + tuple(quants):
        return (name, "") if name in ops.ROLLOUT_DTYPES else ("float32", name)
    if len(parts) == 2 and parts[0] in ops.ROLLOUT_DTYPES and parts[1] in quants:
        return parts[0], parts[1]
    raise SystemExit(f"bench: --rollout-precisions: {name!r} is not float32, bfloat16, {', '.join(quants)} or "
                     "<dtype>+<quant type>")


def rollout_precisions(args, spec, precisions) -> dict:
    """The workload's rollout alone per precision (same prompts, keys and forced lengths), --steps interleaved
    rounds; the best round's seconds each."""
    os.environ.setdefault("FLAGS_use_stride_kernel", "0")
    configure_threads()
    import numpy as np
    import paddle

    # deferred: ops/, models/ and the rollout load Paddle, only when a rollout comparison runs
    from . import ops
    from .models import CausalLM, ModelConfig
    from .models.pretrained import load_model
    from .rollout import RolloutEngine, SamplingParams, sample_key

    settings = [_precision(p) for p in precisions]
    rows = args.prompts * args.rollout_n
    if spec["model"] == "path":
        model = load_model(args.model_path)
    else:
        paddle.seed(args.seed)
        model = CausalLM(ModelConfig(model_type="qwen2", max_position_embeddings=4096, eos_token_id=1,
                                     pad_token_id=0, **MODELS[spec["model"]]))
        model.init_weights()
    model.eval()
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(2, model.config.vocab_size, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    keys = [sample_key(args.seed, 0, i // args.rollout_n, i % args.rollout_n) for i in range(rows)]
    if spec["exact"]:
        lengths = [spec["response_len"]] * rows
    elif spec.get("lengths") == "long_tail":
        lengths = long_tail_lengths(rows, cap=spec["response_len"])
    else:   # W4-like: median 270, sigma 0.8, cut at 512 (mean ~294, ~22% at the cut)
        lengths = long_tail_lengths(rows, median=270.0, sigma=0.8, cap=spec["response_len"])
    params = SamplingParams(max_dec_len=spec["response_len"], temperature=1.0)
    # --steps rounds, the precisions in turn within each (a shared machine's load drifts between runs); the best
    # round of each precision counts
    runs = [{"rollout_dtype": dtype, "rollout_quant_type": quant, "generate_s": float("inf"), "rounds": []}
            for dtype, quant in settings]
    for _ in range(max(args.steps, 1)):
        for r in runs:
            engine = RolloutEngine(model, 0, [1], rollout_dtype=r["rollout_dtype"], quant_type=r["rollout_quant_type"],
                                   stages=[ForcedLengths(keyed_schedule(lengths))])
            start = time.perf_counter()
            out = engine.generate(prompts, args.rollout_n, params, keys)
            seconds = time.perf_counter() - start
            tokens = int(out.lengths.sum())
            r["rounds"].append(seconds)
            if seconds < r["generate_s"]:
                r.update(generate_s=seconds, generated_tokens=tokens, s_per_generated_token=seconds / max(tokens, 1))
    for r in runs:
        r["speedup"] = runs[0]["generate_s"] / r["generate_s"]
    return {"workload": args.workload, "model": spec["model"] if spec["model"] != "path" else args.model_path,
            "prompts": args.prompts, "rollout_n": args.rollout_n, "prompt_len": args.prompt_len,
            "response_len": spec["response_len"], "mean_length": float(np.mean(lengths)), "runs": runs,
            **machine(), "threads": os.environ.get("OMP_NUM_THREADS"),
            "load_avg": os.getloadavg()[0], "custom_ops": _custom_ops_status(),
            # the bfloat16 rollout's portable tile: forced, or neither the AVX-512 nor the AVX2 tile built
            "bf16_portable": bool(os.environ.get("PADDLE_RL_BF16_EMULATE")) or not (
                "avx512f" in cpu_flags() or {"avx2", "fma"} <= set(cpu_flags()))}


def _custom_ops_status() -> str:
    try:
        # deferred: ops/ loads Paddle, only for the report of a run
        from . import ops
    except ImportError:
        return "absent"
    status = ops.status()
    return "on" if status["loaded"] else f"off ({status['reason'] or status['mode']})"


def report(result: dict) -> str:
    exact = "exactly" if result["exact_length"] else "at most"
    lines = [f"workload {result['workload']} ({result['model']}): {result['prompts']} prompts x rollout_n "
             f"{result['rollout_n']}, prompt ~{result['prompt_len']:.0f}, response {exact} {result['response_len']} "
             f"tokens (mean {result['response_length_mean']:.1f})",
             f"machine {result['cpu_model']}, {result['cores']} cores, flags {' '.join(result['cpu_flags']) or '-'}; "
             f"{result['steps_timed']} timed step(s), OMP_NUM_THREADS={result['threads']}, custom ops "
             f"{result['custom_ops']}, malloc {result['malloc']}, load average {result['load_avg'][0]:.1f} -> "
             f"{result['load_avg'][1]:.1f}, rollout {result['rollout_dtype']}{' ' + result['rollout_quant_type'] if result['rollout_quant_type'] else ''}",
             *config_lines(result),
             f"  step          {result['step_s']:8.3f} s" + every_step(result)]
    for stage in STAGES + tuple(s for s in CRITIC_STAGES if f"{s}_s" in result):
        fused = stage == "values" and result[f"{stage}_s"] == 0  # one update pass: its forward gave the values
        lines.append(f"  {stage:<13} {result[f'{stage}_s']:8.3f} s" +
                     (" (given by the critic update's forward: one update pass per step)" if fused else ""))
    if "critic_s" in result:
        speeds = (f"values {result['values_gflops']:.1f}, " if result["values_s"] else "") + \
            f"critic update {result['critic_update_gflops']:.1f}"
        lines.append(f"  critic        {result['critic_s']:8.3f} s = {result['critic_over_update']:.2f} x the actor's "
                     f"update ({speeds} GFLOP/s; optimizer state {result['critic_optimizer_state_mb']:.1f} MB)")
    worker = (f" + the rollout worker's {result['worker_peak_rss_mb']:.0f} MB (generating {result['generate_s']:.1f} s "
              f"per batch; weights written in {result['weights_push_s']:.2f} s, loaded in "
              f"{result['worker_weights_load_s']:.2f} s)" if result["worker_peak_rss_mb"] else "")
    lines += [f"  generated     {result['generated_tokens_per_s']:8.0f} tokens/s ({result['generated_tokens']:.0f} tokens, "
              f"{result['decode_row_steps']:.0f} rows in decode steps)",
              f"  trained       {result['trained_tokens_per_s']:8.0f} tokens/s",
              f"  effective     {result['effective_gflops']:8.1f} GFLOP/s (rollout {result['rollout_gflops']:.1f}, "
              f"update {result['update_gflops']:.1f}) = {100 * result['effective_gflops'] / result['matmul_peak_gflops']:.0f}% of "
              f"the fp32 matmul peak",
              *peak_lines(result),
              *stage_rate_lines(result),
              f"  peak RSS      {result['peak_rss_mb']:8.0f} MB{worker} (optimizer state "
              f"{result['optimizer_state_mb']:.1f} MB, {result['trainable_params']:,} trained parameters)",
              f"  peak by stage {stage_peaks(result)} (RSS, Paddle's tensors)",
              f"  page faults   {stage_faults(result)}",
              f"  process CPU   {result['cpu_s_per_step']:8.3f} s per step (all threads)",
              f"  reward        {result['reward_mean']:8.3f} mean, accuracy {result['accuracy']:.3f} "
              f"({'LoRA' if result['lora'] else 'full'} training, {'bf16' if result['bf16'] else 'float32'})"]
    if "linear" in result:
        lin = result["linear"]
        lines.append(f"  bf16 linear   {lin['bf16_gflops']:8.1f} GFLOP/s ({lin['bf16_kernel']}) against float32's "
                     f"{lin['float32_gflops']:.1f}: {lin['speedup']:.2f}x (the layers' three products over "
                     f"{lin['tokens']} tokens)")
    served = result.get("rollout_server")
    if served:
        lines += [f"rollout on {len(served['urls'])} server(s) ({', '.join(served['urls'])}; {served['local_servers']} "
                  f"started here), the same workload step by step in turn with the inline run above, load average "
                  f"{served['load_avg'][0]:.1f} -> {served['load_avg'][1]:.1f}",
                  f"  step          {served['step_s']:8.3f} s = {served['step_over_inline']:.3f} x inline "
                  f"(median of the steps' ratios {served['step_ratio_median']:.3f})",
                  f"  rollout       {served['rollout_s']:8.3f} s (the servers generating "
                  f"{served['server_generate_s']:.3f} s; weights push {served['weights_push_s']:.3f} s of it, "
                  f"serialising {served['weights_serialize_s']:.3f} s, {served['weights_push_bytes'] / 2 ** 20:.1f} "
                  "MiB per server)"]
        lines += [f"  {stage:<13} {served[f'{stage}_s']:8.3f} s" for stage in STAGES if stage != "rollout"]
    return "\n".join(lines)


def switch_text(key: str, value, path: Optional[str] = None) -> str:
    """`use_fused_rope=false` / `use_flash_attention unset`, with the path it takes in parentheses."""
    text = f"{key} unset" if value is None else f"{key}={str(value).lower()}"
    return f"{text} ({path})" if path else text


def config_lines(result: dict) -> list:
    """The report's echo of the configuration: the command line's --set overrides and the fused-kernel switches
    (each key's value and the path it selects here)."""
    lines = [f"  config        {' '.join(result.get('overrides') or []) or '(the workload as defined)'}"]
    if result.get("kernel_switches"):
        paths = result.get("kernel_paths") or {}
        lines.append("  kernels       " + ", ".join(switch_text(k, v, paths.get(k))
                                                   for k, v in result["kernel_switches"].items()))
    return lines


PEAK_LABELS = {"fp32": "fp32 paddle.matmul", "bf16_linear": "bf16 suite bf16_linear (training)",
               "bf16_packed": "bf16 suite packed kernel (rollout)", "int8_packed": "int8 suite packed kernel (rollout)",
               "torch_bf16": "bf16 torch.matmul (outside reference)"}


def stage_rate_lines(result: dict) -> list:
    """Each stage's effective GFLOP/s and its share of the in-run peak of the precision it runs in."""
    rates = result.get("stage_gflops") or {}
    if not rates:
        return []
    lines = ["  stage rates   GFLOP/s (matmul FLOPs over the stage's seconds) and share of the peak of its precision:"]
    for stage, rate in rates.items():
        kind, peak = result["stage_peak_kind"][stage], result["stage_peak_gflops"][stage]
        share = result["stage_peak_fraction"][stage]
        against = f"= {100 * share:3.0f}% of {PEAK_LABELS[kind]} {peak:.1f}" if share is not None else \
            f"(no peak measured for {PEAK_LABELS.get(kind, kind) if kind else 'its precision'})"
        lines.append(f"    {stage:<14} {rate:8.1f} {against}")
    if "update_rerun" in rates:
        lines.append("    (update_rerun: the update with the forward blocks its recompute runs again counted too)")
    return lines


def stage_peaks(result: dict) -> str:
    """The peak RSS within each stage of the timed steps, and in parentheses the peak of Paddle's live tensors, MB
    (before_step: from the previous step's end or the process's start, the model builds included, to the step's
    first stage)."""
    rss, tensors = result.get("stage_peak_rss_mb") or {}, result.get("stage_peak_tensor_mb") or {}
    text = ", ".join(f"{name} {mb:.0f} ({tensors.get(name, 0.0):.0f})" for name, mb in rss.items()) + " MB"
    return text if result.get("per_stage_rss", True) else text + " (cumulative: /proc/self/clear_refs not writable)"


def every_step(result: dict) -> str:
    """With untimed steps before the timed ones: each step's seconds (rollout / reference / update) and the update's
    page faults, in order."""
    steps = result.get("steps") or []
    if len(steps) < 2:
        return ""
    def sec(value):
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return "; each step: " + ", ".join(
        f"{sec(s['step_s'])} ({sec(s['rollout_s'])} / {sec(s['ref_logprob_s'])} / {sec(s['update_s'])}, "
        f"{s['update_page_faults']:,.0f} faults){'' if s['timed'] else ' untimed'}" for s in steps) + \
        " (rollout / reference / update s, the update's page faults)"


def stage_faults(result: dict) -> str:
    """The page faults each stage took per timed step, with the memory they touched (pages of the OS's size)."""
    page = resource.getpagesize()
    faults = {k: v for k, v in (result.get("stage_page_faults") or {}).items() if v >= 1}
    if not faults:
        return "none"
    return ", ".join(f"{name} {count:,.0f} ({count * page / 2**30:.2f} GB)" for name, count in faults.items()) \
        + " per step"


def peak_lines(result: dict) -> list:
    """The report's matmul peaks: fp32 and bf16 side by side, each the best over the shapes before and after."""
    def gf(value):
        return "n/a" if value is None else f"{value:.1f}"

    def best_shape(kind):
        rows = [r for r in result["matmul_peaks"] if r["kind"] == kind]
        rows = [(max(v for v in (r["gflops_before"], r["gflops_after"]) if v is not None), r) for r in rows
                if r["gflops_before"] is not None or r["gflops_after"] is not None]
        return max(rows, key=lambda t: t[0])[1]["shape"] if rows else "-"
    lines = ["  matmul peaks  GFLOP/s, best over square and the workload's linear shapes (before / after the run):"]
    for kind, label in PEAK_LABELS.items():
        if kind not in result.get("peak_kinds", PEAK_KINDS):
            lines.append(f"    {label:<40} not timed (--peaks)")
            continue
        lines.append(f"    {label:<40} {gf(result[f'{kind}_peak_gflops']):>7} ({gf(result[f'{kind}_peak_before_gflops'])}"
                     f" / {gf(result[f'{kind}_peak_after_gflops'])}; best at {best_shape(kind)})")
    drift = result.get("peak_drift")
    if drift is not None and drift > PEAK_DRIFT_WARN:
        lines.append(f"    the machine's speed moved during the run: a peak changed by {100 * drift:.0f}% between before "
                     f"and after; compare steps of one sitting, over several runs")
    return lines


def _bench(args) -> int:
    if args.soak is not None:
        return soak_main(args)
    if args.rollout_precisions:
        result = rollout_precisions(args, resolve_args(args), [p.strip() for p in args.rollout_precisions.split(",")])
        print(f"rollout of {result['workload']} ({result['model']}), {result['prompts']} x {result['rollout_n']} rows, "
              f"mean length {result['mean_length']:.1f}, best of {len(result['runs'][0]['rounds'])} rounds; CPU {' '.join(result['cpu_flags'])}, custom ops "
              f"{result['custom_ops']}, load average {result['load_avg']:.1f}")
        for r in result["runs"]:
            name = "+".join(x for x in (r["rollout_dtype"], r["rollout_quant_type"]) if x)
            print(f"  {name:<28} {r['generate_s']:8.2f} s  {1e3 * r['s_per_generated_token']:7.2f} ms / token  "
                  f"{r['speedup']:5.2f}x")
        print(json.dumps(result, sort_keys=True))
        sys.stdout.flush()
        return 0
    if args.switches is not None:
        result = switch_runs(args)
        print(switch_report(result))
        print(json.dumps(result, sort_keys=True))
        sys.stdout.flush()
        return 0
    result = run(args)
    print(report(result))
    print(json.dumps(result, sort_keys=True))
    sys.stdout.flush()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1", help="see docs/performance.md")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="a random-init model shape instead of the "
                   "workload's")
    p.add_argument("--model-path", default=None, help="W3 - W5: a model folder (or a name `paddle-rl fetch` knows; "
                   "W5's default: qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; W5: 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length (+-4 tokens)")
    p.add_argument("--rollout-n", type=int, default=None, help="samples per prompt (default 8; W5: 4)")
    p.add_argument("--response-len", type=int, default=None, help="the workload's response length (exact for W1 "
                   "and W3, the maximum for W2 and W4)")
    p.add_argument("--kl-loss-coeff", type=float, default=0.04, help="> 0 loads the reference model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-precisions", default=None, metavar="LIST",
                   help="time the rollout alone once per precision, e.g. float32,bfloat16,weight_only_int8")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any configuration override (repeatable)")
    p.add_argument("--peaks", default=None, metavar="LIST",
                   help="the matmul peaks to time before and after the run (default all: " + ", ".join(PEAK_KINDS) +
                        "; fp32 always); where a kind is emulated (bf16 with the custom ops off or "
                        "PADDLE_RL_BF16_EMULATE, torch's bf16 without AVX512-BF16 / AMX) its timing takes a "
                        "minute; a kind left out reads n/a and rates no stage")
    p.add_argument("--switches", nargs="?", const="all", default=None, metavar="LIST",
                   help="time the fused-kernel switches instead: the workload with the config's switches and with "
                        "each switch flipped (all, or a comma-separated list such as use_fused_rope,"
                        "use_flash_attention), --warmup + --steps rounds alternated in one process")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="instead of timing: train the tiny default for MINUTES on two rollout servers and the reward "
                        "server while a seeded chaos loop kills and restarts them and once the trainer, then check "
                        "that nothing was lost (paddle_rl/soak.py, docs/reliability.md); --seed seeds the schedule")
    p.add_argument("--soak-interval", type=float, default=None, metavar="SECONDS",
                   help="--soak: mean seconds between faults (default: MINUTES x 2, within 15-60)")
    p.add_argument("--soak-keep", action="store_true", help="--soak: keep the work folder (kept anyway on a failure)")


def add_bench_subparser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time RL steps of a workload (W1 by default)")
    add_arguments(p)
    p.set_defaults(func=_bench)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="paddle-rl bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return _bench(p.parse_args(argv))

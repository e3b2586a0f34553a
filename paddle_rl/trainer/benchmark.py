"""`paddle-rl eval CONFIG --benchmark humaneval | gsm8k`: a public benchmark through the suite's own rollout engine.

- The records: `paddle-rl fetch humaneval | gsm8k-test`'s (model_files/benchmarks.py; read from the cache, fetched
  the first time).
- The prompts: HumanEval as EvalPlus builds an instruct model's (evalplus/codegen.py, provider/utility.py
  `make_raw_chat_prompt`): the user turn is `EVALPLUS_INSTRUCTION`, then the task's prompt (signature and
  docstring) in a ``` block; the assistant turn is begun with `EVALPLUS_RESPONSE` and an opened ```python block,
  from which the model continues. Generation stops at EvalPlus's stop strings (its `EOS` list and, for chat
  models, "\\n```\\n"); the completion is cut at the first of them (and at a closing fence), tabs become four
  spaces, as EvalPlus's Hugging Face decoder does. GSM8K as verl's recipe (examples/data_preprocess/gsm8k.py): the
  question, a space, and `VERL_GSM8K_INSTRUCTION`, as one user turn.
- Scoring: HumanEval's completion runs against the task's `check` in the sandbox by the `code` rule
  (rewards/code.py, all or nothing); GSM8K by the `gsm8k` rule (the last `#### <number>`; a response without
  `####` by its last \\boxed{} read the same way, as instruct models answer so whatever the prompt asks).
- pass@1 greedy (one sample, temperature 0); `samples` n > 1 draws n samples per problem with the config's
  temperature / top_p / top_k (keys from `seed`) and reports pass@k by the unbiased estimator of Chen et al. 2021
  (`pass_at_k`) for k = 1, 5, 10, 100 below n, and n.
"""
import json
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import paddle

from ..batch import StepBatch
from ..config import ConfigError
from ..model_files.benchmarks import GSM8K_INSTRUCTION
from ..model_files.hub import fetch_benchmark
from ..models import Tokenizer, load_model
from ..monitor.completions import write_records
from ..monitor.progress import progress_bar
from ..rewards.base import RewardSample
from ..rewards.code import OUTCOMES
from ..rewards.rules import RULE_REWARDS, last_boxed
from ..rollout import EngineSettings, RolloutEngine, SamplingParams
from ..rollout.keys import sample_key
from .preflight import path_problems

# evalplus/codegen.py run_codegen: the instruct prompt's two prefixes
EVALPLUS_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                        "markdown code block:")
EVALPLUS_RESPONSE = ("Below is a Python script with a self-contained function that solves the problem and passes "
                     "corresponding tests:")
# evalplus/provider/utility.py EOS, and "\n```\n" that its Hugging Face decoder adds for a chat model
EVALPLUS_STOPS = ("<|endoftext|>", "<|endofmask|>", "</s>", "\nif __name__", "\ndef main(", "\nprint(", "\n```\n")
_SPLITTER = "-[[]]-this-is-really-our-highest-priority-[[]]-"   # make_raw_chat_prompt's splitter
# verl examples/data_preprocess/gsm8k.py: appended to the question after a space
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# what the fetched records' `src` appends to a GSM8K question (model_files/benchmarks.py), removed to recover it
_GSM8K_SUFFIX = GSM8K_INSTRUCTION.split("{question}", 1)[1]

BENCHMARK_RECORDS = {"humaneval": "humaneval", "gsm8k": "gsm8k-test"}   # --benchmark -> fetchable records
DEFAULT_MAX_NEW_TOKENS = {"humaneval": 768, "gsm8k": 512}             # EvalPlus's max_new_tokens; GSM8K's chains


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k), computed as the product
    1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the large binomials."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:   # every k-subset holds a passing sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def reported_ks(n: int) -> List[int]:
    return sorted({1, n} | {k for k in (5, 10, 100) if k < n})


def humaneval_prompt(tokenizer: Tokenizer, code_prompt: str) -> str:
    """EvalPlus's `make_raw_chat_prompt` on the task's prompt (stripped twice there: codegen and the builder)."""
    user = f"{EVALPLUS_INSTRUCTION}\n```\n{code_prompt.strip()}\n```\n"
    assistant = f"{EVALPLUS_RESPONSE}\n```python\n{_SPLITTER}\n```\n"
    text = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                          {"role": "assistant", "content": assistant}], add_generation_prompt=False)
    return text.split(_SPLITTER)[0]


def gsm8k_prompt(tokenizer: Tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"{question} {VERL_GSM8K_INSTRUCTION}"}],
                                         add_generation_prompt=True)


def cut_completion(text: str, stops: Sequence[str] = EVALPLUS_STOPS) -> str:
    """EvalPlus's Hugging Face decoder's cut: the text before the first stop string, tabs as four spaces; also
    before a closing fence at the very end ("\\n```" followed by the end of the turn)."""
    end = min([text.index(s) for s in stops if s in text] + [len(text)])
    text = text[:end]
    if text.endswith("\n```"):
        text = text[:-4]
    return text.replace("\t", "    ")


class StopStrings:
    """An engine stage (rollout/engine.py `logits`): a row whose text ends past one of `stops` is given its stop
    token next (its logits leave only that token), as transformers' `stop_strings` ends a row."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], stop_id: int, window: int = 12):
        self.tokenizer, self.stops, self.stop_id, self.window = tokenizer, tuple(stops), int(stop_id), window

    def logits(self, seqs, logits, generated, stop_ids):
        hit = [i for i, s in enumerate(seqs) if s.tokens and not s.forced
               and any(stop in self.tokenizer.decode(s.tokens[-self.window:]) for stop in self.stops)]
        if not hit:
            return logits
        mask = np.zeros(logits.shape, dtype=bool)
        mask[hit] = True
        only = np.full(logits.shape, -np.inf, dtype=np.float32)
        only[:, self.stop_id] = 0.0
        return paddle.where(paddle.to_tensor(mask), paddle.to_tensor(only).astype(logits.dtype), logits)


@dataclass
class Problem:
    task_id: str
    prompt: str          # the text the model continues (chat-templated)
    record: dict         # the fetched record (ground truth under tgt)


def benchmark_problems(name: str, tokenizer: Tokenizer, limit: int = -1, path: Optional[str] = None) -> List[Problem]:
    """The first `limit` problems of the cached records (`path`: another file of the same records)."""
    if name not in BENCHMARK_RECORDS:
        raise ConfigError(f"--benchmark: unknown benchmark {name!r} (known: {', '.join(BENCHMARK_RECORDS)})")
    path = path or fetch_benchmark(BENCHMARK_RECORDS[name])
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if 0 <= limit <= len(problems):
                break
            record = json.loads(line)
            if name == "humaneval":
                if "code_prompt" not in record:
                    raise ConfigError(f"{path}:{number}: not a HumanEval record of `paddle-rl fetch humaneval` "
                                      "(no code_prompt)")
                problems.append(Problem(record["task_id"], humaneval_prompt(tokenizer, record["code_prompt"]),
                                        record))
            else:
                src = record["src"]
                question = src[:-len(_GSM8K_SUFFIX)] if src.endswith(_GSM8K_SUFFIX) else src
                problems.append(Problem(f"gsm8k/{record.get('index', len(problems))}",
                                        gsm8k_prompt(tokenizer, question), record))
    return problems


def _scorer(name: str, config):
    """fn(problem, response_text, completion, truncated) -> (passed, failure kind or None)."""
    if name == "humaneval":
        rule = RULE_REWARDS["code"].make(config)

        def score_code(problem, completion, length, truncated):
            # the assistant turn as written: the response prefix, the opened block, the completion, closed
            text = f"{EVALPLUS_RESPONSE}\n```python\n{completion}\n```\n"
            _, correct, counts = rule([RewardSample(problem.prompt, text, problem.record, length, truncated)])
            kind = next((o for o in OUTCOMES if counts[o][0] > 0), "runtime_error")
            return bool(correct[0]), None if kind == "pass" else kind
        return score_code
    rule = RULE_REWARDS["gsm8k"].make(config)

    def score_gsm8k(problem, completion, length, truncated):
        # the final answer after "####" (the gsm8k rule), else in the last \boxed{} (what instruct models write)
        boxed = last_boxed(completion) if "####" not in completion else None
        answer = completion if boxed is None else f"#### {boxed[boxed.index('{') + 1:-1]}"   # \boxed{N} -> N
        _, correct = rule([RewardSample(problem.prompt, answer, problem.record, length, truncated)])[:2]
        if correct[0]:
            return True, None
        return False, "no_answer" if "####" not in completion and boxed is None else "wrong_answer"
    return score_gsm8k


def run_benchmark(config, name: str, limit: int = -1, samples: int = 1, write_responses: Optional[str] = None,
                  records_path: Optional[str] = None, out=None) -> Dict[str, float]:
    """Evaluate config.actor_model_name_or_path on the benchmark; prints the table to `out` (stdout) and returns
    the metrics (benchmark/<name>/pass@k, problems, seconds_per_problem, ...)."""
    out = sys.stdout if out is None else out
    if samples < 1:
        raise ConfigError(f"--samples: must be >= 1, got {samples}")
    problems_found = path_problems(config, data=False)
    if problems_found:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems_found))
    model_dir = config.actor_model_name_or_path
    tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path or model_dir)
    score_one = _scorer(name, config)   # the sandbox is checked here, before the model loads
    problems = benchmark_problems(name, tokenizer, limit, records_path)
    if not problems:
        raise ConfigError(f"--benchmark {name}: no problems (--limit {limit})")
    model = load_model(model_dir, adapter=config.lora_path or None)
    stop_ids = sorted(set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids))
    stages = [StopStrings(tokenizer, EVALPLUS_STOPS, stop_ids[0])] if name == "humaneval" else []
    engine = RolloutEngine(model, settings=EngineSettings.from_config(config, tokenizer.pad_token_id, stop_ids),
                           stages=stages)
    max_new = config.eval_max_dec_len or DEFAULT_MAX_NEW_TOKENS[name]
    params = SamplingParams.from_config(config, stop_ids, greedy=samples == 1, max_dec_len=max_new)
    params.min_dec_len = 0   # a benchmark's answer ends where the model ends it
    chunk = max(1, config.per_device_eval_batch_size // samples)
    if write_responses is not None:
        write_records(write_responses, [])   # replaced now; each engine call's rows are appended as they are scored
    rows, start = [], time.perf_counter()
    with progress_bar(len(problems), desc=f"{name}", disabled=config.disable_tqdm) as bar:
        for first in range(0, len(problems), chunk):
            part = problems[first:first + chunk]
            keys = None if samples == 1 else [sample_key(config.seed, 0, p.task_id, j)
                                              for p in part for j in range(samples)]
            batch: StepBatch = engine.generate([tokenizer.encode(p.prompt) for p in part], samples, params, keys)
            responses = batch.responses()
            texts = tokenizer.decode_batch(responses, skip_special_tokens=True)
            first_row = len(rows)
            for row, text in enumerate(texts):
                problem = part[row // samples]
                completion = cut_completion(text) if name == "humaneval" else text
                length, truncated = int(batch["lengths"][row]), bool(batch["truncated"][row])
                passed, kind = score_one(problem, completion, length, truncated)
                rows.append({"task_id": problem.task_id, "sample": row % samples, "prompt": problem.prompt,
                             "completion": completion, "passed": passed, "failure": kind,
                             "response_tokens": length, "truncated": truncated,
                             "response_token_ids": [int(t) for t in responses[row]]})
            if write_responses is not None:
                write_records(write_responses, rows[first_row:], append=True)
            for _ in range(len(part) - 1):
                bar.update("")
            done = len({r["task_id"] for r in rows})
            bar.update(f"pass@1 {np.mean([r['passed'] for r in rows]):.3f}, "
                       f"{(time.perf_counter() - start) / done:.1f} s/problem")
    seconds = time.perf_counter() - start
    metrics = benchmark_metrics(name, rows, samples, seconds)
    print(format_table(name, metrics, samples), file=out)
    return metrics


def benchmark_metrics(name: str, rows: List[dict], samples: int, seconds: float) -> Dict[str, float]:
    by_task: Dict[str, List[bool]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(bool(r["passed"]))
    prefix = f"benchmark/{name}"
    metrics = {f"{prefix}/problems": float(len(by_task)), f"{prefix}/samples_per_problem": float(samples),
               f"{prefix}/seconds": seconds, f"{prefix}/seconds_per_problem": seconds / len(by_task),
               f"{prefix}/response_tokens_mean": float(np.mean([r["response_tokens"] for r in rows]))}
    for k in reported_ks(samples):
        metrics[f"{prefix}/pass@{k}"] = float(np.mean([pass_at_k(len(v), sum(v), k) for v in by_task.values()]))
    failures: Dict[str, int] = {}
    for r in rows:
        if r["failure"]:
            failures[r["failure"]] = failures.get(r["failure"], 0) + 1
    for kind, count in sorted(failures.items()):
        metrics[f"{prefix}/failures/{kind}"] = float(count)
    return metrics


def format_table(name: str, metrics: Dict[str, float], samples: int) -> str:
    prefix = f"benchmark/{name}"
    ks = reported_ks(samples)
    head = ["benchmark", "problems", "samples"] + [f"pass@{k}" for k in ks] + ["s / problem"]
    cells = [name, f"{metrics[prefix + '/problems']:.0f}", str(samples)] + \
        [f"{100 * metrics[f'{prefix}/pass@{k}']:.1f}%" for k in ks] + [f"{metrics[prefix + '/seconds_per_problem']:.1f}"]
    failures = ", ".join(f"{key.rsplit('/', 1)[1]} {value:.0f}" for key, value in metrics.items()
                         if key.startswith(prefix + "/failures/"))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
             "| " + " | ".join(cells) + " |"]
    if failures:
        lines.append(f"failures (samples): {failures}")
    return "\n".join(lines)

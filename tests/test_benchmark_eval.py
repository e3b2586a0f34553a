"""`paddle-rl eval CONFIG --benchmark humaneval | gsm8k`: the pass@k estimator, EvalPlus's prompt and stop strings,
and the command on the bundled tiny model over HumanEval-format problems built here, scored in the real sandbox."""
import gzip
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from paddle_rl.config import load_config
from paddle_rl.model_files.benchmarks import gsm8k_records, humaneval_records
from paddle_rl.models import Tokenizer, load_model
from paddle_rl.rewards.sandbox import isolation
from paddle_rl.rollout import EngineSettings, RolloutEngine, SamplingParams
from paddle_rl.trainer.benchmark import (Problem, StopStrings, _scorer, cut_completion, humaneval_prompt,
                                         pass_at_k, reported_ks)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "tiny_arith", "model")
CONFIG = os.path.join(ROOT, "configs", "tiny_arith_grpo.yaml")
# EvalPlus's (evalplus/codegen.py) and verl's (examples/data_preprocess/gsm8k.py) texts, written out here
EVALPLUS_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                        "markdown code block:")
EVALPLUS_RESPONSE = ("Below is a Python script with a self-contained function that solves the problem and passes "
                     "corresponding tests:")
VERL_GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
needs_sandbox = pytest.mark.skipif(isolation() is None, reason="bubblewrap (bwrap) cannot isolate programs here")

# Three tasks in HumanEval's own layout. The completion the tiny model writes is one token (eval_max_dec_len=1), a
# digit: a program that runs and defines nothing, so the verdict is the test's. `shift` is defined by its test and
# passes; `always_wrong`'s check asserts something false (wrong_answer); `undefined`'s entry point exists nowhere
# (runtime_error: NameError).
TASKS = [
    {"task_id": "Tiny/0", "prompt": "def shift(x: int) -> int:\n    \"\"\" Return x + 1.\n    >>> shift(1)\n    2\n    \"\"\"\n",
     "entry_point": "shift", "canonical_solution": "    return x + 1\n",
     "test": "def shift(x):\n    return x + 1\n\n\ndef check(candidate):\n    assert candidate(1) == 2\n"},
    {"task_id": "Tiny/1", "prompt": "def always_wrong(x: int) -> int:\n    \"\"\" Return x.\n    \"\"\"\n",
     "entry_point": "len", "canonical_solution": "    return x\n",
     "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n"},
    {"task_id": "Tiny/2", "prompt": "def undefined(x: int) -> int:\n    \"\"\" Return x * 2.\n    \"\"\"\n",
     "entry_point": "undefined", "canonical_solution": "    return x * 2\n",
     "test": "def check(candidate):\n    assert candidate(2) == 4\n"},
]


def run_cli(args, env=None):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "paddle_rl", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=600)


def write_humaneval(folder, tasks=TASKS):
    """The records `paddle-rl fetch humaneval` writes, from a HumanEval.jsonl.gz of `tasks` (the same converter)."""
    data = gzip.compress("".join(json.dumps(t) + "\n" for t in tasks).encode())
    records = humaneval_records(data, "HumanEval.jsonl.gz")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "humaneval.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


# ------------------------------------------------------------------------------------------------- the estimator

def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5, abs=1e-15)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, abs=1e-15)        # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-15)     # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6, abs=1e-15)         # 1 - C(3,2)/C(4,2)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001, abs=1e-15)
    # binomials far past float range (C(200, 100) ~ 9e58, C(2000, 1000) overflows a float): the product stays exact
    for n, c, k in ((200, 13, 100), (2000, 7, 1000), (2000, 1999, 1)):
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0       # c = 0: never
    assert pass_at_k(5, 4, 2) == 1.0                                          # n - c = 1 < k = 2: always
    assert pass_at_k(3, 3, 1) == 1.0 and pass_at_k(7, 1, 7) == 1.0           # c = n; k = n with one pass
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0           # greedy: passed or not
    for bad in ((5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 4] and reported_ks(8) == [1, 5, 8] and reported_ks(200) == [1, 5, 10, 100, 200]


# ---------------------------------------------------------------------------------- prompts, stops, scoring

def test_humaneval_prompt_is_evalplus_raw_chat_prompt():
    tokenizer = Tokenizer.from_pretrained(TINY)
    code = "\n\ndef f(x):\n    \"\"\" Doc.\n    \"\"\"\n"
    expected = ("<|im_start|>user\n" + EVALPLUS_INSTRUCTION + "\n```\ndef f(x):\n    \"\"\" Doc.\n    \"\"\"\n```\n"
                "<|im_end|>\n<|im_start|>assistant\n" + EVALPLUS_RESPONSE + "\n```python\n")
    assert humaneval_prompt(tokenizer, code) == expected


def test_cut_completion_at_evalplus_stops():
    assert cut_completion("def f():\n\treturn 1\n```\n\nThis function") == "def f():\n    return 1"
    assert cut_completion("def f():\n    return 1\n\nif __name__ == '__main__':\n    f()") == \
        "def f():\n    return 1\n"
    assert cut_completion("def f():\n    return 1\nprint(f())\n") == "def f():\n    return 1"
    assert cut_completion("def f():\n    return 1\n```") == "def f():\n    return 1"     # closing fence, then EOS
    assert cut_completion("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_stop_strings_stage_ends_a_row_after_the_string():
    """Through the engine: without the stage the greedy row runs to max_dec_len; with a stop string taken from its
    own text the row ends at the token that completes the string, with the stop token."""
    tokenizer = Tokenizer.from_pretrained(TINY)
    model = load_model(TINY)
    stop_ids = sorted(set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids))
    prompt = tokenizer.encode(humaneval_prompt(tokenizer, TASKS[0]["prompt"]))
    params = SamplingParams(max_dec_len=24, temperature=0.0, stop_token_ids=stop_ids)
    plain = RolloutEngine(model, settings=EngineSettings(tokenizer.pad_token_id, stop_ids)).generate([prompt], 1,
                                                                                                       params)
    tokens = plain.responses()[0]
    full = tokenizer.decode(tokens)
    assert len(tokens) == 24 and bool(plain["truncated"][0])
    stop = full[6:9]          # a string the row writes: it ends at the token completing its first occurrence
    end = next(i for i in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:i]))
    stage = StopStrings(tokenizer, (stop,), stop_ids[0])
    stopped = RolloutEngine(model, settings=EngineSettings(tokenizer.pad_token_id, stop_ids),
                            stages=[stage]).generate([prompt], 1, params)
    assert stopped.responses()[0] == tokens[:end] + [stop_ids[0]]
    assert not bool(stopped["truncated"][0])


@needs_sandbox
def test_scorers_give_the_failure_kind():
    config = load_config(CONFIG, ["sandbox_timeout=5"])
    records = humaneval_records(gzip.compress(json.dumps(TASKS[2]).encode()), "x")
    code = _scorer("humaneval", config)
    problem = Problem("Tiny/2", "p", records[0])
    assert code(problem, "def undefined(x):\n    return x * 2\n", 10, False) == (True, None)
    assert code(problem, "def undefined(x):\n    return x * 3\n", 10, False) == (False, "wrong_answer")
    assert code(problem, "def undefined(x)\n    return x\n", 10, False) == (False, "syntax_error")
    assert code(problem, "import time\ndef undefined(x):\n    time.sleep(30)\n", 10, False) == (False, "timeout")
    record = gsm8k_records(json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}).encode(), "x")[0]
    gsm8k = _scorer("gsm8k", config)
    problem = Problem("gsm8k/0", "p", record)
    assert gsm8k(problem, "2 + 2 = 4\n#### 4", 5, False) == (True, None)
    assert gsm8k(problem, "The answer is 4.", 5, False) == (False, "no_answer")
    assert gsm8k(problem, "#### 5", 5, False) == (False, "wrong_answer")
    assert gsm8k(problem, "so \\(\\boxed{4}\\).", 5, False) == (True, None)       # no ####: the last \boxed{}
    assert gsm8k(problem, "\\boxed{4} then \\boxed{5}", 5, False) == (False, "wrong_answer")
    assert gsm8k(problem, "\\boxed{4}\n#### 5", 5, False) == (False, "wrong_answer")   # #### decides when written


# -------------------------------------------------------------------------------------------- the command

@needs_sandbox
def test_eval_benchmark_humaneval_on_the_tiny_model(tmp_path):
    write_humaneval(str(tmp_path / "data"))
    out = tmp_path / "responses.jsonl"
    result = run_cli(["eval", CONFIG, "--benchmark", "humaneval", "--write-responses", str(out),
                      "eval_max_dec_len=1", "sandbox_timeout=5"], env={"PADDLE_RL_DATA": str(tmp_path / "data")})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[:3] == ["| benchmark | problems | samples | pass@1 | s / problem |", "|---|---|---|---|---|",
                         lines[2]]
    assert lines[2].startswith("| humaneval | 3 | 1 | 33.3% | ")
    assert lines[3] == "failures (samples): runtime_error 1, wrong_answer 1"
    metrics = json.loads(lines[-1])
    assert metrics["benchmark/humaneval/problems"] == 3
    assert metrics["benchmark/humaneval/pass@1"] == pytest.approx(1 / 3)
    assert metrics["benchmark/humaneval/seconds_per_problem"] > 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["Tiny/0", "Tiny/1", "Tiny/2"]
    assert [r["passed"] for r in rows] == [True, False, False]
    assert [r["failure"] for r in rows] == [None, "wrong_answer", "runtime_error"]
    tokenizer = Tokenizer.from_pretrained(TINY)
    for row, task in zip(rows, TASKS):
        assert row["prompt"] == humaneval_prompt(tokenizer, task["prompt"])    # the prompt as the model saw it
        assert row["response_tokens"] == 1
        assert len(row["response_token_ids"]) == 1      # the generated ids (tools/reference_check.py reads them)
        assert tokenizer.decode(row["response_token_ids"], skip_special_tokens=True).strip() == \
            row["completion"].strip()

    # --limit: the first problems only
    result = run_cli(["eval", CONFIG, "--benchmark", "humaneval", "--limit", "1", "eval_max_dec_len=1",
                      "sandbox_timeout=5"], env={"PADDLE_RL_DATA": str(tmp_path / "data")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].startswith("| humaneval | 1 | 1 | 100.0% | ")


@needs_sandbox
def test_eval_benchmark_samples_report_pass_at_k(tmp_path):
    """--samples 8: eight one-token completions per problem sampled at temperature 2.5 (keys from the seed); `shift`
    passes when the sampled program runs (3 of its 8 do; the others are syntax errors), the other two never pass.
    Over the 3 problems: pass@1 = 3/8 / 3, pass@5 = (1 - C(5,5)/C(8,5)) / 3 = (1 - 1/56) / 3, pass@8 = 1/3."""
    write_humaneval(str(tmp_path / "data"))
    out = tmp_path / "responses.jsonl"
    result = run_cli(["eval", CONFIG, "--benchmark", "humaneval", "--samples", "8", "--write-responses", str(out),
                      "eval_max_dec_len=1", "temperature=2.5", "sandbox_timeout=5"],
                     env={"PADDLE_RL_DATA": str(tmp_path / "data")})
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 24 and [r["sample"] for r in rows[:8]] == list(range(8))
    passed = {t["task_id"]: sum(r["passed"] for r in rows if r["task_id"] == t["task_id"]) for t in TASKS}
    assert passed == {"Tiny/0": 3, "Tiny/1": 0, "Tiny/2": 0}
    assert {r["failure"] for r in rows if r["task_id"] == "Tiny/0"} == {None, "syntax_error"}
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["benchmark/humaneval/pass@1"] == pytest.approx(0.125)
    assert metrics["benchmark/humaneval/pass@5"] == pytest.approx((1 - 1 / 56) / 3)
    assert metrics["benchmark/humaneval/pass@8"] == pytest.approx(1 / 3)
    assert result.stdout.splitlines()[0] == "| benchmark | problems | samples | pass@1 | pass@5 | pass@8 | s / problem |"
    assert result.stdout.splitlines()[2].startswith("| humaneval | 3 | 8 | 12.5% | 32.7% | 33.3% | ")


def test_eval_benchmark_gsm8k_prompt_and_table(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    raw = [{"question": "What is 51 + 29 + 60?", "answer": "51 + 29 + 60 = 140\n#### 140"},
           {"question": "What is 93 + 16 + 19?", "answer": "#### 128"}]
    records = gsm8k_records("".join(json.dumps(r) + "\n" for r in raw).encode(), "test.jsonl")
    (folder / "gsm8k-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "responses.jsonl"
    result = run_cli(["eval", CONFIG, "--benchmark", "gsm8k", "--write-responses", str(out), "eval_max_dec_len=8"],
                     env={"PADDLE_RL_DATA": str(folder)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].startswith("| gsm8k | 2 | 1 | 0.0% | ")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["gsm8k/0", "gsm8k/1"]
    assert rows[0]["prompt"] == ("<|im_start|>user\nWhat is 51 + 29 + 60? " + VERL_GSM8K_INSTRUCTION +
                                 "<|im_end|>\n<|im_start|>assistant\n<think>")
    assert [r["failure"] for r in rows] == ["no_answer", "no_answer"]

    # tools/reference_check.py: transformers' greedy argmax (one teacher-forced pass over the same safetensors)
    # equals the engine's every generated token, and the independent reading agrees; a token changed is found
    check = [sys.executable, os.path.join(ROOT, "tools", "reference_check.py"), "--benchmark", "gsm8k",
             "--model-dir", TINY]
    env = dict(os.environ, PYTHONPATH=ROOT, PADDLE_RL_DATA=str(folder))
    done = subprocess.run(check + [str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prompt ids equal to transformers' tokenizer: 2 / 2" in done.stdout
    assert "argmax equals the engine's token at every position: 2 / 2" in done.stdout
    assert "on the same completions: 2 / 2 agree" in done.stdout
    rows[1]["response_token_ids"][3] = (rows[1]["response_token_ids"][3] + 1) % 300
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(check + [str(changed)], env=env, capture_output=True, text=True, timeout=600)
    assert "argmax equals the engine's token at every position: 1 / 2" in done.stdout, done.stdout
    assert "gsm8k/1: first differs at response token 3 of 8" in done.stdout


def test_eval_limit_without_benchmark_is_refused():
    result = run_cli(["eval", CONFIG, "--limit", "3"])
    assert result.returncode == 2 and "--limit / --samples: only with --benchmark" in result.stderr


# --------------------------------------------------------------------------------------------- the real model

QWEN = os.path.join(os.environ.get("PADDLE_RL_MODELS", os.path.expanduser("~/.cache/paddle_rl/models")),
                    "Qwen2.5-Coder-0.5B-Instruct")
HUMANEVAL = os.path.join(os.environ.get("PADDLE_RL_DATA", os.path.expanduser("~/.cache/paddle_rl/data")),
                         "humaneval.jsonl")


@pytest.mark.slow
@needs_sandbox
@pytest.mark.skipif(not (os.path.isfile(os.path.join(QWEN, "config.json")) and os.path.isfile(HUMANEVAL)),
                    reason="needs `paddle-rl fetch qwen2.5-coder-0.5b-instruct` and `paddle-rl fetch humaneval`")
def test_qwen_coder_humaneval_first_problems(tmp_path):
    """The first 3 HumanEval tasks with Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, converted): the verdicts
    docs/benchmarks.md reports, and prompt ids equal to transformers' GGUF tokenizer's."""
    out = tmp_path / "responses.jsonl"
    result = run_cli(["eval", "/dev/null", f"actor_model_name_or_path={QWEN}", "--benchmark", "humaneval",
                      "--limit", "3", "--write-responses", str(out)],
                     env={"PADDLE_RL_DATA": os.path.dirname(HUMANEVAL)})
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["passed"] for r in rows] == EXPECTED_FIRST_THREE
    transformers = pytest.importorskip("transformers")
    gguf = os.path.join(os.path.dirname(QWEN), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if os.path.isfile(gguf):
        theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        ours = Tokenizer.from_pretrained(QWEN)
        for row in rows:
            assert np.array_equal(theirs.encode(row["prompt"]), ours.encode(row["prompt"]))


EXPECTED_FIRST_THREE = [True, False, True]   # measured (docs/benchmarks.md)

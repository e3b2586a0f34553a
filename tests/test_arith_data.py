"""Addition problems of the tiny arithmetic default, their records, and the numeric path of the math rule."""
import json

import pytest

from make_tiny_model import build_arith_data, record_response, score_arith
from paddle_rl.data.arith import AdditionProblem, generate_problems
from paddle_rl.rewards.rules import math_score


def test_worked_steps_are_running_sums():
    p = AdditionProblem((51, 29, 60))
    assert p.question() == "What is 51 + 29 + 60?"
    assert p.worked_steps() == "51 + 29 = 80. 80 + 60 = 140."
    assert p.answer() == "140"


def test_generation_is_deterministic_distinct_and_in_range():
    a = generate_problems(500, 3, 10, 99, seed=5)
    assert a == generate_problems(500, 3, 10, 99, seed=5)
    assert a != generate_problems(500, 3, 10, 99, seed=6)
    assert len({p.operands for p in a}) == 500
    assert all(len(p.operands) == 3 and all(10 <= x <= 99 for x in p.operands) for p in a)


@pytest.mark.parametrize("count, operands, low, high, message", [
    (5, 1, 0, 9, "operands must be >= 2"), (5, 2, 9, 0, "must be <="), (101, 2, 0, 9, "only 100 exist")])
def test_impossible_requests_are_refused(count, operands, low, high, message):
    with pytest.raises(ValueError, match=message):
        generate_problems(count, operands, low, high, seed=0)


def test_splits_are_disjoint_and_written_without_the_worked_steps(tmp_path):
    splits = build_arith_data(str(tmp_path), seed=3, n_sft=50, n_train=30, n_test=20, n_dev=10, write_sft=False)
    sizes = {name: len(recs) for name, recs in splits.items()}
    assert sizes == {"test": 20, "train": 30, "dev": 10, "sft": 50}
    prompts = [r["src"] for recs in splits.values() for r in recs]
    assert len(set(prompts)) == len(prompts)
    written = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert written == [{"src": r["src"], "tgt": r["tgt"]} for r in splits["train"]]
    assert not (tmp_path / "sft.jsonl").exists()
    first = splits["sft"][0]
    assert first["src"].endswith("<|im_start|>assistant\n<think>")
    response = record_response(first)
    assert response.endswith(f"</think>\n<answer>{first['tgt']}</answer><|im_end|>")
    assert score_arith(response, first["tgt"]) == (1.0, True)
    assert score_arith(response, str(int(first["tgt"]) + 1)) == (0.0, True)
    assert score_arith(" 1 + 2 = 3.", "3") == (0.0, False)


@pytest.mark.parametrize("answer, truth, expected", [
    ("140", "140", 1.0), ("141", "140", 0.0), ("140.0", "140", 1.0), ("-7", "-7", 1.0), ("07", "7", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0), ("1/2", "0.5", 1.0), ("140 apples", "140", 1.0)])
def test_math_rule_numbers_agree_with_math_verify(answer, truth, expected):
    assert math_score(f"<think>x</think>\n<answer>{answer}</answer><|im_end|>", truth) == expected


def test_shipped_tiny_default_starts_where_its_readme_says():
    """The bundled arithmetic checkpoint, evaluated through `paddle-rl eval` with its own config, gives the
    held-out accuracy written in data/tiny_arith/README.md (the starting point of the learning curves)."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "data", "tiny_arith", "README.md"), encoding="utf-8").read()
    recorded = float(re.search(r"held-out greedy accuracy ([0-9.]+)", readme).group(1))
    proc = subprocess.run([sys.executable, "-m", "paddle_rl", "eval", "configs/tiny_arith_grpo.yaml"], cwd=root,
                          env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["eval/num_samples"] == 400.0
    assert metrics["eval/accuracy"] == pytest.approx(recorded, abs=0.02)
    assert 0.2 <= metrics["eval/accuracy"] <= 0.5

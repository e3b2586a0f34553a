"""The `code` rule: run the program a response contains against the record's tests in the sandbox (sandbox.py).

Tests come from the record's ground truth (`reward_model.ground_truth`, `ground_truth`, `solution`, or the
`response_key`), a dict or its JSON string, in one of these layouts:
- stdin / stdout (verl's PRIME / Eurus code data, `data_source` codecontests, apps, taco, ...):
  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}: the program reads each input on stdin; its stdout must
  equal the output (trailing whitespace of each line and blank lines at the end ignored);
- call-based (the same data with `fn_name`): {"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [[3], ...]}:
  each input is the argument list; the function's return value must equal the output (or its only element);
- assert-based (AceCoder-style `test_cases`, or `asserts`): {"test_cases": ["assert add(1, 2) == 3", ...]}: each
  assert runs after the program;
- HumanEval / MBPP style: {"test": "def check(candidate): ...", "entry_point": "add"}: one test, check(add).
The program: the last ```python (or ```) fenced block of the response, else the text after </think>, else all of
it. Score: the fraction of tests passed (`code_score: fraction`) or 1 only if all pass (`all`). A response with no
tests to run is an error naming the sample. Every test run's outcome is counted (`OUTCOMES`; metrics
reward/code/<outcome>, summed over the batch).
"""
import json
import re
from collections import Counter
from typing import List, Tuple

import numpy as np

from ..config.options import option
from .rules import SampleError, register_rule
from .sandbox import STATUSES, SandboxLimits, require_isolation, run_program

# a test run's outcome; each is counted per batch in metrics as reward/code/<outcome>
OUTCOMES = ("pass", "wrong_answer") + tuple(status for status in STATUSES if status != "ok")
FENCE = re.compile(r"```(?:python|py|Python3|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    blocks = FENCE.findall(response)
    if blocks:
        return blocks[-1]
    return response.split("</think>")[-1].replace("<|im_end|>", "").replace("<|endoftext|>", "")


def parse_tests(truth) -> List[Tuple[str, object, object]]:
    """[(kind, input, expected)], kind: stdio | call | assert | check."""
    if isinstance(truth, str):
        truth = json.loads(truth)
    if not isinstance(truth, dict):
        raise ValueError(f"code tests must be a JSON object, got {type(truth).__name__}")
    if "inputs" in truth and "outputs" in truth:
        inputs, outputs = truth["inputs"], truth["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        fn = truth.get("fn_name")
        if fn:
            return [("call", (fn, args), out) for args, out in zip(inputs, outputs)]
        return [("stdio", str(i), str(o)) for i, o in zip(inputs, outputs)]
    for key in ("test_cases", "asserts"):
        if isinstance(truth.get(key), list):
            return [("assert", str(case), None) for case in truth[key]]
    if isinstance(truth.get("test"), str):
        return [("check", truth["test"], truth.get("entry_point"))]
    raise ValueError(f"no tests: expected inputs/outputs, test_cases, asserts or test (keys: {', '.join(truth)})")


def _same_stdout(got: str, expected: str) -> bool:
    def lines(text):
        out = [line.rstrip() for line in text.strip("\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(got) == lines(expected)


def run_test(program: str, test, limits: SandboxLimits) -> str:
    """'pass', 'wrong_answer', or the run's failing status (sandbox.STATUSES). Only the harness's verdict, written
    after the test with a marker the program is not given, passes a call-based, assert or HumanEval test: an early
    exit fails it (`early_exit`), and a value of a non-builtin type returned by the program's functions or met in
    the test's comparisons fails it (`bad_type`: an `__eq__` that always says True)."""
    kind, given, expected = test
    if kind == "stdio":
        result = run_program(program, given, limits)
        if result.status != "ok":
            return result.status
        return "pass" if _same_stdout(result.stdout, expected) else "wrong_answer"
    if kind == "call":
        fn, args = given
        result = run_program(program, "", limits, test={"call": fn, "args": list(args)})
    else:
        code = f"{given}\n" + (f"check({expected})\n" if kind == "check" and expected else "")
        result = run_program(program, "", limits, test={"code": code})
    if result.status != "ok":
        return result.status
    outcome = result.verdict["outcome"]
    if outcome == "returned":
        got = result.verdict.get("value")
        return "pass" if got == expected or [got] == expected else "wrong_answer"
    return outcome if outcome in OUTCOMES else "runtime_error"


def score_program(response: str, truth, limits: SandboxLimits, all_or_nothing: bool) -> Tuple[float, Counter]:
    """(score, Counter of test outcomes) of one response."""
    tests = parse_tests(truth)
    if not tests:
        raise ValueError("no tests to run")
    outcomes = Counter(run_test(extract_program(response), t, limits) for t in tests)
    passed = outcomes["pass"] / len(tests)
    return (float(passed == 1.0) if all_or_nothing else passed), outcomes


def sandbox_limits(config) -> SandboxLimits:
    """The code rule's limits from the config's sandbox_* keys; refuses (SandboxError) where programs cannot be
    isolated, unless sandbox_allow_unisolated."""
    limits = SandboxLimits(wall_seconds=config.sandbox_timeout, cpu_seconds=max(1, int(config.sandbox_timeout)),
                           memory_mb=config.sandbox_memory_mb, processes=config.sandbox_processes,
                           allow_network=config.sandbox_allow_network,
                           allow_unisolated=config.sandbox_allow_unisolated)
    if not limits.allow_unisolated:
        require_isolation()
    return limits


def _limits_errors(key, value, config):
    """The three limits of a test run, checked together (one line naming them all)."""
    if config.sandbox_timeout <= 0 or config.sandbox_memory_mb < 64 or config.sandbox_processes < 1:
        return (f"sandbox_timeout / sandbox_memory_mb / sandbox_processes: must be > 0 s, >= 64 MB and >= 1, got "
                f"{config.sandbox_timeout}, {config.sandbox_memory_mb}, {config.sandbox_processes}")
    return None


# the keys of every runner of untrusted programs: this rule and the tool environment's python tool (rollout/episodes.py
# names them too; sandbox.py imports nothing of the project, as it also runs on its own)
SANDBOX_ALLOW_NETWORK = option("sandbox_allow_network", bool, False,
                               "Untrusted programs (code rule, python tool) share the host's network namespace "
                               "(every other isolation stays; logged).")
SANDBOX_ALLOW_UNISOLATED = option("sandbox_allow_unisolated", bool, False,
                                  "Run untrusted programs (code rule, python tool) where bubblewrap cannot isolate "
                                  "them: as this user with rlimits only (logged). Without it such a run stops at "
                                  "start-up.")
CODE_SCORE = option("code_score", str, "fraction",
                    "code rule: fraction (tests passed / tests) | all (1 only if every test passes).",
                    choices=("fraction", "all"))
SANDBOX_TIMEOUT = option("sandbox_timeout", float, 10.0,
                         "code rule: wall-clock seconds (and CPU seconds) per test run.", check=_limits_errors)
SANDBOX_MEMORY_MB = option("sandbox_memory_mb", int, 1024,
                           "code rule: memory of a test run, MB: all its processes and files together "
                           "(docs/rewards.md says how it is bounded).")
SANDBOX_PROCESSES = option("sandbox_processes", int, 32, "code rule: the most processes a test run may have at once.")


@register_rule("code", needs_config=True, options=(CODE_SCORE, SANDBOX_TIMEOUT, SANDBOX_MEMORY_MB, SANDBOX_PROCESSES,
                                                   SANDBOX_ALLOW_NETWORK, SANDBOX_ALLOW_UNISOLATED))
def make_code_rule(config):
    """Run the response's program against the record's tests in the sandbox: fraction passed (or all-or-nothing)."""
    limits = sandbox_limits(config)
    all_or_nothing = config.code_score == "all"

    def code_rule(samples):
        scores = np.empty(len(samples), dtype=np.float32)
        counts = {outcome: np.zeros(len(samples), dtype=np.float32) for outcome in OUTCOMES}
        for i, sample in enumerate(samples):
            truth = sample.ground_truth
            if truth is None:
                raise SampleError(i, "the record has no tests (reward_model.ground_truth, ground_truth or solution)")
            try:
                scores[i], outcomes = score_program(sample.response, truth, limits, all_or_nothing)
            except (ValueError, TypeError) as e:
                raise SampleError(i, f"bad tests: {e}") from e
            for outcome, count in outcomes.items():
                counts[outcome][i] = count
        return scores, scores >= 1.0, counts
    return code_rule

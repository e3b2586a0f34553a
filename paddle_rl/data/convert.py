"""`paddle-rl data convert`: local GSM8K / MATH / NuminaMath / APPS / AceCoder files -> the layouts the trainer reads.

Sources (jsonl, json or parquet, detected from the first record with --format auto):
  gsm8k   question, answer ("... #### 72"): the final answer is the number after the last ####.
  math    problem, solution (final answer in the last \\boxed{}), or an explicit answer field.
  numina  problem, solution, messages (NuminaMath): the last \\boxed{} of the solution.
  apps    question, input_output (APPS / CodeContests / TACO: a JSON string of inputs, outputs, fn_name): the tests
          become the ground truth of the `code` rule (verl's PRIME layout; data_source apps, ability code).
  acecoder question, test_cases (a list of asserts): ground truth {"test_cases": [...]} for the `code` rule.
Layouts:
  paddlenlp  {"src": chat-templated prompt, "tgt": final answer, "data_source": ...}
  chat       ms-swift: {"messages": [system, user], "solution": final answer, "data_source": ...}
  verl       {"data_source", "prompt": [system, user], "ability", "reward_model": {"style", "ground_truth"},
              "extra_info"}
The system prompt asks for <think> ... </think> <answer> ... </answer> (and, for gsm8k, "#### <number>"
inside the answer, which the gsm8k reward reads). The paddlenlp layout renders it with the built-in
Qwen2.5 chat template or the chat template of a tokenizer folder (--tokenizer), and opens the assistant
turn with "<think>".

Examples:
  paddle-rl data convert gsm8k/train.parquet --out data/gsm8k/train.jsonl
  paddle-rl data convert MATH/train.jsonl --layout chat --out data/math/train.chat.jsonl
  paddle-rl data convert numina.parquet --tokenizer models/Qwen2.5-0.5B-Instruct --out data/numina.jsonl
"""
import argparse
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .loader import DatasetError, iter_records
from .templates import THINK_PREFIX, chat_messages, render_qwen25, system_prompt

logger = logging.getLogger("paddle_rl")

SOURCES = ("gsm8k", "math", "numina", "apps", "acecoder")
LAYOUTS = ("paddlenlp", "chat", "verl")
TEMPLATES = ("qwen2.5", "plain")
DATA_SOURCES = {"gsm8k": "gsm8k", "math": "math", "numina": "numina_math", "apps": "apps", "acecoder": "acecoder"}
REWARD_TASK = {"gsm8k": "gsm8k", "math": "math", "numina": "math", "apps": "code", "acecoder": "code"}
EXTRA_FIELDS = {"gsm8k": (), "math": ("level", "type", "subject", "unique_id"), "numina": ("source",),
                "apps": ("difficulty", "url", "problem_id"), "acecoder": ("id", "source")}
ABILITY = {"apps": "code", "acecoder": "code"}   # verl's `ability` (math otherwise)


class ConvertError(ValueError):
    pass


# ------------------------------------------------------------------------------------------ final answers

GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)


def gsm8k_final_answer(answer: str) -> Optional[str]:
    """The number after the last `####` of a GSM8K answer, commas and $ removed."""
    found = GSM8K_FINAL.findall(answer or "")
    if not found:
        return None
    value = found[-1].replace(",", "").replace("$", "").strip().rstrip(".").strip()
    return value or None


def last_boxed_content(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of `\\boxed 5`."""
    text = text or ""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    command = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    rest = rest[len(command):]
    if rest.startswith(" "):                       # \boxed 5
        value = rest.strip().split("$")[0].split()[0] if rest.strip() else ""
        return value or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                value = rest[1:i].strip()
                return value or None
    return None


# ------------------------------------------------------------------------------------------ sources

@dataclass
class Example:
    question: str
    answer: Optional[str]              # None: the record has no final answer to check against
    extra: Dict[str, object] = field(default_factory=dict)


def _text(record: dict, key: str, source: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        have = ", ".join(sorted(map(str, record))) or "none"
        raise ConvertError(f"{source}: expected a non-empty string under {key!r} (record keys: {have})")
    return value


def _extra(record: dict, source: str) -> dict:
    return {k: record[k] for k in EXTRA_FIELDS[source] if record.get(k) is not None}


def _gsm8k(record: dict) -> Example:
    return Example(_text(record, "question", "gsm8k").strip(), gsm8k_final_answer(_text(record, "answer", "gsm8k")))


def _math(record: dict) -> Example:
    question = _text(record, "problem", "math").strip()
    explicit = record.get("answer")
    if isinstance(explicit, (int, float)) and not isinstance(explicit, bool):
        explicit = str(explicit)
    if isinstance(explicit, str) and explicit.strip():
        return Example(question, explicit.strip(), _extra(record, "math"))
    return Example(question, last_boxed_content(_text(record, "solution", "math")), _extra(record, "math"))


def _turn(messages, role: str) -> Optional[str]:
    if isinstance(messages, list):
        for m in (reversed(messages) if role == "assistant" else messages):
            if isinstance(m, dict) and m.get("role") == role and isinstance(m.get("content"), str):
                return m["content"]
    return None


def _numina(record: dict) -> Example:
    question = record.get("problem")
    if not isinstance(question, str) or not question.strip():
        question = _turn(record.get("messages"), "user")
    if not question or not question.strip():
        raise ConvertError("numina: expected a non-empty 'problem' or a user turn in 'messages'")
    solution = record.get("solution")
    if not isinstance(solution, str) or not solution.strip():
        solution = _turn(record.get("messages"), "assistant")
    return Example(question.strip(), last_boxed_content(solution or ""), _extra(record, "numina"))


def _apps(record: dict) -> Example:
    """APPS / CodeContests / TACO as published: question, input_output (a JSON string: inputs, outputs, and fn_name
    for call-based problems). The answer is that JSON, the ground truth the `code` rule reads (verl's PRIME layout);
    a problem without tests has none."""
    raw = record.get("input_output")
    tests = json.loads(raw) if isinstance(raw, str) and raw.strip() else raw
    if not isinstance(tests, dict) or not tests.get("inputs") or "outputs" not in tests:
        return Example(_text(record, "question", "apps").strip(), None, _extra(record, "apps"))
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ConvertError(f"apps: input_output has {len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs")
    keep = {k: tests[k] for k in ("inputs", "outputs", "fn_name") if tests.get(k) is not None}
    return Example(_text(record, "question", "apps").strip(), json.dumps(keep), _extra(record, "apps"))


def _acecoder(record: dict) -> Example:
    """AceCoder-style: question, test_cases (a list of assert statements)."""
    cases = record.get("test_cases")
    if not isinstance(cases, list) or not all(isinstance(c, str) for c in cases):
        raise ConvertError("acecoder: expected a list of assert strings under 'test_cases'")
    answer = json.dumps({"test_cases": cases}) if cases else None
    return Example(_text(record, "question", "acecoder").strip(), answer, _extra(record, "acecoder"))


EXTRACTORS: Dict[str, Callable[[dict], Example]] = {"gsm8k": _gsm8k, "math": _math, "numina": _numina,
                                                    "apps": _apps, "acecoder": _acecoder}


def detect_source(record: dict) -> str:
    if not isinstance(record, dict):
        raise ConvertError(f"expected a JSON object, got {type(record).__name__}")
    if "question" in record and "input_output" in record:
        return "apps"
    if "question" in record and "test_cases" in record:
        return "acecoder"
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "problem" in record and ("messages" in record or "source" in record):
        return "numina"
    if "problem" in record and ("solution" in record or "answer" in record):
        return "math"
    have = ", ".join(sorted(map(str, record))) or "none"
    raise ConvertError(f"cannot tell the dataset format from the keys ({have}); expected question/answer "
                       f"(gsm8k), problem/solution (math) or problem/solution/messages (numina); "
                       f"or pass --format")


# ------------------------------------------------------------------------------------------ layouts

class PromptRenderer:
    """Chat messages -> the prompt string of the paddlenlp layout."""

    def __init__(self, template: str = "qwen2.5", tokenizer=None, think: bool = True):
        if tokenizer is None and template not in TEMPLATES:
            raise ConvertError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)} "
                               f"or give a tokenizer folder")
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            raise ConvertError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        self.template, self.tokenizer, self.think = template, tokenizer, think

    def __call__(self, messages: List[dict]) -> str:
        if self.tokenizer is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        elif self.template == "qwen2.5":
            text = render_qwen25(messages, add_generation_prompt=True)
        else:
            system = "".join(m["content"] + "\n" for m in messages if m["role"] == "system")
            user = "\n".join(m["content"] for m in messages if m["role"] != "system")
            text = f"{system}User: {user}\nAssistant: "
        return text + THINK_PREFIX if self.think else text


def load_tokenizer(folder: str):
    # models/ imports Paddle: only when a conversion needs the tokenizer (`paddle-rl data convert` runs without)
    from ..models.tokenizer import Tokenizer
    try:
        return Tokenizer.from_pretrained(folder)
    except FileNotFoundError as e:
        raise ConvertError(f"--tokenizer {folder}: {e}") from None


def to_layout(example: Example, layout: str, data_source: str, system: Optional[str],
              render: Optional[PromptRenderer], index: int, ability: str = "math") -> dict:
    messages = chat_messages(example.question, system)
    if layout == "paddlenlp":
        return {"src": render(messages), "tgt": example.answer, "data_source": data_source, **example.extra}
    if layout == "chat":
        return {"messages": messages, "solution": example.answer, "data_source": data_source, **example.extra}
    if layout == "verl":
        return {"data_source": data_source, "prompt": messages, "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": example.answer},
                "extra_info": {"index": index, "question": example.question, **example.extra}}
    raise ConvertError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


# ------------------------------------------------------------------------------------------ conversion

@dataclass
class ConvertResult:
    path: str
    written: int
    skipped: List[str]          # locations of records without a final answer
    source: str


def convert_records(records: Iterable[Tuple[str, dict]], source: str = "auto", layout: str = "paddlenlp",
                    render: Optional[PromptRenderer] = None, system: Optional[str] = None,
                    data_source: Optional[str] = None, strict: bool = False,
                    limit: int = -1) -> Tuple[List[dict], List[str], str]:
    """(location, record) pairs -> (converted records, locations skipped for lack of a final answer, source)."""
    if layout not in LAYOUTS:
        raise ConvertError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if source != "auto" and source not in SOURCES:
        raise ConvertError(f"unknown format {source!r}; choose auto or one of {', '.join(SOURCES)}")
    if layout == "paddlenlp" and render is None:
        render = PromptRenderer()
    out, skipped, resolved = [], [], None if source == "auto" else source
    for location, record in records:
        try:
            if resolved is None:
                resolved = detect_source(record)
            if not isinstance(record, dict):
                raise ConvertError(f"expected a JSON object, got {type(record).__name__}")
            example = EXTRACTORS[resolved](record)
        except ConvertError as e:
            raise ConvertError(f"{location}: {e}") from None
        if example.answer is None:
            if strict:
                marker = {"gsm8k": "no ####", "apps": "no tests", "acecoder": "no tests"}.get(resolved, "no \\boxed{}")
                raise ConvertError(f"{location}: no final answer found ({marker})")
            skipped.append(location)
            continue
        text = system_prompt(REWARD_TASK[resolved]) if system is None else system
        try:
            out.append(to_layout(example, layout, data_source or DATA_SOURCES[resolved], text, render, len(out),
                                 ABILITY.get(resolved, "math")))
        except Exception as e:  # noqa: BLE001 - e.g. a chat template that rejects the messages
            raise ConvertError(f"{location}: cannot render the prompt: {type(e).__name__}: {e}") from None
        if 0 < limit <= len(out):
            break
    return out, skipped, resolved or (source if source != "auto" else "")


def write_records(path: str, records: List[dict]) -> str:
    """jsonl (default), a JSON list (.json) or parquet (.parquet, needs pyarrow)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    if path.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ConvertError(f"{path}: writing parquet files needs the pyarrow package "
                               f"(pip install pyarrow)") from None
        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        if path.endswith(".json"):
            json.dump(records, f, ensure_ascii=False, indent=1)
            f.write("\n")
        else:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False))
                f.write("\n")
    return path


def convert_files(inputs: Sequence[str], out: str, source: str = "auto", layout: str = "paddlenlp",
                  template: str = "qwen2.5", tokenizer=None, system: Optional[str] = None, think: bool = True,
                  data_source: Optional[str] = None, strict: bool = False, limit: int = -1) -> ConvertResult:
    """Convert every input file (one format, detected from the first record when `source` is auto) into `out`."""
    if not inputs:
        raise ConvertError("no input files")
    for path in inputs:
        if os.path.abspath(path) == os.path.abspath(out):
            raise ConvertError(f"--out {out} is also an input")
    render = PromptRenderer(template, tokenizer, think) if layout == "paddlenlp" else None

    def records():
        for path in inputs:
            try:
                for location, _, record in iter_records(path):
                    yield location, record
            except DatasetError as e:
                raise ConvertError(str(e)) from None

    converted, skipped, resolved = convert_records(records(), source, layout, render, system, data_source,
                                                   strict, limit)
    if not converted:
        raise ConvertError(f"{', '.join(inputs)}: no record with a final answer ({len(skipped)} skipped)")
    write_records(out, converted)
    if skipped:
        shown = "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else "")
        logger.warning("skipped %d records without a final answer (%s)", len(skipped), shown)
    return ConvertResult(out, len(converted), skipped, resolved)


# ------------------------------------------------------------------------------------------ CLI

def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("inputs", nargs="+", help="local .jsonl / .json / .parquet files of one dataset")
    parser.add_argument("--out", required=True, help="output file (.jsonl, .json or .parquet)")
    parser.add_argument("--format", dest="source", choices=("auto",) + SOURCES, default="auto",
                        help="input dataset format (default: detected from the first record's keys)")
    parser.add_argument("--layout", choices=LAYOUTS, default="paddlenlp",
                        help="paddlenlp: src/tgt with a chat-templated src; chat: ms-swift messages/solution; "
                             "verl: prompt/reward_model.ground_truth (default paddlenlp)")
    parser.add_argument("--template", choices=TEMPLATES, default="qwen2.5",
                        help="chat template of src in the paddlenlp layout (default qwen2.5)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder whose chat template renders src (instead of --template)")
    parser.add_argument("--system", default=None,
                        help="system prompt (default: asks for <think> </think> <answer> </answer>; '' for none)")
    parser.add_argument("--no-think", dest="think", action="store_false",
                        help="do not open the assistant turn of src with <think>")
    parser.add_argument("--data-source", default=None,
                        help="data_source of every record (default gsm8k, math or numina_math)")
    parser.add_argument("--limit", type=int, default=-1, help="write at most this many records")
    parser.add_argument("--strict", action="store_true",
                        help="fail on a record without a final answer instead of skipping it")
    parser.set_defaults(func=run_convert)
    return parser


def add_convert_subparser(subparsers) -> argparse.ArgumentParser:
    """Register `convert` on the sub-parsers of `paddle-rl data`."""
    parser = subparsers.add_parser(
        "convert", help="convert local GSM8K / MATH / NuminaMath files to the trainer's layouts",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return configure_parser(parser)


def run_convert(args: argparse.Namespace) -> int:
    try:
        result = convert_files(args.inputs, args.out, args.source, args.layout, args.template, args.tokenizer,
                               args.system, args.think, args.data_source, args.strict, args.limit)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    note = f"; {len(result.skipped)} skipped without a final answer" if result.skipped else ""
    print(f"wrote {result.path} ({result.written} {result.source} records{note})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = configure_parser(argparse.ArgumentParser(prog="paddle-rl data convert"))
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

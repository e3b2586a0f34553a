"""What the model wrote: sampled completions of training steps (`log_completions`) and every response of a held-out
evaluation, as JSON lines and as a table on the report_to dashboards.

A record is one sample: its prompt and response text, the total reward and each reward function's score, whether
it was right (where the task says), its advantage (training only), its response length in tokens and its finish
reason (`stop`: a stop token ended it; `length`: it reached the token limit). Training samples go to
`<output_dir>/completions.jsonl` (one line per sample, with its step); each evaluation's to
`<output_dir>/eval_completions/step-N.jsonl`.
"""
import json
import math
import os
from typing import List, Optional

COMPLETIONS_FILE = "completions.jsonl"
EVAL_COMPLETIONS_DIR = "eval_completions"
# the table's columns, in order; "rewards" expands to one column per reward function
TABLE_FIELDS = ("prompt", "response", "reward", "rewards", "advantage", "response_length", "finish_reason")


def eval_completions_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, EVAL_COMPLETIONS_DIR, f"step-{step}.jsonl")


def _plain(value):
    """JSON-safe: a non-finite float as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def write_records(path: str, records: List[dict], append: bool = False) -> None:
    """`records` as JSON lines in `path` (appended or replacing it), on disk when it returns."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(_plain(record), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_steps_after(path: str, step: int) -> None:
    """Drop the records of steps after `step` (an interrupted run being resumed)."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def table(records: List[dict]) -> tuple:
    """(column names, rows of cell strings) of `records`: TABLE_FIELDS with one `reward/<function>` column per
    reward function."""
    functions = list(dict.fromkeys(name for r in records for name in r.get("rewards", {})))
    columns, rows = [], []
    for name in TABLE_FIELDS:
        columns += [f"reward/{f}" for f in functions] if name == "rewards" else [name]
    for r in records:
        row = []
        for name in TABLE_FIELDS:
            if name == "rewards":
                row += [_cell(r.get("rewards", {}).get(f)) for f in functions]
            else:
                row.append(_cell(r.get(name)))
        rows.append(row)
    return columns, rows


def markdown(columns: List[str], rows: List[List[str]]) -> str:
    """A Markdown table (TensorBoard's text plugin draws it as a table): HTML's special characters as entities
    (a chat template's <|im_start|> shows as written), `|` escaped, line breaks as <br>."""
    def cell(text: str) -> str:
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plain(columns: List[str], rows: List[List[str]]) -> str:
    """The table as plain text (VisualDL's text tab shows text as written): one block of `column: value` lines per
    sample, blocks apart by a blank line."""
    return "\n\n".join("\n".join(f"{c}: {v}" for c, v in zip(columns, row)) for row in rows)


def one_line(record: dict, width: int = 160) -> str:
    """A record on one short line for the terminal: the prompt's end -> the response's start, reward (and whether it
    was right), finish reason."""
    def short(text: str, n: int, tail: bool = False) -> str:
        text = " ".join(str(text).split())
        if len(text) <= n:
            return text
        return "..." + text[-(n - 3):] if tail else text[:n - 3] + "..."

    verdict = "" if record.get("correct") is None else (", correct" if record["correct"] else ", wrong")
    prompt = short(record.get("prompt", ""), width // 2, tail=True)  # a prompt's question is at its end
    return (f"{prompt!r} -> {short(record.get('response', ''), width // 2)!r} "
            f"(reward {_cell(record.get('reward'))}{verdict}, {record.get('finish_reason')})")


def pick(count: Optional[int], size: int) -> int:
    """How many of `size` samples a step logs (`num_completions_to_print`; None: all)."""
    return size if count is None else min(count, size)

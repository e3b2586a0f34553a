"""`paddle-rl score CONFIG --responses FILE.jsonl [key=value ...]`: the configured rewards on records that already
carry a response, one JSON line per sample; the tool for "every reward comes out 0".

Each line of FILE is a training record (any format the trainer reads: PaddleNLP src / tgt, ms-swift messages,
verl prompt / reward_model) plus `response` (the model's text) and optionally `truncated` (true when it hit
max_dec_len). The rewards are the config's (`reward_funcs`, `reward_weights`, `reward_routes`, `reward_plugins`, or
the reward server with `use_rm_server`). Printed per sample:

    {"line": "FILE:N", "score": 1.0, "correct": true, "functions": {"math": 1.0, "format": 0.0},
     "weights": {"math": 1.0, "format": 0.5}, "data_source": "", "reason": null}

`outcomes` counts what a function reports per sample (the code rule: its test runs by outcome, e.g.
{"code/pass": 2, "code/timeout": 1}). `functions` holds each function's unweighted score (null where it does not apply to the sample: routed elsewhere by
data_source, or it returned None); `reason` says why a sample has no score or a function no value (the error a
function raised on this sample, or which functions did not apply). A summary goes to stderr.
"""
import json
import math
import sys

from .config import load_config
from .data.loader import DatasetError, iter_records
from .data.records import ChatForm, RecordError, reward_record, to_prompt_record
from .env import configure_threads
from .errors import setup_error_types
from .rewards import RewardError, RewardSample, RewardServerError, build_reward


def load_scoring_records(path: str, config, tokenizer):
    """(location, RewardSample) per line of `path`: the prompt as the trainer renders it, the record's response."""
    chat = ChatForm(tokenizer, config.apply_chat_template, config.system_prompt)
    out = []
    for location, _, raw in iter_records(path):
        try:
            item = to_prompt_record(raw, config.prompt_key, config.response_key, chat, require_ground_truth=False)
        except RecordError as e:
            raise DatasetError(f"{location}: {e}") from None
        response = raw.get("response")
        if not isinstance(response, str):
            raise DatasetError(f"{location}: no `response` string to score (record keys: "
                               f"{', '.join(sorted(map(str, raw)))})")
        length = len(tokenizer.encode(response)) if tokenizer is not None else len(response.split())
        out.append((location, RewardSample(item["prompt"], response, reward_record(item), length,
                                           bool(raw.get("truncated", False)))))
    if not out:
        raise DatasetError(f"{path}: no records")
    return out


def _number(value):
    value = float(value)
    return None if math.isnan(value) else value


def score_samples(reward_fn, samples):
    """(RewardResult or None, {index: reason}): the batch at once; when a function raises, each sample alone, so
    the error lands on the samples it belongs to."""
    try:
        return reward_fn(samples), {}
    except (RewardError, RewardServerError):
        pass
    results, reasons = [], {}
    for i, sample in enumerate(samples):
        try:
            results.append(reward_fn([sample]))
        except (RewardError, RewardServerError) as e:
            results.append(None)
            reasons[i] = str(e)
    return results, reasons


def report_lines(reward_fn, located):
    """One dict per sample (see the module doc)."""
    samples = [s for _, s in located]
    result, reasons = score_samples(reward_fn, samples)
    per_sample = result if isinstance(result, list) else [None] * len(samples)
    weights = dict(zip(getattr(reward_fn, "names", []), getattr(reward_fn, "weights", [])))
    names = list(getattr(reward_fn, "functions", {}))  # every function a sample may be routed to
    lines = []
    for i, (location, sample) in enumerate(located):
        one, j = (result, i) if not isinstance(result, list) else (per_sample[i], 0)
        line = {"line": location, "score": None, "correct": None, "functions": {}, "weights": weights,
                "data_source": sample.data_source or "", "reason": reasons.get(i)}
        if one is not None:
            skipped = one.skipped is not None and bool(one.skipped[j])
            line["score"] = None if skipped else _number(one.scores[j])
            line["correct"] = None if one.correct is None else bool(one.correct[j])
            line["functions"] = {name: None for name in names}
            line["functions"].update({name: _number(values[j]) for name, values in one.per_function.items()})
            line["outcomes"] = {k: float(v[j]) for k, v in one.outcomes.items() if v[j]}  # e.g. code/timeout
            idle = [name for name, value in line["functions"].items() if value is None]
            if skipped:
                line["reason"] = "the reward server skipped it (reward_server_on_failure: skip)"
            elif idle:
                line["reason"] = (f"not applied: {', '.join(idle)} (routed elsewhere by data_source "
                                  f"{sample.data_source!r}, or the function returned None)")
        lines.append(line)
    return lines


def _run(args) -> int:
    configure_threads()
    # deferred: algorithms/ and rollout/ load Paddle (after configure_threads); their pieces and environments declare
    # keys of the config
    from . import algorithms, rollout  # noqa: F401
    try:
        config = load_config(args.config, args.overrides)
        tokenizer = _tokenizer(config)
        located = load_scoring_records(args.responses, config, tokenizer)
        reward_fn = build_reward(config)
    except setup_error_types() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = report_lines(reward_fn, located)
    for line in lines:
        print(json.dumps(line, sort_keys=True))
    scored = [ln["score"] for ln in lines if ln["score"] is not None]
    print(f"{len(lines)} samples, {len(scored)} scored, mean score "
          f"{sum(scored) / len(scored) if scored else float('nan'):.4g}, "
          f"{sum(ln['reason'] is not None for ln in lines)} with a reason", file=sys.stderr)
    return 0


def _tokenizer(config):
    """The config's tokenizer when its folder exists (chat prompts need its template; lengths its tokens)."""
    import os

    # deferred: models/ loads Paddle, only when the config names a tokenizer
    from .models import Tokenizer
    folder = config.tokenizer_name_or_path or config.actor_model_name_or_path
    if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return Tokenizer.from_pretrained(folder)
    return None


def add_score_subparser(subparsers) -> None:
    p = subparsers.add_parser("score", help="score records that carry a response with the configured rewards",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="YAML argument file (its reward keys are used)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. reward_funcs=[math]")
    p.add_argument("--responses", required=True, help="jsonl: records with a `response` field")
    p.set_defaults(func=_run, takes_overrides=True)

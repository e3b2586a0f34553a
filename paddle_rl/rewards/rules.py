"""Registry of in-process rule rewards.

A rule is registered under a name with a factory `make(config) -> fn(samples) -> (scores [B] float32, correct
[B] bool or None)`. A NaN score means "does not apply to this sample". Rules that need no configuration are
registered with `register_rule(name)` around `fn(samples)` directly.

A rule with settings declares each config key it reads where it registers, `register_rule(name, needs_config=True,
options=(option(key, type, default, help, check=...), ...))` (config/options.py): the key joins `PIECE_OPTIONS` with
the rule as its reader, so the loader reads, coerces, checks and dumps it, and the factory reads `config.<key>`.
Importing paddle_rl.rewards registers the built-in rules, so a command imports it before it reads a config (the
reward server's command line and workers, the trainer, `paddle-rl score` do). Plugin functions (reward_plugins)
declare no keys.

A rule reports a problem with one sample by raising `SampleError(index, message)`; the caller turns it into
an error naming the reward function and the sample's index in the batch.
"""
import json
import math
import re
import string
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..config.fields import at_least
from ..config.options import PIECE_OPTIONS, Option, option
from .base import RewardSample
from .kk import ANSWER, CORRECT_SCORE, kk_score, reasoning_score, scored_text


class SampleError(ValueError):
    """A reward function could not score one sample (index local to the list it was given)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index
        self.message = message


@dataclass
class Rule:
    name: str
    make: Callable            # make(config) -> fn(samples) -> (scores, correct or None)
    doc: str = ""
    # trait: the rule decides correctness on its own, score_one(response, ground_truth) -> 1.0 when correct
    # (what `cosine_accuracy` may name); None for rules that score something else (format, length, ...)
    correctness: Optional[Callable] = None
    keys: Tuple[Option, ...] = ()      # the config keys the rule's factory reads (declared where it registers)
    fn: Optional[Callable] = None      # the registered function (the factory, with needs_config)


RULE_REWARDS: Dict[str, Rule] = {}
READER = "reward rule"    # how PIECE_OPTIONS names a rule reading a key: ("reward rule", name)


def register_rule(name: str, needs_config: bool = False, aliases: tuple = (), correctness: Callable = None,
                  options: Tuple = ()):
    """Decorator. Without `needs_config` it wraps `fn(samples)`; with it, a factory `make(config) -> fn`.
    `correctness`: the trait of a rule that judges a response right or wrong, as score_one(response, truth).
    `options`: the config keys the factory reads, each an `Option` (config.options.option) or the key of one
    declared before; they join the config's keys (PIECE_OPTIONS) with this rule as reader."""
    keys = PIECE_OPTIONS.resolve(options, (READER, name))
    if keys and not needs_config:
        raise TypeError(f"{READER} {name!r}: options are read by a factory (needs_config=True)")

    def wrap(fn):
        make = fn if needs_config else (lambda config, _fn=fn: _fn)
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        PIECE_OPTIONS.declare_all(keys, (READER, name))   # registered again: the new declaration replaces the old
        for key in (name,) + tuple(aliases):
            RULE_REWARDS[key] = Rule(key, make, doc, correctness, keys, fn)
        return fn
    return wrap


def remove_rule(name: str) -> None:
    """Unregister `name` and its aliases; the keys no other piece reads leave the config with it."""
    make = RULE_REWARDS[name].make
    for key in [k for k, rule in RULE_REWARDS.items() if rule is not None and rule.make is make]:
        del RULE_REWARDS[key]
        PIECE_OPTIONS.withdraw((READER, key))


def rule_option_errors(config) -> List[str]:
    """The declared checks of the keys the registered rules read (the loader runs them with every declared
    check; a reader of a config's reward keys alone, as the reward server, runs these)."""
    keys = {o.key: o for rule in RULE_REWARDS.values() if rule is not None for o in rule.keys}
    return [line for declared in keys.values() for line in declared.errors(config)]


def correctness_rules() -> List[str]:
    """The registered rules with the correctness trait (the choices of cosine_accuracy)."""
    return [name for name, rule in RULE_REWARDS.items() if rule.correctness is not None]


def _each(samples: List[RewardSample], score_one: Callable) -> np.ndarray:
    """[B] float32 of score_one(index, sample); any exception becomes a SampleError naming the index."""
    out = np.empty(len(samples), dtype=np.float32)
    for i, sample in enumerate(samples):
        try:
            out[i] = score_one(i, sample)
        except SampleError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with the sample index
            raise SampleError(i, f"{type(e).__name__}: {e}") from e
    return out


# ----------------------------------------------------------------------------------------------- text helpers

SPECIAL_TAIL = re.compile(r"(?:\s|<\|[A-Za-z0-9_.:\- ]{1,64}\|>|<｜[^｜<>]{1,64}｜>|</s>|<eos>|<pad>|<eot>)+\Z")


def strip_special_tail(text: str) -> str:
    """Drop trailing special tokens (<|im_end|>, <|endoftext|>, </s>, ...) and whitespace."""
    return SPECIAL_TAIL.sub("", text)


def completion_text(response: str) -> str:
    """The assistant turn as the rules see it: the kk rule's view, outer whitespace and trailing special tokens
    removed."""
    return strip_special_tail(scored_text(response)).lstrip()


def _ground_truth(sample: RewardSample, index: int) -> str:
    truth = sample.ground_truth
    if truth is None:
        raise SampleError(index, "no ground truth (record has none of ground_truth, tgt, solution, "
                                 "reward_model.ground_truth)")
    return str(truth)


def _length(sample: RewardSample, index: int, rule: str) -> int:
    length = int(sample.response_length or 0)
    if length <= 0 and sample.response:
        raise SampleError(index, f"{rule} needs response_length (tokens); none was given for a non-empty response")
    return length


# ----------------------------------------------------------------------------------------------- kk

def kk_label(truth) -> str:
    """The KK label as text ("(1) Name is a knight\\n..."): a string; a one-item list of one (PaddleNLP's tgt); the
    `solution_text_format` of a mapping (Logic-RL's verl files). Any other list or mapping is refused: its printed
    form would score every answer wrong."""
    if isinstance(truth, str) and truth.lstrip().startswith("{"):  # a mapping sent as JSON text (reward server)
        try:
            truth = json.loads(truth)
        except ValueError:
            pass
    if isinstance(truth, dict) and isinstance(truth.get("solution_text_format"), str):
        return truth["solution_text_format"]
    if isinstance(truth, list) and len(truth) == 1 and isinstance(truth[0], str):
        return truth[0]
    if isinstance(truth, (list, dict)):
        raise ValueError(f"the kk rule reads its label as text, one \"(k) Name is a knight|knave\" line per person "
                         f"(or a mapping with solution_text_format), got a {type(truth).__name__}: {truth!r:.120}")
    return str(truth)


def kk_correct(response: str, truth) -> float:
    return 1.0 if kk_score(response, kk_label(truth)) >= CORRECT_SCORE else 0.0


def _kk_truth(sample: RewardSample, index: int) -> str:
    _ground_truth(sample, index)  # none at all: named as for every rule
    try:
        return kk_label(sample.ground_truth)
    except ValueError as e:
        raise SampleError(index, str(e)) from None


@register_rule("kk", correctness=kk_correct)
def kk_rule(samples: List[RewardSample]):
    """Knights and Knaves: format +1/-1 plus answer +2/-1.5/-2 (3, -0.5, -1, -3)."""
    scores = _each(samples, lambda i, s: kk_score(s.response, _kk_truth(s, i), s.prompt))
    return scores, scores >= CORRECT_SCORE


@register_rule("kk_reasoning")
def kk_reasoning_rule(samples: List[RewardSample]):
    """Knights and Knaves: the share of the <think> case split that holds against the puzzle in the prompt, up to
    its first wrong step, with its conclusion equal to the answer counted as one more step (0..1)."""
    return _each(samples, lambda i, s: reasoning_score(s.response, s.prompt)), None


# ----------------------------------------------------------------------------------------------- format

FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def format_score(response: str) -> float:
    return 1.0 if FORMAT.fullmatch(completion_text(response)) else 0.0


@register_rule("format")
def format_rule(samples: List[RewardSample]):
    """1 if the completion is <think>...</think> <answer>...</answer> (after the kk prefix rule), else 0."""
    return _each(samples, lambda i, s: format_score(s.response)), None


@register_rule("distinct_chars")
def distinct_chars_rule(samples: List[RewardSample]):
    """The share of distinct characters in the response (0 for an empty one): defined on any text and varying
    between samples, a reward for benchmarks and smoke tests, not for learning anything useful."""
    return _each(samples, lambda i, s: len(set(s.response)) / max(1, len(s.response))), None


# ----------------------------------------------------------------------------------------------- env

@register_rule("env")
def env_rule(samples: List[RewardSample]):
    """A multi-turn episode's reward from its environment (env_plugin; summed over its steps), 0 without one."""
    return np.array([float(s.record.get("env_reward") or 0.0) for s in samples], dtype=np.float32), None


# ----------------------------------------------------------------------------------------------- gsm8k

GSM8K_STRICT = re.compile(r"####\s*(-?[$0-9.,]*[0-9][$0-9.,]*)")
GSM8K_FLEX = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def _numbers_equal(a: str, b: str) -> bool:
    a, b = _clean_number(a), _clean_number(b)
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k_answer(text: str, flexible: bool = False) -> Optional[str]:
    """The strict answer (last `#### <number>`) or, flexibly, the last number in the text."""
    found = (GSM8K_FLEX if flexible else GSM8K_STRICT).findall(text)
    return _clean_number(found[-1]) if found else None


def gsm8k_solution(truth: str) -> str:
    """A gsm8k ground truth: the number after the last `####` when the full solution text is given."""
    if "####" in truth:
        answer = gsm8k_answer(truth)
        if answer is not None:
            return answer
    return _clean_number(truth)


def gsm8k_score(response: str, ground_truth, flexible: bool = False) -> float:
    answer = gsm8k_answer(strip_special_tail(response), flexible)
    if answer is None:
        return 0.0
    return 1.0 if _numbers_equal(answer, gsm8k_solution(str(ground_truth))) else 0.0


def _gsm8k(samples, flexible):
    scores = _each(samples, lambda i, s: gsm8k_score(s.response, _ground_truth(s, i), flexible))
    return scores, scores >= 1.0


@register_rule("gsm8k", correctness=lambda response, truth: gsm8k_score(response, truth, False))
def gsm8k_rule(samples: List[RewardSample]):
    """1 if the last `#### <number>` (commas, $ removed) equals the solution, else 0."""
    return _gsm8k(samples, flexible=False)


@register_rule("gsm8k_flexible", correctness=lambda response, truth: gsm8k_score(response, truth, True))
def gsm8k_flexible_rule(samples: List[RewardSample]):
    """1 if the last number in the response equals the solution, else 0."""
    return _gsm8k(samples, flexible=True)


# ----------------------------------------------------------------------------------------------- math

LATEX_MARKERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")
PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}\b")


def last_boxed(text: str) -> Optional[str]:
    """The last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, including the command."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start:j + 1]
    return None


def math_answer(response: str) -> Optional[str]:
    """The text inside the last <answer>...</answer> if present, else the last \\boxed{...}."""
    text = strip_special_tail(response)
    answers = ANSWER.findall(text)
    if answers:
        return answers[-1].strip()
    return last_boxed(text)


def _math_parse(text: str, timeouts: bool):
    from math_verify import parse
    kwargs = {} if timeouts else {"parsing_timeout": None}
    text = text.strip()
    if not text:
        return []
    if not any(m in text for m in LATEX_MARKERS) and not PROSE.search(text):
        parsed = parse(f"${text}$", **kwargs)
        if parsed:
            return parsed
    return parse(text, **kwargs)


PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_score(response: str, ground_truth) -> float:
    """1.0 if the answer is equivalent to the ground truth under math-verify, else 0.0. Two plain decimal
    numbers are compared exactly without math-verify (same verdict, ~100x faster)."""
    answer = math_answer(response)
    truth = str(ground_truth).strip()
    if answer is not None and PLAIN_NUMBER.fullmatch(answer) and PLAIN_NUMBER.fullmatch(truth):
        return 1.0 if Decimal(answer) == Decimal(truth) else 0.0
    from math_verify import verify
    # math-verify's own timeouts use SIGALRM, which only the main thread may set
    timeouts = threading.current_thread() is threading.main_thread()
    gold = _math_parse(str(ground_truth), timeouts)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {str(ground_truth)[:200]!r}")
    if answer is None:
        return 0.0
    predicted = _math_parse(answer, timeouts)
    if not predicted:
        return 0.0
    kwargs = {} if timeouts else {"timeout_seconds": None}
    return 1.0 if verify(gold, predicted, **kwargs) else 0.0


@register_rule("math", aliases=("accuracy",), correctness=math_score)
def math_rule(samples: List[RewardSample]):
    """1 if the <answer> (else last \\boxed{}) is equivalent to the solution under math-verify, else 0."""
    scores = _each(samples, lambda i, s: math_score(s.response, _ground_truth(s, i)))
    return scores, scores >= 1.0


# ------------------------------------------------------------------------------------------- qa, trivia, classification
# Short-answer rules. Each reads the prediction from the last <answer>...</answer> when there is one, and reads its
# ground truth as records carry it: a string, a list of strings (any one may match), for qa and trivia also a
# mapping (below); a list or mapping sent as JSON text (the reward server's PaddleNLP protocol) is read back. Any
# other ground truth is refused for that sample, naming the rule: its printed form would score every answer wrong.

QA_PUNCTUATION = frozenset(string.punctuation)                                   # SQuAD / verl qa_em: removed
TRIVIA_PUNCTUATION = frozenset(string.punctuation + "\u2018\u2019\u00b4`")      # TriviaQA: each becomes a space
ARTICLES = re.compile(r"\b(a|an|the)\b")
QA_KEYS = ("target",)                                                            # verl's Search-R1 records
TRIVIA_KEYS = ("normalized_aliases", "aliases", "normalized_value", "value",     # HF trivia_qa's `answer`
               "NormalizedAliases", "Aliases", "NormalizedValue", "Value", "HumanAnswers", "target")


def qa_normalize(text: str) -> str:
    """verl's qa_em / SQuAD normalize_answer: lower case, ASCII punctuation removed, the words a / an / the
    removed, whitespace collapsed to single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in QA_PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def trivia_normalize(text: str) -> str:
    """TriviaQA's official normalize_answer: `_` to a space, lower case, ASCII punctuation and ‘ ’ ´ ` each to a
    space (not removed: "Jay-Z" is "jay z"), the words a / an / the removed, whitespace collapsed."""
    text = "".join(" " if ch in TRIVIA_PUNCTUATION else ch for ch in text.replace("_", " ").lower())
    return " ".join(ARTICLES.sub(" ", text).split())


def short_answer(response: str) -> str:
    """The prediction of qa, trivia: the text inside the last <answer>...</answer>, else the whole response
    (trailing special tokens removed), stripped."""
    text = strip_special_tail(response)
    answers = ANSWER.findall(text)
    return (answers[-1] if answers else text).strip()


def _json_text(truth, mapping: bool):
    """A list (or, with `mapping`, a mapping) that arrived as JSON text; anything else as it is."""
    if isinstance(truth, str) and truth.lstrip()[:1] in (("[", "{") if mapping else ("[",)):
        try:
            decoded = json.loads(truth)
        except ValueError:
            return truth
        if isinstance(decoded, list) or (mapping and isinstance(decoded, dict)):
            return decoded
    return truth


def _answer_texts(truth, rule: str, keys: Tuple[str, ...]) -> List[str]:
    """The acceptable answers of a ground truth: a string, a list of strings, or (when `keys`) a mapping whose
    `keys` hold a string or a list of strings each."""
    truth = _json_text(truth, bool(keys))
    what = "a string or a list of strings" + (f", or a mapping with {' / '.join(keys)}" if keys else "")
    if isinstance(truth, str):
        return [truth]
    if isinstance(truth, (list, tuple)):
        bad = [t for t in truth if not isinstance(t, str)]
        if bad or not truth:
            raise ValueError(f"the {rule} rule reads its ground truth as {what}, got a list "
                             + (f"holding a {type(bad[0]).__name__}: {bad[0]!r:.80}" if bad else "with nothing in it"))
        return list(truth)
    if isinstance(truth, dict) and keys:
        found = []
        for key in keys:
            value = truth.get(key)
            if value is None:
                continue
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"the {rule} rule reads the ground truth's {key!r} as a string or a list of strings, "
                                 f"got {value!r:.120}")
            found += list(value)
        if not found:
            raise ValueError(f"the {rule} rule found none of {', '.join(keys)} in the ground truth mapping "
                             f"(keys: {', '.join(map(str, truth)) or 'none'})")
        return found
    raise ValueError(f"the {rule} rule reads its ground truth as {what}, got a {type(truth).__name__}: {truth!r:.120}")


def _normalized_answers(truth, rule: str, keys: Tuple[str, ...], normalize: Callable) -> set:
    answers = {normalize(t) for t in _answer_texts(truth, rule, keys)} - {""}
    if not answers:
        raise ValueError(f"the {rule} rule's ground truth has no answer left after normalization: {truth!r:.120}")
    return answers


def qa_score(response: str, ground_truth) -> float:
    """1.0 if the normalized prediction equals a normalized golden answer (verl's qa_em exact match), else 0.0."""
    answers = _normalized_answers(ground_truth, "qa", QA_KEYS, qa_normalize)
    return 1.0 if qa_normalize(short_answer(response)) in answers else 0.0


def trivia_score(response: str, ground_truth) -> float:
    """1.0 if the TriviaQA-normalized prediction equals one of the normalized aliases (TriviaQA's exact match, the
    best over all its ground truths), else 0.0."""
    answers = _normalized_answers(ground_truth, "trivia", TRIVIA_KEYS, trivia_normalize)
    return 1.0 if trivia_normalize(short_answer(response)) in answers else 0.0


def predicted_label(response: str) -> str:
    """The classification rule's prediction: the last <answer>...</answer>, else the last non-empty line."""
    text = strip_special_tail(response)
    answers = ANSWER.findall(text)
    if answers:
        return answers[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def label_normalize(text: str) -> str:
    """A label as the classification rule compares it: stripped and case-folded."""
    return text.strip().casefold()


def classification_score(response: str, ground_truth) -> float:
    """1.0 if the predicted label equals an acceptable label, both stripped and case-folded, else 0.0."""
    labels = {label_normalize(t) for t in _answer_texts(ground_truth, "classification", ())} - {""}
    if not labels:
        raise ValueError(f"the classification rule's ground truth has no label: {ground_truth!r:.120}")
    return 1.0 if label_normalize(predicted_label(response)) in labels else 0.0


def _text_rule(samples: List[RewardSample], score: Callable):
    def one(i, s):
        _ground_truth(s, i)  # none at all: named as for every rule
        try:
            return score(s.response, s.ground_truth)
        except ValueError as e:
            raise SampleError(i, str(e)) from None
    scores = _each(samples, one)
    return scores, scores >= 1.0


@register_rule("qa", correctness=qa_score)
def qa_rule(samples: List[RewardSample]):
    """1 if the <answer> (else the whole response), normalized as verl's qa_em, equals a golden answer, else 0."""
    return _text_rule(samples, qa_score)


@register_rule("trivia", correctness=trivia_score)
def trivia_rule(samples: List[RewardSample]):
    """1 if the <answer> (else the whole response), normalized as TriviaQA's evaluation, equals an alias, else 0."""
    return _text_rule(samples, trivia_score)


@register_rule("classification", correctness=classification_score)
def classification_rule(samples: List[RewardSample]):
    """1 if the <answer> (else the last non-empty line), stripped and case-folded, equals a label, else 0."""
    return _text_rule(samples, classification_score)


# ----------------------------------------------------------------------------------------------- cosine

def cosine_value(length: int, max_len: int, value_at_zero: float, value_at_max: float) -> float:
    """b - (b - a) * (1 - cos(pi * t / T)) / 2 with b the value at t=0 and a the value at t=T; t clamped to T."""
    t = min(max(length, 0), max_len)
    return value_at_zero - (value_at_zero - value_at_max) * (1.0 - math.cos(math.pi * t / max_len)) / 2.0


def _cosine_max_len_check(key, value, config):
    return None if value == -1 or value > 0 else f"{key}: must be > 0 or -1, got {value}"


COSINE_OPTIONS = (
    option("cosine_max_len", int, -1, "Length T of the cosine reward (-1: max_dec_len).",
           check=_cosine_max_len_check),
    option("cosine_min_len_value_correct", float, 1.0, "Cosine reward of a correct answer at length 0."),
    option("cosine_max_len_value_correct", float, 0.5, "Cosine reward of a correct answer at length T."),
    option("cosine_min_len_value_wrong", float, -0.5, "Cosine reward of a wrong answer at length 0."),
    option("cosine_max_len_value_wrong", float, 0.0, "Cosine reward of a wrong answer at length T."))


# cosine_accuracy stays a key of config/reward_args.py: its choices are the rules with the correctness trait,
# checked against the registry by check.py
@register_rule("cosine", needs_config=True, options=COSINE_OPTIONS)
def cosine_rule(config):
    """Length-aware correctness: correct 1.0 -> 0.5, wrong -0.5 -> 0.0 as the length goes 0 -> max."""
    max_len = config.cosine_max_len if config.cosine_max_len > 0 else config.max_dec_len
    correct_fn = RULE_REWARDS[config.cosine_accuracy].correctness  # checked by reward_config_errors
    c0, c1 = config.cosine_min_len_value_correct, config.cosine_max_len_value_correct
    w0, w1 = config.cosine_min_len_value_wrong, config.cosine_max_len_value_wrong

    def fn(samples):
        correct = np.zeros(len(samples), dtype=bool)

        def one(i, s):
            length = _length(s, i, "cosine")
            correct[i] = correct_fn(s.response, _ground_truth(s, i)) >= 1.0
            return cosine_value(length, max_len, c0, c1) if correct[i] else cosine_value(length, max_len, w0, w1)
        return _each(samples, one), correct
    return fn


# ----------------------------------------------------------------------------------------------- repetition

def repetition_penalty(text: str, n: int = 3, max_penalty: float = 1.0) -> float:
    """-(1 - unique n-grams / total n-grams) * |max_penalty| over lower-cased words; 0 below n words."""
    words = text.lower().split()
    if len(words) < n:
        return 0.0
    grams = list(zip(*[words[i:] for i in range(n)]))
    return -(1.0 - len(set(grams)) / len(grams)) * abs(max_penalty)


@register_rule("repetition", needs_config=True, options=(
        option("repetition_n_grams", int, 3, "n of the repetition reward's word n-grams.", check=at_least(1)),
        option("repetition_max_penalty", float, 1.0, "Magnitude of the repetition penalty (its sign is ignored).")))
def repetition_rule(config):
    """Repeated word n-grams: -(1 - unique/total) * repetition_max_penalty."""
    n, max_penalty = config.repetition_n_grams, config.repetition_max_penalty

    def fn(samples):
        return _each(samples, lambda i, s: repetition_penalty(strip_special_tail(s.response), n, max_penalty)), None
    return fn


# ----------------------------------------------------------------------------------------------- soft overlong

@register_rule("soft_overlong", needs_config=True)
def soft_overlong_rule(config):
    """DAPO soft overlong penalty from max_dec_len, overlong_reward_buffer, overlong_penalty_factor."""
    # The penalty's one implementation is paddle_rl.algorithms.dapo.soft_overlong_penalty, which the objective
    # applies under enable_overlong_reward_buffer (check_reward_config refuses both at once). Imported here, when
    # the rule is built, so rewards that do not use it (and reward-server workers) do not import Paddle.
    # algorithms/ imports Paddle: only when the overlong penalty is configured (reward-server workers run without)
    from ..algorithms.dapo import soft_overlong_penalty
    max_len, buffer, factor = config.max_dec_len, config.overlong_reward_buffer, config.overlong_penalty_factor

    def fn(samples):
        lengths = np.array([_length(s, i, "soft_overlong") for i, s in enumerate(samples)], dtype=np.int64)
        return np.asarray(soft_overlong_penalty(lengths, max_len, buffer, factor), dtype=np.float32), None
    return fn

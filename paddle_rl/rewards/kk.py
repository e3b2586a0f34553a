"""Knights-and-Knaves rule reward (Logic-RL / PaddleNLP rules).

format +1 / -1; answer +2 all roles right, -1.5 parsed but wrong, -2 unparseable or bad format.

`reasoning_score`: the share of a case split's sentences (the wording of paddle_rl.data.kk.reasoning) that hold
when replayed against the puzzle in the prompt, read in order up to the first that does not.
"""
import re
from itertools import product
from typing import Dict, List, Optional, Tuple

from ..data.kk.english import read_numbered_puzzle
from ..data.kk.logic import evaluate

ASSISTANT_TAG = "<|im_start|>assistant"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
ROLE_WORD = re.compile(r"\b(knight|knave)\b", re.IGNORECASE)
TRUTH_LINE = re.compile(r"\(\d+\)\s*(.+?)\s+is\s+a\s+(knight|knave)", re.IGNORECASE)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

CORRECT_SCORE = 3.0


def scored_text(response: str, prompt: Optional[str] = None) -> str:
    """The text the rules see: the assistant turn, opened with <think> as the prompt did.

    PaddleNLP's rule: a continuation is assumed to follow "...assistant\n<think>". Only a prompt that ends
    with the bare assistant header (a chat template that leaves <think> to the model) makes the response
    count as it is.
    """
    if ASSISTANT_TAG in response:
        return response.rsplit(ASSISTANT_TAG, 1)[1]
    if prompt and prompt.rstrip().endswith(ASSISTANT_TAG):
        return response
    return "<think>" + response


def format_ok(text: str) -> bool:
    positions = []
    for tag in TAGS:
        if text.count(tag) != 1:
            return False
        positions.append(text.find(tag))
    return positions == sorted(positions)


def parse_ground_truth(tgt: str) -> Dict[str, str]:
    roles = {}
    for line in tgt.strip().splitlines():
        m = TRUTH_LINE.search(line)
        if m:
            roles[m.group(1).strip()] = m.group(2).lower()
    if not roles:
        raise ValueError(f"cannot parse KK ground truth: {tgt!r}")
    return roles


def parse_prediction(answer: str, names: List[str]) -> Optional[Dict[str, str]]:
    if len(ROLE_WORD.findall(answer)) != len(names):
        return None
    predicted = {}
    for name in names:
        m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+(knight|knave)\b", answer, re.IGNORECASE)
        if not m:
            return None
        predicted[name] = m.group(1).lower()
    return predicted


def kk_score_parts(response: str, ground_truth: str, prompt: Optional[str] = None) -> Tuple[float, float]:
    """(format score, answer score)."""
    text = scored_text(response, prompt)
    truth = parse_ground_truth(ground_truth)
    if not format_ok(text):
        return -1.0, -2.0
    answers = ANSWER.findall(text)
    if not answers:
        return 1.0, -2.0
    predicted = parse_prediction(answers[-1], list(truth))
    if predicted is None:
        return 1.0, -2.0
    return 1.0, (2.0 if predicted == truth else -1.5)


def kk_score(response: str, ground_truth: str, prompt: Optional[str] = None) -> float:
    fmt, ans = kk_score_parts(response, ground_truth, prompt)
    return fmt + ans


# ------------------------------------------------------------------------------------ the reasoning's steps

STEP = re.compile(r"(Suppose|So) ([A-Z][a-z]+) is a (knight|knave)\.|([A-Z][a-z]+)'s claim is (true|false)"
                  r"(?:, so (.*?)|: (fits|contradiction))\.(?= |$)")
FORCED = re.compile(r"([A-Z][a-z]+) is a (knight|knave)")
THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def _worlds(known: Dict[int, bool], n: int):
    """Every full assignment (tuple of bools) that extends the partial one `known`."""
    rest = [p for p in range(n) if p not in known]
    for values in product((True, False), repeat=len(rest)):
        full = {**known, **dict(zip(rest, values))}
        yield tuple(full[p] for p in range(n))


def _replay(think: str, names: List[str], statements) -> Tuple[int, int, Optional[Dict[int, bool]]]:
    """(sentences that hold, in order up to the first that does not; sentences; the roles known at the end when
    every sentence holds, else None). A supposition names an undecided person; after a contradiction the next
    sentence must be "So" with the opposite of the innermost supposition; "X's claim is V, so ..." holds when V is
    X's claim's truth in every extension of what is known (or X's known role) and the roles it names follow in
    every such extension where X's role agrees with V; "fits" / "contradiction" name a decided claim that agrees
    (or not) with its known speaker."""
    index, n = {name: k for k, name in enumerate(names)}, len(names)
    sentences = []
    pos, text = 0, think.strip()
    while pos < len(text):
        m = STEP.match(text, pos)
        if not m:
            sentences.append(None)  # unreadable: it and all after it fail
            break
        sentences.append(m)
        pos = m.end() + 1
    frames: List[Tuple[Dict[int, bool], Optional[Tuple[int, bool]]]] = [({}, None)]  # (known, supposition)
    refuted = None
    for held, m in enumerate(sentences):
        if m is None:
            return held, len(sentences), None
        known = frames[-1][0]
        if m.group(1):
            person, knight = index.get(m.group(2)), m.group(3) == "knight"
            if person is None:
                return held, len(sentences), None
            if refuted is not None:
                if m.group(1) != "So" or refuted != (person, not knight):
                    return held, len(sentences), None
                refuted = None
                known[person] = knight
            elif m.group(1) != "Suppose" or person in known:
                return held, len(sentences), None
            else:
                frames.append(({**known, person: knight}, (person, knight)))
            continue
        speaker, value = index.get(m.group(4)), m.group(5) == "true"
        if speaker is None or refuted is not None:
            return held, len(sentences), None
        truths = {evaluate(statements[speaker], w) for w in _worlds(known, n)}
        if m.group(7):  # fits / contradiction: a decided claim beside a known speaker
            if speaker not in known or truths != {value} or (value == known[speaker]) != (m.group(7) == "fits"):
                return held, len(sentences), None
            if m.group(7) == "contradiction":
                if len(frames) == 1:
                    return held, len(sentences), None
                refuted = frames.pop()[1]
            continue
        forced = {}
        for name, role in FORCED.findall(m.group(6)):
            if name not in index:
                return held, len(sentences), None
            forced[index[name]] = role == "knight"
        if speaker in known:
            if value != known[speaker]:
                return held, len(sentences), None
        elif truths != {value} or forced.get(speaker) != value:
            return held, len(sentences), None
        if any(p in known and p != speaker for p in forced):
            return held, len(sentences), None
        fits = [w for w in _worlds(known, n) if evaluate(statements[speaker], w) == value and w[speaker] == value]
        if not fits or any(w[p] != r for w in fits for p, r in forced.items()):
            return held, len(sentences), None
        known.update(forced)
    if refuted is not None:
        return len(sentences), len(sentences), None
    return len(sentences), len(sentences), frames[-1][0]


def reasoning_score(response: str, prompt: str) -> float:
    """How far the <think> block's case split holds against the puzzle read from `prompt` (numbered speakers, the
    tiny KK wording), in [0, 1]: the sentences that hold in order up to the first that does not, plus one for the
    conclusion (the roles known at the end decide every person, every claim fits them, and the <answer> states
    exactly them), over the sentences plus one. 0 for a prompt that is no such puzzle or a response without a
    <think> block. It reads the puzzle's statements and the response only, never the ground truth."""
    text = scored_text(response, prompt)
    think = THINK.search(text)
    try:
        names, statements = read_numbered_puzzle(prompt or "")
    except ValueError:
        return 0.0
    if not think:
        return 0.0
    held, total, final = _replay(think.group(1), names, statements)
    concluded = 0
    if final is not None and len(final) == len(names):
        roles = tuple(final[p] for p in range(len(names)))
        answers = ANSWER.findall(text)
        predicted = parse_prediction(answers[-1], names) if answers else None
        concluded = int(all(evaluate(s, roles) == roles[k] for k, s in enumerate(statements))
                        and predicted == {name: ("knight" if r else "knave") for name, r in zip(names, roles)})
    return (held + concluded) / (total + 1)

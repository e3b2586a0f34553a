"""Knights-and-Knaves rule reward (Logic-RL / PaddleNLP rules).

format +1 / -1; answer +2 all roles right, -1.5 parsed but wrong, -2 unparseable or bad format.
"""
import re
from typing import Dict, List, Optional, Tuple

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

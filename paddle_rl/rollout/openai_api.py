"""OpenAI-compatible requests and answers over a RolloutEngine, shared by the rollout server
(rollout_server/app.py: /v1/completions, /v1/chat/completions) and the agent proxy (rollout/agents.py, the
recording endpoint that agent programs talk to): the request's fields checked (an error names the field), its
sampling parameters, its prompt token ids (text, token ids, or chat messages rendered by the model's own chat
template), and the choices of an answer from the engine's tokens and log-probs (stop strings cut, OpenAI's
log-probs shapes, the `token_ids` extension). No web framework here: each front end maps RequestError to its
HTTP answer, {"error": {"message", "type", "code"}} with the status.
"""
import os
from typing import List, Optional

from .keys import sample_key
from .sampling import SamplingParams
from .wire import check_params


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code}}


UNSUPPORTED = {"stream": False, "echo": False, "suffix": None, "best_of": None, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None, "functions": None,
               "response_format": None}
IGNORED = {"model", "user", "metadata", "store", "stream_options", "service_tier", "parallel_tool_calls"}
COMPLETION_FIELDS = {"prompt", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "seed", "top_k",
                     "repetition_penalty", "min_tokens"}
CHAT_FIELDS = {"messages", "n", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "logprobs",
               "top_logprobs", "seed", "top_k", "repetition_penalty", "min_tokens"}


def number(body: dict, key: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise RequestError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise RequestError(f"{key}: {value} is out of range")
    return kind(value)


def check_fields(body: dict, known: set) -> None:
    for key, neutral in UNSUPPORTED.items():
        if key in body and body[key] not in (neutral, None, [], {}):
            raise RequestError(f"{key}: not supported by this server (got {body[key]!r})")
    unknown = sorted(set(body) - known - set(UNSUPPORTED) - IGNORED)
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}")


def stop_strings(body: dict) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop: expected a string or a list of non-empty strings, got {body.get('stop')!r}")
    return stop


def cut_at_stop(tokenizer, ids: List[int], stops: List[str]):
    """(text, tokens kept, stopped): the decoded text before the first stop string (OpenAI leaves the stop string
    out), and how many tokens it takes to reach the end of that stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, len(ids), False
    at, stop = min(hits)
    end = at + len(stop)
    lo, hi = 1, len(ids)   # the fewest tokens whose text reaches the stop string's end
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return text[:at], lo, True


def sampling_from_openai(body: dict, tokenizer, stop_ids, default_max_tokens: int, chat: bool):
    """(SamplingParams, n, stop strings, seed) of an OpenAI request; `stop_ids` are the engine's own stop tokens."""
    n = number(body, "n", 1, int, low=1, high=1024)
    temperature = number(body, "temperature", 1.0, low=0.0, high=100.0)
    top_p = number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(body, max_key, default_max_tokens, int, low=1)
    stops = stop_strings(body)
    # a stop string that is one token stops the engine there; longer ones cut the text afterwards
    stop_ids = set(stop_ids)
    for s in stops:
        ids = tokenizer.encode(s)
        if len(ids) == 1:
            stop_ids.add(ids[0])
    params = SamplingParams(max_dec_len=max_tokens, min_dec_len=number(body, "min_tokens", 0, int, low=0),
                            temperature=temperature, top_p=top_p, top_k=number(body, "top_k", 0, int, low=0),
                            repetition_penalty=number(body, "repetition_penalty", 1.0, low=0.0, low_open=True),
                            stop_token_ids=sorted(stop_ids))
    problems = check_params(params)
    if problems:
        raise RequestError("; ".join(problems))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed: expected an integer, got {seed!r}")
    return params, n, stops, seed


def openai_keys(seed: Optional[int], prompts: int, n: int, greedy: bool):
    if greedy:
        return None
    seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
    return [sample_key(seed, 0, f"openai:{p}", j) for p in range(prompts) for j in range(n)]


def completion_prompts(tokenizer, prompt) -> List[List[int]]:
    """OpenAI's prompt: a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError("prompt: expected a string, a list of strings, a list of token ids or a list of lists of "
                       "token ids (none empty)")


def text_content(content, index: int):
    """A message's content: a string, or OpenAI's list of parts of which only text parts are taken (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        kinds = sorted({str(p.get("type")) for p in content} - {"text"})
        if kinds:
            raise RequestError(f"messages[{index}].content: parts of type {', '.join(kinds)} are not supported "
                               "(text only)")
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"messages[{index}].content: expected a string or a list of text parts")


def chat_messages(body: dict) -> List[dict]:
    """The request's messages, each content as text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise RequestError("messages: expected a non-empty list of {role, content} objects")
    return [dict(m, content=text_content(m["content"], i)) for i, m in enumerate(messages)]


def chat_logprobs(body: dict) -> bool:
    if body.get("top_logprobs"):
        raise RequestError(f"top_logprobs: {body['top_logprobs']} alternatives per token are not computed "
                           "(logprobs: true returns each sampled token's log-prob)")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs: expected true or false, got {logprobs!r}")
    return logprobs


def completion_logprobs(body: dict) -> bool:
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) and not (isinstance(logprobs, int) and not isinstance(logprobs, bool)):
        raise RequestError(f"logprobs: expected an integer, got {logprobs!r}")
    if logprobs:
        raise RequestError(f"logprobs: {logprobs} alternatives per token are not computed; logprobs: 0 returns "
                           "each sampled token's log-prob")
    return logprobs is not None


def render_chat(tokenizer, messages: List[dict]) -> str:
    """The conversation in the model's own chat template, with the assistant's generation prompt."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception, a missing field)
        raise RequestError(f"messages: the chat template failed: {e}") from None


def check_tokens(prompts, vocab: int) -> None:
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError(f"prompts[{i}]: empty")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompts[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab})")


def choice(tokenizer, index: int, ids: List[int], logp: List[float], truncated: bool, stops: List[str],
           logprobs: bool, chat: bool) -> dict:
    """One choice of an answer from a sample's generated `ids` and their log-probs: the text before the first stop
    string, `token_ids` (the tokens kept: up to the one completing a stop string) and OpenAI's log-probs shape."""
    text, kept, stopped = cut_at_stop(tokenizer, ids, stops)
    ids, logp = list(ids[:kept]), [float(v) for v in logp[:kept]]
    reason = "stop" if stopped or not truncated else "length"
    out = {"index": index, "finish_reason": reason, "token_ids": ids}
    pieces = [tokenizer.decode([t]) for t in ids]
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        out["logprobs"] = {"content": [{"token": p, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                                       for p, v in zip(pieces, logp)]} if logprobs else None
    else:
        out["text"] = text
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        out["logprobs"] = {"tokens": pieces, "token_logprobs": logp, "top_logprobs": None,
                           "text_offset": offsets} if logprobs else None
    return out


def choices_of(tokenizer, batch, stops: List[str], logprobs: bool, chat: bool, prompts):
    """(choices, usage) of an engine's StepBatch (row r: choice r)."""
    choices = []
    for r in range(batch.size):
        k = int(batch["lengths"][r])
        choices.append(choice(tokenizer, r, batch["response_ids"][r, :k].tolist(), batch["rollout_logp"][r, :k],
                              bool(batch["truncated"][r]), stops, logprobs, chat))
    return choices, usage(prompts, choices)


def usage(prompts, choices) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

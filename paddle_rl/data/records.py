"""Dataset records of the formats users bring -> one prompt record.

Accepted per record:
  PaddleNLP  `prompt_key` (default src): a prompt string (already chat-templated), a list of turns
             (alternating user / assistant strings) or a list of {role, content} messages;
             `response_key` (default tgt): the label.
  ms-swift   `messages` (a trailing assistant turn is the answer and is left out of the prompt),
             `solution`, and any extra fields (they reach the rewards through the record).
  verl       `prompt` (chat list), `data_source`, `reward_model.ground_truth`, `extra_info`.
The ground truth is looked up under `response_key`, `solution`, `ground_truth`, then
`reward_model.ground_truth`.
"""
import json
from typing import Callable, Optional

ROLES = ("system", "user", "assistant", "tool")
MISSING = object()


class RecordError(ValueError):
    pass


def _type(value) -> str:
    return "null" if value is None else type(value).__name__


def _turns_to_messages(turns: list) -> list:
    """PaddleNLP list form: alternating user / assistant strings, ending with a user turn."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def _check_messages(messages, key: str) -> list:
    if not isinstance(messages, list):
        raise RecordError(f"{key!r} must be a list of {{role, content}} messages, got {_type(messages)}")
    if not messages:
        raise RecordError(f"{key!r} is an empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError(f"{key}[{i}] must be a {{role, content}} object, got {_type(m)}")
        if m.get("role") not in ROLES:
            raise RecordError(f"{key}[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise RecordError(f"{key}[{i}].content must be a string, got {_type(m.get('content'))}")
    return messages


def _prompt_messages(messages, key: str) -> list:
    messages = _check_messages(messages, key)
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages or all(m["role"] == "system" for m in messages):
        raise RecordError(f"{key!r} has no user turn")
    return messages


def _prompt_value(value, key: str):
    """-> (prompt string or None, messages or None)."""
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f"{key!r} is an empty prompt")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return None, _turns_to_messages(value)
    if isinstance(value, list):
        return None, _prompt_messages(value, key)
    raise RecordError(f"{key!r} must be a string, a list of turns or a list of messages, got {_type(value)}")


def _ground_truth(raw: dict, response_key: str):
    for key in dict.fromkeys((response_key, "solution", "ground_truth")):
        if raw.get(key) is not None:
            return key, raw[key]
    nested = raw.get("reward_model")
    if nested is not None:
        if not isinstance(nested, dict):
            raise RecordError(f"'reward_model' must be an object with 'ground_truth', got {_type(nested)}")
        if nested.get("ground_truth") is not None:
            return "reward_model.ground_truth", nested["ground_truth"]
    return None, MISSING


def _check_truth(key: str, truth):
    """Scalars become strings; lists and mappings (verl multi-answer labels) are kept as they are."""
    if isinstance(truth, str):
        if not truth.strip():
            raise RecordError(f"{key!r} is an empty ground truth")
        return truth
    if isinstance(truth, (bool, int, float)):
        return str(truth)
    if isinstance(truth, (list, dict)):
        if not truth:
            raise RecordError(f"{key!r} is an empty ground truth")
        return truth
    raise RecordError(f"{key!r} must be a string or a number, got {_type(truth)}")


def to_prompt_record(raw: dict, prompt_key: str, response_key: str,
                     render_chat: Optional[Callable[[list], str]], require_ground_truth: bool = True) -> dict:
    """{'prompt': str (as the model sees it), 'ground_truth': str | list | dict | None, 'data_source': str,
    'record': raw}. Raises RecordError naming the key when the record has no usable prompt or ground truth."""
    if not isinstance(raw, dict):
        raise RecordError(f"expected a JSON object, got {_type(raw)}")
    if prompt_key != "messages" and prompt_key in raw:
        prompt, messages = _prompt_value(raw[prompt_key], prompt_key)
    elif "messages" in raw:
        prompt, messages = None, _prompt_messages(raw["messages"], "messages")
    elif "prompt" in raw:
        prompt, messages = _prompt_value(raw["prompt"], "prompt")
    else:
        keys = ", ".join(sorted(map(str, raw))) or "none"
        raise RecordError(f"no prompt: expected key {prompt_key!r}, 'messages' or 'prompt' (record keys: {keys})")
    if messages is not None:
        if render_chat is None:
            raise RecordError("chat-form prompt but the tokenizer has no chat_template")
        tools = record_tools(raw)
        prompt = render_chat(messages, tools) if tools else render_chat(messages)
    key, truth = _ground_truth(raw, response_key)
    if truth is MISSING:
        if require_ground_truth:
            raise RecordError(f"no ground truth: expected key {response_key!r}, 'solution', 'ground_truth' "
                              f"or 'reward_model.ground_truth'")
        truth = None
    else:
        truth = _check_truth(key, truth)
    source = raw.get("data_source")
    return {"prompt": prompt, "ground_truth": truth,
            "data_source": "" if source is None else str(source), "record": raw}


def record_tools(raw: dict) -> Optional[list]:
    """The tool schemas a record offers the model (rendered by the chat template's `tools`): ms-swift's `tools`
    (a list of function schemas, or that list as a JSON string), or verl's `extra_info.tools`."""
    for key, value in (("tools", raw.get("tools")),
                       ("extra_info.tools", (raw.get("extra_info") or {}).get("tools")
                        if isinstance(raw.get("extra_info"), dict) else None)):
        if value is None:
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RecordError(f"{key!r} is not valid JSON: {e}") from None
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise RecordError(f"{key!r} must be a list of tool schemas (objects), got {_type(value)}")
        return value
    return None


def sft_conversation(raw: dict, prompt_key: str) -> Optional[list]:
    """The messages of a multi-turn supervised record (ms-swift `messages`, or a messages-form `prompt_key`, with
    more than one assistant turn and ending in one), whose every assistant turn is learned and every other turn
    (user, tool) is context; None for a record with one answer."""
    for key in dict.fromkeys((prompt_key, "messages", "prompt")):
        messages = raw.get(key)
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant":
            messages = _check_messages(messages, key)
            return messages if sum(m["role"] == "assistant" for m in messages) > 1 else None
    return None


def sft_response(raw: dict, prompt_key: str, response_key: str) -> str:
    """The supervised target of a record: the trailing assistant turn of its messages (ms-swift `messages`, or a
    messages-form `prompt_key`), else its `response_key` (PaddleNLP `tgt`) or `response` string."""
    for key in dict.fromkeys((prompt_key, "messages", "prompt")):
        messages = raw.get(key)
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant":
            content = messages[-1].get("content")
            if not isinstance(content, str):
                raise RecordError(f"{key}[-1].content must be a string, got {_type(content)}")
            return content
    for key in dict.fromkeys((response_key, "response")):
        if isinstance(raw.get(key), str) and raw[key]:
            return raw[key]
    raise RecordError(f"no response to learn: expected a trailing assistant turn in 'messages', or a string under "
                      f"{response_key!r} or 'response' (record keys: {', '.join(sorted(map(str, raw))) or 'none'})")


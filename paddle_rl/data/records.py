"""Dataset records of the formats users bring -> one prompt record.

Accepted per line: PaddleNLP (`prompt_key` string or list of turns, `response_key` label),
ms-swift (`messages` + `solution` + extra fields), verl (`prompt` chat list, `data_source`,
`reward_model.ground_truth`, `extra_info`).
"""
from typing import Callable, Optional


class RecordError(ValueError):
    pass


def _turns_to_messages(turns: list) -> list:
    """PaddleNLP list form: alternating user / assistant strings, ending with a user turn."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": str(t)} for i, t in enumerate(turns)]


def _prompt_messages(messages: list) -> list:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RecordError("messages must be a list of {role, content} objects")
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise RecordError("messages has no prompt turn")
    return messages


def to_prompt_record(raw: dict, prompt_key: str, response_key: str,
                     render_chat: Optional[Callable[[list], str]]) -> dict:
    """{'prompt': str (as the model sees it), 'ground_truth': str|None, 'data_source': str, 'record': raw}."""
    if not isinstance(raw, dict):
        raise RecordError(f"expected a JSON object, got {type(raw).__name__}")
    messages = None
    if prompt_key in raw and prompt_key != "messages":
        value = raw[prompt_key]
        if isinstance(value, str):
            prompt = value
        elif isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            messages = _turns_to_messages(value)
        elif isinstance(value, list):
            messages = _prompt_messages(value)
        else:
            raise RecordError(f"{prompt_key!r} must be a string or a list of turns")
    elif "messages" in raw:
        messages = _prompt_messages(raw["messages"])
    elif isinstance(raw.get("prompt"), list):
        messages = _prompt_messages(raw["prompt"])
    else:
        raise RecordError(f"no prompt: expected key {prompt_key!r}, 'messages' or 'prompt'")
    if messages is not None:
        if render_chat is None:
            raise RecordError("chat-form prompt but the tokenizer has no chat_template")
        prompt = render_chat(messages)
    truth = raw.get(response_key)
    if truth is None:
        truth = raw.get("solution")
    if truth is None and isinstance(raw.get("reward_model"), dict):
        truth = raw["reward_model"].get("ground_truth")
    return {"prompt": prompt, "ground_truth": None if truth is None else str(truth),
            "data_source": str(raw.get("data_source", "")), "record": raw}

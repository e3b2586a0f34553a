"""Dataset records of the formats users bring -> one prompt record, through one templating rule.

Accepted per record:
  PaddleNLP  `prompt_key` (default src) and `response_key` (default tgt), each a string or a list of strings,
             as PaddleNLP's RL reader takes them: one src item is the prompt in its final form; several are a
             conversation ending in the prompt: src[i] / tgt[i] rounds when tgt has as many items (the last tgt the
             label), else alternating user / assistant turns (an odd count) with tgt the label. A one-item tgt list
             is that item. (src may also be a list of {role, content} messages.)
  ms-swift   `messages` (a trailing assistant turn is the answer and is left out of the prompt),
             `solution`, and any extra fields (they reach the rewards through the record).
  verl       `prompt` (a string or a chat list), `data_source`, `reward_model.ground_truth`, `extra_info`.
The ground truth is looked up under `response_key`, `solution`, `ground_truth`, then
`reward_model.ground_truth`.

The templating rule (`ChatForm`, set by `apply_chat_template`: auto | true | false), the same for every reader:
a prompt already in the tokenizer's chat form (it holds one of the template's own turn markers, e.g.
<|im_start|>) is used as it is; a plain question goes through the chat template as a user turn when the tokenizer
has one; messages go through the template. `true` templates every prompt and refuses one already in chat form
(it would be templated twice); `false` never templates (PaddleNLP's reader: turns joined as written, each
assistant turn followed by the eos token) and refuses messages. A prompt in another model's chat form (a turn
marker of a known format that is not the tokenizer's) is refused unless `false`. Each item records how its
prompt was made (`prompt_form`: as_is, templated, joined).
"""
import json
from typing import Optional, Sequence

ROLES = ("system", "user", "assistant", "tool")
MISSING = object()
APPLY_CHAT_TEMPLATE = ("auto", "true", "false")

# Turn markers of widely used chat formats (ChatML / Qwen / SmolLM, Gemma, Llama 3, DeepSeek, Phi / Zephyr):
# a prompt holding one of them but none of the tokenizer's own was templated for another model.
KNOWN_TURN_MARKERS = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<|begin_of_text|>",
                      "<\uff5cUser\uff5c>", "<|user|>")
_PROBE = "PROMPT-CONTENT-PROBE"

# prompt_form values
AS_IS, TEMPLATED, JOINED = "as_is", "templated", "joined"


class RecordError(ValueError):
    pass


def _type(value) -> str:
    return "null" if value is None else type(value).__name__


def _special_tokens(tokenizer) -> list:
    """The contents of the tokenizer's special added tokens (tokenizer.json's added_tokens, special: true)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    decoder = (getattr(tokenizer, "config", None) or {}).get("added_tokens_decoder") or {}
    return [t["content"] for t in decoder.values() if isinstance(t, dict) and t.get("special")]


def turn_markers(tokenizer) -> tuple:
    """The chat template's own turn markers: the special tokens its rendering of one user turn holds outside the
    turn's text (for a template without special tokens, the text it writes before the turn's content)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that needs more than one user turn: no markers known
        return ()
    if _PROBE not in text:
        return ()
    outside = text.replace(_PROBE, "\n")
    markers = tuple(t for t in _special_tokens(tokenizer) if t and t in outside)
    if markers:
        return markers
    before = text.split(_PROBE, 1)[0].strip()
    return (before,) if len(before) >= 2 else ()


class ChatForm:
    """How a record's prompt becomes the text the model sees: the tokenizer's chat template and turn markers, the
    `apply_chat_template` mode, and the eos token PaddleNLP puts after an assistant turn it joins."""

    def __init__(self, tokenizer=None, mode: str = "auto", system: str = ""):
        mode = str(mode).lower()
        if mode not in APPLY_CHAT_TEMPLATE:
            raise ValueError(f"apply_chat_template: must be auto, true or false, got {mode!r}")
        self.mode, self.tokenizer, self.system = mode, tokenizer, system or ""
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.markers = turn_markers(tokenizer) if self.has_template else ()
        self.eos = getattr(tokenizer, "eos_token", None) or ""

    def render(self, messages: list, tools: Optional[list] = None) -> str:
        """The template's rendering with the generation prompt; `system_prompt` as the first turn where the messages
        have no system turn of their own."""
        if self.system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}] + list(messages)
        if tools:  # a record's tool schemas, rendered by the template (Qwen2.5: a system block of them)
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def own_marker(self, text: str) -> Optional[str]:
        return next((m for m in self.markers if m in text), None)

    def foreign_marker(self, text: str) -> Optional[str]:
        """A known turn marker of another chat format (only asked of a text that holds none of the tokenizer's)."""
        if not self.has_template:
            return None
        return next((m for m in KNOWN_TURN_MARKERS if m in text and m not in self.markers), None)

    def _twice(self, where: str, marker: str) -> RecordError:
        return RecordError(f"{where} is already in the tokenizer's chat form (it holds {marker!r}): "
                           f"apply_chat_template: true would template it twice; use auto (or false) to take it as "
                           f"it is")

    def _check_foreign(self, where: str, text: str) -> None:
        foreign = self.foreign_marker(text)
        if foreign and self.mode != "false":
            raise RecordError(f"{where} holds {foreign!r}, a turn marker of another chat format than this "
                              f"tokenizer's ({', '.join(map(repr, self.markers))}): it was templated for another "
                              f"model; template the data for this one, or set apply_chat_template: false to send "
                              f"it as it is")

    def _templating(self, where: str) -> bool:
        """Whether plain text / turns are templated: auto with a template, or true (which needs one)."""
        if self.mode == "false":
            return False
        if not self.has_template:
            if self.mode == "true":
                raise RecordError(f"{where}: apply_chat_template: true but the tokenizer has no chat_template")
            return False
        return True

    def _untemplated(self, where: str, prompt: str, form: str):
        """A prompt used or joined as written: a system_prompt cannot go into it."""
        if self.system:
            raise RecordError(f"{where} is used as written (already in chat form, or apply_chat_template: false), "
                              "so system_prompt cannot be added to it; template the data without a system turn, "
                              "or leave system_prompt out")
        return prompt, form

    def text_prompt(self, text: str, where: str):
        """(prompt, form) of a prompt string."""
        own = self.own_marker(text)
        if own:
            if self.mode == "true":
                raise self._twice(where, own)
            return self._untemplated(where, text, AS_IS)
        self._check_foreign(where, text)
        if not self._templating(where):
            return self._untemplated(where, text, AS_IS)
        return self.render([{"role": "user", "content": text}]), TEMPLATED

    def turns_prompt(self, turns: Sequence[str], where: str):
        """(prompt, form) of PaddleNLP turns (user, assistant, ..., user): templated as messages when plain and
        templating; else joined as PaddleNLP joins them (each assistant turn followed by the eos token)."""
        if len(turns) == 1:
            return self.text_prompt(turns[0], f"{where}[0]")
        owns = [(i, m) for i, m in ((i, self.own_marker(t)) for i, t in enumerate(turns)) if m]
        if owns and self.mode == "true":
            raise self._twice(f"{where}[{owns[0][0]}]", owns[0][1])
        if not owns:
            for i, t in enumerate(turns):
                self._check_foreign(f"{where}[{i}]", t)
        if owns or not self._templating(where):
            return self._untemplated(where, "".join(t if i % 2 == 0 else t + self.eos for i, t in enumerate(turns)),
                                     JOINED)
        roles = ("user", "assistant")
        return self.render([{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]), TEMPLATED

    def messages_prompt(self, messages: list, where: str, tools: Optional[list] = None):
        """(prompt, form) of {role, content} messages. One message whose content is already in chat form (verl
        files of templated prompts) is that content; such content among several messages is refused."""
        owns = [(i, m) for i, m in ((i, self.own_marker(x["content"])) for i, x in enumerate(messages)) if m]
        if owns:
            i, marker = owns[0]
            if len(messages) == 1 and self.mode != "true" and not tools:
                return self._untemplated(f"{where}[0].content", messages[0]["content"], AS_IS)
            raise RecordError(f"{where}[{i}].content is already in the tokenizer's chat form (it holds {marker!r}): "
                              f"templating the messages would template it twice; give the templated text as a "
                              f"string prompt, or each turn's own text as messages")
        for i, m in enumerate(messages):
            self._check_foreign(f"{where}[{i}].content", m["content"])
        if self.mode == "false":
            raise RecordError(f"{where!r} is a list of messages, which needs the chat template, and "
                              f"apply_chat_template is false")
        if not self.has_template:
            raise RecordError("chat-form prompt but the tokenizer has no chat_template")
        return self.render(messages, tools), TEMPLATED


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


def _is_text_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, str) for t in value)


def paddlenlp_turns(src: list, tgt, key: str, response_key: str):
    """(turns, label) of a PaddleNLP src list: src[i] / tgt[i] rounds when tgt is a list as long (n >= 2; the
    label tgt[-1]), else src as alternating user / assistant turns ending in the user's (the label read from
    `response_key` as usual: MISSING here)."""
    if len(src) >= 2 and _is_text_list(tgt) and len(tgt) == len(src):
        turns = []
        for s, t in zip(src[:-1], tgt[:-1]):
            turns += [s, t]
        return turns + [src[-1]], tgt[-1]
    if len(src) % 2 == 0:
        shown = f"has {len(tgt)} items" if isinstance(tgt, list) else f"is a {_type(tgt)}"
        raise RecordError(f"{key!r} has {len(src)} items and {response_key!r} {shown}: PaddleNLP reads a list as "
                          f"src[i] / {response_key}[i] rounds (as many items in both, the last {response_key} the "
                          f"label) or as user / assistant turns ending in the user's (an odd count)")
    return list(src), MISSING


def _prompt(raw: dict, prompt_key: str, response_key: str, chat: ChatForm):
    """(prompt, form, label from a PaddleNLP rounds record or MISSING)."""
    if prompt_key != "messages" and prompt_key in raw:
        key = prompt_key
    elif "messages" in raw:
        key = "messages"
    elif "prompt" in raw:
        key = "prompt"
    else:
        keys = ", ".join(sorted(map(str, raw))) or "none"
        raise RecordError(f"no prompt: expected key {prompt_key!r}, 'messages' or 'prompt' (record keys: {keys})")
    value = raw[key]
    if key == "messages":
        return (*chat.messages_prompt(_prompt_messages(value, key), key, record_tools(raw)), MISSING)
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f"{key!r} is an empty prompt")
        return (*chat.text_prompt(value, repr(key)), MISSING)
    if _is_text_list(value):
        if not all(t.strip() for t in value):
            raise RecordError(f"{key!r} holds an empty turn")
        turns, label = paddlenlp_turns(value, raw.get(response_key), key, response_key)
        return (*chat.turns_prompt(turns, key), label)
    if isinstance(value, list):
        messages = _prompt_messages(value, key)
        return (*chat.messages_prompt(messages, key, record_tools(raw)), MISSING)
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


def _check_truth(key: str, truth, response_key: str):
    """Scalars become strings; PaddleNLP's one-item tgt list its item; other lists and mappings (verl multi-answer
    labels) are kept as they are."""
    if key == response_key and isinstance(truth, list) and all(isinstance(t, str) for t in truth):
        if len(truth) != 1:
            raise RecordError(f"{key!r} has {len(truth)} items for one prompt: PaddleNLP pairs src[i] with "
                              f"{key}[i] (a src list as long), or reads a one-item list as its label")
        truth = truth[0]
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


def to_prompt_record(raw: dict, prompt_key: str, response_key: str, chat: ChatForm,
                     require_ground_truth: bool = True) -> dict:
    """{'prompt': str (as the model sees it), 'prompt_form': as_is | templated | joined, 'ground_truth': str | list
    | dict | None, 'data_source': str, 'record': raw}. Raises RecordError naming the key when the record has no
    usable prompt or ground truth, or would be templated twice."""
    if not isinstance(raw, dict):
        raise RecordError(f"expected a JSON object, got {_type(raw)}")
    prompt, form, label = _prompt(raw, prompt_key, response_key, chat)
    if label is not MISSING:
        key, truth = response_key, label
    else:
        key, truth = _ground_truth(raw, response_key)
    if truth is MISSING:
        if require_ground_truth:
            raise RecordError(f"no ground truth: expected key {response_key!r}, 'solution', 'ground_truth' "
                              f"or 'reward_model.ground_truth'")
        truth = None
    else:
        truth = _check_truth(key, truth, response_key)
    source = raw.get("data_source")
    return {"prompt": prompt, "prompt_form": form, "ground_truth": truth,
            "data_source": "" if source is None else str(source), "record": raw}


def reward_record(item: dict) -> dict:
    """The record the rewards read for a dataset item: its raw record, with the label as the rules read it
    (`ground_truth`: a PaddleNLP tgt list's item, the last of src / tgt rounds) and its data_source."""
    record = dict(item["record"]) if isinstance(item["record"], dict) else {}
    if item.get("ground_truth") is not None:
        record.setdefault("ground_truth", item["ground_truth"])
    if item.get("data_source"):
        record.setdefault("data_source", item["data_source"])
    return record


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


def sft_conversation(raw: dict, prompt_key: str, response_key: str = "tgt") -> Optional[list]:
    """The messages of a multi-turn supervised record (ms-swift `messages`, or a messages-form `prompt_key`, with
    more than one assistant turn and ending in one; or PaddleNLP src[i] / tgt[i] rounds, n >= 2), whose every
    assistant turn is learned and every other turn (user, tool) is context; None for a record with one answer."""
    src, tgt = raw.get(prompt_key), raw.get(response_key)
    if _is_text_list(src) and len(src) >= 2 and _is_text_list(tgt) and len(tgt) == len(src):
        return [{"role": role, "content": text} for s, t in zip(src, tgt)
                for role, text in (("user", s), ("assistant", t))]
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
        value = raw.get(key)
        if _is_text_list(value):  # PaddleNLP: a one-item tgt list, or src[i] / tgt[i] rounds (the last one)
            value = value[-1] if len(value) == 1 or (_is_text_list(raw.get(prompt_key))
                                                     and len(raw[prompt_key]) == len(value)) else None
        if isinstance(value, str) and value:
            return value
    raise RecordError(f"no response to learn: expected a trailing assistant turn in 'messages', or a string under "
                      f"{response_key!r} or 'response' (record keys: {', '.join(sorted(map(str, raw))) or 'none'})")


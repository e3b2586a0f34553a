"""The tiny tool default as an agent program (configs/tiny_tool_agent_grpo.yaml, `env_plugin: agent`): what the
built-in tool environment does, written as an ordinary client of an OpenAI-compatible chat endpoint.

It reads the task from stdin ({"prompt", "record", "uid", "sample"}), asks $OPENAI_BASE_URL for the assistant's
turn, runs the calculator on each Hermes `<tool_call>{"name": "calculator", "arguments": {"expression": ...}}
</tool_call>` of that turn, sends the results back as a `tool` message, and stops at a turn without a call (the
answer). Its last line reports the tool calls for the metrics; the reward is the config's `math` rule on the
recorded conversation. Runs with any OpenAI-compatible server: `requests` only, no paddle-rl import.
"""
import ast
import json
import operator
import os
import re
import sys

import requests

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)
MAX_TURNS = 3
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Numbers, + - * / // % and parentheses (an AST walk, no eval)."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    if len(expression) > 500:
        raise ValueError("expression too long")
    result = value(ast.parse(str(expression), mode="eval"))
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


def run_tools(turn: str):
    """(the observation, calls, errors) of the calls in a turn."""
    results, errors = [], 0
    calls = TOOL_CALL.findall(turn)
    for raw in calls:
        try:
            call = json.loads(raw)
            if call.get("name") != "calculator":
                raise ValueError(f"unknown tool {call.get('name')!r}")
            arguments = call.get("arguments", {})
            results.append(calculator(arguments.get("expression", "") if isinstance(arguments, dict) else arguments))
        except Exception as e:  # noqa: BLE001 - the model reads the error, as with the built-in tools
            errors += 1
            results.append(f"error: {type(e).__name__}: {e}")
    return "\n".join(results), len(calls), errors


def main() -> None:
    task = json.load(sys.stdin)
    messages = task["record"].get("messages")
    if not messages:   # the dataset's prompt is the chat template's rendering of one user turn
        messages = [{"role": "user", "content": USER_TURN.search(task["prompt"]).group(1)}]
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    tool_calls = tool_errors = 0
    for _ in range(MAX_TURNS):
        response = session.post(url, json={"model": "policy", "messages": messages}, timeout=300)
        if response.status_code != 200:
            sys.exit(f"HTTP {response.status_code}: {response.text[:500]}")
        answer = response.json()["choices"][0]
        turn = answer["message"]["content"]
        messages.append({"role": "assistant", "content": turn})
        if answer["finish_reason"] == "length" or not TOOL_CALL.search(turn):
            break
        observation, calls, errors = run_tools(turn)
        tool_calls, tool_errors = tool_calls + calls, tool_errors + errors
        messages.append({"role": "tool", "content": observation})
    print(json.dumps({"tool_calls": tool_calls, "tool_errors": tool_errors}))


if __name__ == "__main__":
    main()

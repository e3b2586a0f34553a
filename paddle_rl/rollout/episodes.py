"""Multi-turn episodes: an environment answers each finished turn with an observation that the rollout feeds back
to the policy, until the episode ends, `max_turns` is reached or the token budget (`max_dec_len`, observations
included) runs out.

An environment (`env_plugin`: a registered name, `tools` the built-in tool environment or `agent` (agents.py), or
`path/to/file.py:ClassName`) is a class with
    reset(record)            a new episode on the sample's dataset record (its `tools` schema, its ground truth)
    step(turn) -> Step       the policy's turn (text, the stop token excluded); Step(observation, reward, done):
                             the observation's text (None or done=True: the episode ends), a reward (optional,
                             summed over the episode into the reward function `env`)
One instance per sample. The observation becomes a message of role `tool` rendered by the tokenizer's own chat
template (Qwen2.5's renders it as a user turn holding `<tool_response>`), followed by the generation prompt of the
next assistant turn: its tokens are fed to the model one per decode step (the KV cache is kept across turns), carry
no log-prob, and are out of the loss, KL and entropy masks (`response_mask`); the sequence keeps them, so the
log-probs of the policy's tokens are those of a forward over the whole conversation.

`EpisodeRunner` is what the engine calls (`turn_ended`); it records per sample the turns, tool calls, tool
errors and the environment's reward, written as columns after the rollout (`finish`).

An environment registers with `register_environment(name, options=(...))`, declaring there the config keys it
reads (config/options.py `option`: they join the config's keys, checked as the config loads); its `make(config,
tokenizer, stop_ids)` gives the episodes of a rollout, `episodes(records, prompts, uids, n)`. A plugin class declares
its keys as `OPTIONS = (option(...), ...)` and is built with them, `ClassName(**{key: value})`; the loader imports the
file named by `env_plugin` when the config holds keys nobody else declared.
"""
import ast
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..config.fields import at_least
from ..config.options import PIECE_OPTIONS, Option, declare_plugin_key, option
from ..rewards.code import SANDBOX_ALLOW_NETWORK, SANDBOX_ALLOW_UNISOLATED
from ..rewards.sandbox import SandboxError, SandboxLimits, require_isolation, run_program

SENTINEL = "\u2063TURN\u2063"  # stands for the policy's turn when the template renders an observation


class EpisodeError(RuntimeError):
    """An environment plugin that raised (names the plugin and the sample)."""


@dataclass
class Step:
    observation: Optional[str] = None
    reward: Optional[float] = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


# ---------------------------------------------------------------- built-in tools
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")
    if len(expression) > 500:
        raise ValueError("expression too long")
    result = value(ast.parse(str(expression), mode="eval"))
    if isinstance(result, float) and result.is_integer() and abs(result) < 1e15:
        result = int(result)
    return str(result)


PYTHON_TOOL_LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=5, memory_mb=256, output_mb=1)


def python(code: str, limits: SandboxLimits = PYTHON_TOOL_LIMITS) -> str:
    """Run a Python program in the sandbox (rewards/sandbox.py: bubblewrap, no network, 5 s, 256 MB); its stdout."""
    result = run_program(str(code), "", limits)
    if result.status != "ok":
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.status
        raise RuntimeError(f"{result.status}: {detail[:300]}")
    return result.stdout


TOOLS: Dict[str, Callable] = {"calculator": calculator, "python": python}
TOOL_ARGUMENT = {"calculator": "expression", "python": "code"}
MAX_OBSERVATION_CHARS = 2000
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolEnvironment:
    """The built-in environment: a turn holding Hermes-style tool calls (`<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`, as Qwen2.5's template asks for them) gets their results as the observation (one line per
    call); a turn without one ends the episode. A tool that raises, hangs or prints megabytes gives an error
    observation (`error: ...`), never an exception."""

    def __init__(self, tools=("calculator", "python"), max_calls: int = 4, sandbox: SandboxLimits = PYTHON_TOOL_LIMITS):
        unknown = [t for t in tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"env_tools: unknown tool(s) {', '.join(unknown)} (built-in: {', '.join(TOOLS)})")
        self.tools = {t: TOOLS[t] for t in tools}
        if "python" in self.tools:
            self.tools["python"] = functools.partial(python, limits=sandbox)
        self.max_calls = max_calls

    def reset(self, record: dict) -> None:
        self.record = record

    def step(self, turn: str) -> Step:
        calls = TOOL_CALL.findall(turn)
        if not calls:
            return Step(done=True)
        results, errors = [], 0
        for index, raw in enumerate(calls):
            if index >= self.max_calls:
                errors += 1
                results.append(f"error: not run: more than {self.max_calls} tool calls in one turn "
                               f"(max_tool_calls_per_turn)")
                continue
            try:
                call = json.loads(raw)
                name, arguments = call["name"], call.get("arguments", {})
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                if name not in self.tools:
                    raise ValueError(f"unknown tool {name!r} (tools: {', '.join(self.tools)})")
                if isinstance(arguments, dict):
                    arguments = arguments.get(TOOL_ARGUMENT[name], next(iter(arguments.values()), ""))
                out = str(self.tools[name](arguments))
            except Exception as e:  # noqa: BLE001 - the model sees the error, the run goes on
                errors += 1
                out = f"error: {type(e).__name__}: {e}"
            if len(out) > MAX_OBSERVATION_CHARS:
                out = out[:MAX_OBSERVATION_CHARS] + f"... ({len(out) - MAX_OBSERVATION_CHARS} more characters cut)"
            results.append(out.strip())
        return Step("\n".join(results), tool_calls=len(calls), tool_errors=errors)


def load_environment(spec: str, tools=("calculator", "python"), max_calls: int = 4,
                     sandbox: SandboxLimits = PYTHON_TOOL_LIMITS) -> Callable[[], object]:
    """A factory of environments: `tools` (the built-in ToolEnvironment) or `file.py:ClassName` (the class; one
    that declares OPTIONS is built by `plugin_episodes` with their values). The built-in `python` tool refuses at
    start-up (SandboxError) where programs cannot be isolated, unless `sandbox.allow_unisolated`."""
    if spec == "tools":
        ToolEnvironment(tools, max_calls, sandbox)  # unknown tool names fail here, at start-up
        if "python" in tools and not sandbox.allow_unisolated:
            try:
                require_isolation()
            except SandboxError as e:
                raise SandboxError(f"env_tools: the python tool runs untrusted programs: {e}; or remove python "
                                   f"from env_tools") from e
        return lambda: ToolEnvironment(tools, max_calls, sandbox)
    return plugin_class(spec)


# ---------------------------------------------------------------- the registry
READER = "environment"


@dataclass(frozen=True)
class Environment:
    """A registered environment: `make(config, tokenizer, stop_ids)` -> `episodes(records, prompts, uids, n)`, the
    episodes of one rollout (`n` samples of each record); `options` the config keys it reads."""
    name: str
    make: Callable
    options: Tuple[Option, ...] = ()


ENVIRONMENTS: Dict[str, Environment] = {}


def _declare(options, reader) -> Tuple[Option, ...]:
    """Declare `options` (each an Option, or the key of one declared before) with `reader`, replacing what the
    same reader declared before; TypeError naming the reader otherwise."""
    declared = PIECE_OPTIONS.resolve(options, reader)
    PIECE_OPTIONS.declare_all(declared, reader)
    return declared


def register_environment(name: str, options: Tuple = ()):
    """Decorator of `make(config, tokenizer, stop_ids)`: the environment `env_plugin: name`, reading the config
    keys `options` (each an Option, config.options.option, or the key of one declared before)."""
    def wrap(make):
        ENVIRONMENTS[name] = Environment(name, make, _declare(options, (READER, name)))
        return make
    return wrap


def episode_maker(config, tokenizer, stop_ids):
    """`episodes(records, prompts, uids, n)` of the environment `env_plugin` names (None without one)."""
    if not config.env_plugin:
        return None
    registered = ENVIRONMENTS.get(config.env_plugin)
    return (registered.make if registered else plugin_episodes)(config, tokenizer, stop_ids)


def runner_episodes(make_env: Callable[[], object], config, tokenizer, stop_ids):
    """The episodes of environments built by `make_env`, one per sample (EpisodeRunner)."""
    name = f"env_plugin {config.env_plugin}"
    return lambda records, prompts, uids, n: EpisodeRunner(make_env, records, n, tokenizer, stop_ids,
                                                           config.max_turns, name)


ENV_TOOLS = option("env_tools", list, ["calculator", "python"],
                   "The built-in tool environment's tools: calculator, python (runs untrusted programs: needs "
                   "bubblewrap, docs/rewards.md).")
MAX_TOOL_CALLS_PER_TURN = option("max_tool_calls_per_turn", int, 4,
                                 "The built-in tool environment: tool calls run per turn; the ones past it get an "
                                 "error observation and are not run.", check=at_least(1))


@register_environment("tools", options=(ENV_TOOLS, MAX_TOOL_CALLS_PER_TURN, SANDBOX_ALLOW_NETWORK,
                                        SANDBOX_ALLOW_UNISOLATED))
def tool_episodes(config, tokenizer, stop_ids):
    """The built-in tool environment; its python tool runs in the sandbox the config's sandbox_* keys set."""
    sandbox = dataclasses.replace(PYTHON_TOOL_LIMITS, allow_network=config.sandbox_allow_network,
                                  allow_unisolated=config.sandbox_allow_unisolated)
    make_env = load_environment("tools", tuple(config.env_tools), config.max_tool_calls_per_turn, sandbox)
    return runner_episodes(make_env, config, tokenizer, stop_ids)


def plugin_episodes(config, tokenizer, stop_ids):
    """`env_plugin: file.py:ClassName`: one instance per sample, given the values of the keys its OPTIONS declare."""
    cls = plugin_class(config.env_plugin)
    values = {declared.key: declared.value(config) for declared in getattr(cls, "OPTIONS", ())}
    return runner_episodes(lambda: cls(**values), config, tokenizer, stop_ids)


_PLUGIN_CLASSES: Dict[tuple, type] = {}


def plugin_class(spec: str) -> type:
    """The class of `file.py:ClassName`, loaded once per process for the same file contents (its OPTIONS declared
    with it, so the keys a config read are those the run builds it with); ValueError naming the plugin."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"env_plugin: {spec!r} is neither a registered environment "
                         f"({', '.join(sorted(ENVIRONMENTS))}) nor 'path/to/file.py:ClassName'")
    if not os.path.isfile(path):
        raise ValueError(f"env_plugin: file not found: {os.path.abspath(path)}")
    with open(path, "rb") as f:
        key = (os.path.abspath(path), name, hashlib.sha256(f.read()).hexdigest())
    cls = _PLUGIN_CLASSES.get(key) or _load_class(path, name, spec)
    try:   # declared at every call: keys withdrawn since the file was loaded come back
        _declare(getattr(cls, "OPTIONS", ()), (READER, spec))
    except TypeError as e:
        raise ValueError(f"env_plugin {spec}: {e}") from e
    _PLUGIN_CLASSES[key] = cls
    return cls


def _load_class(path: str, name: str, spec: str) -> type:
    module_spec = importlib.util.spec_from_file_location("paddle_rl_env_plugin_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"env_plugin {spec}: import failed: {type(e).__name__}: {e}") from e
    cls = getattr(module, name, None)
    if cls is None or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ValueError(f"env_plugin {spec}: {name} is not a class with reset(record) and step(turn)")
    declared = getattr(cls, "OPTIONS", ())
    if not isinstance(declared, (tuple, list)) or not all(isinstance(o, Option) for o in declared):
        raise ValueError(f"env_plugin {spec}: {name}.OPTIONS must be a tuple of config.options.option(...)")
    return cls


def _load_env_plugin(spec: str) -> None:
    if spec not in ENVIRONMENTS:
        plugin_class(spec)


declare_plugin_key("env_plugin", _load_env_plugin)


def continuation_renderer(tokenizer, stop_ids) -> Callable[[List[dict], List[dict], int], List[int]]:
    """(the conversation before the policy's turn, the messages after it, the token that ended the turn) -> the
    tokens that follow the turn: the chat template's own rendering of those messages and the next assistant turn's
    generation prompt, the turn's own end left out when the policy wrote it."""
    stop_texts = {t: tokenizer.decode([t]) for t in stop_ids}

    def render(history: List[dict], messages: List[dict], stop_token: int) -> List[int]:
        text = tokenizer.apply_chat_template(list(history) + [{"role": "assistant", "content": SENTINEL}]
                                             + list(messages), add_generation_prompt=True)
        at = text.find(SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not render the assistant's content as given: cannot place "
                             "observations after a turn")
        rest = text[at + len(SENTINEL):]
        ended = stop_texts.get(stop_token, "")
        if ended and rest.startswith(ended):  # the policy already wrote the end of its turn
            rest = rest[len(ended):]
        return tokenizer.encode(rest)
    return render


def observation_renderer(tokenizer, stop_ids) -> Callable[[str, int], List[int]]:
    """(observation text, the token that ended the policy's turn) -> the tokens fed in: a `tool` message after the
    turn (continuation_renderer)."""
    render = continuation_renderer(tokenizer, stop_ids)
    convo = [{"role": "user", "content": "q"}]
    return lambda observation, stop_token: render(convo, [{"role": "tool", "content": observation}], stop_token)


def episode_columns(batch, turns, tool_calls, tool_errors, reward) -> None:
    """The columns of a multi-turn rollout (per row: turns, tool calls, tool errors, the environment's reward or
    NaN, and the policy's tokens), which the metrics and the reward function `env` read."""
    batch["turns"] = np.asarray(turns, dtype=np.int64)
    batch["tool_calls"] = np.asarray(tool_calls, dtype=np.int64)
    batch["tool_errors"] = np.asarray(tool_errors, dtype=np.int64)
    batch["env_reward"] = np.asarray(reward, dtype=np.float32)
    batch["policy_tokens"] = np.asarray(batch["response_mask"]).sum(1).astype(np.int64)


class EpisodeRunner:
    """The episodes of one rollout: one environment per sample, in the engine's row order (each prompt's n samples
    together), reset with its prompt's record."""

    def __init__(self, make_env: Callable[[], object], records: List[dict], n: int, tokenizer, stop_ids,
                 max_turns: int, name: str = "env_plugin"):
        self.n, self.tokenizer, self.max_turns, self.name = n, tokenizer, max_turns, name
        self.render = observation_renderer(tokenizer, stop_ids)
        self.envs, self.records = [], records
        self.turns = np.ones(len(records) * n, dtype=np.int64)
        self.tool_calls = np.zeros(len(records) * n, dtype=np.int64)
        self.tool_errors = np.zeros(len(records) * n, dtype=np.int64)
        self.reward = np.full(len(records) * n, np.nan, dtype=np.float32)
        for group, record in enumerate(records):
            for sample in range(n):
                env = make_env()
                self._call(group, sample, env, "reset", record)
                self.envs.append(env)

    def _call(self, group: int, sample: int, env, method: str, arg):
        try:
            return getattr(env, method)(arg)
        except Exception as e:  # noqa: BLE001 - named: the plugin and the sample
            record = self.records[group]
            uid = record.get("uid", group) if isinstance(record, dict) else group
            raise EpisodeError(f"{self.name} {type(env).__name__}.{method} raised on sample {sample} of prompt "
                               f"{uid} (row {group * self.n + sample}): {type(e).__name__}: {e}") from e

    def turn_ended(self, seq) -> Optional[List[int]]:
        """The observation's tokens after `seq`'s finished turn, or None when the episode ends."""
        row = seq.row
        turn = self.tokenizer.decode(seq.tokens[seq.turn_start:-1])
        step = self._call(seq.group, seq.sample, self.envs[row], "step", turn)
        if not isinstance(step, Step):
            step = Step(observation=step) if isinstance(step, str) or step is None else Step(*step)
        if step.reward is not None:
            self.reward[row] = (0.0 if math.isnan(self.reward[row]) else self.reward[row]) + float(step.reward)
        self.tool_calls[row] += step.tool_calls
        self.tool_errors[row] += step.tool_errors
        if step.done or step.observation is None or self.turns[row] >= self.max_turns:
            return None
        self.turns[row] += 1
        return self.render(step.observation, seq.tokens[-1])

    def finish(self, batch) -> None:
        """The episodes' columns on the rollout's batch (its rows in this runner's order)."""
        episode_columns(batch, self.turns, self.tool_calls, self.tool_errors, self.reward)

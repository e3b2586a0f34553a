"""Multi-turn episodes: an environment's observations are fed back between turns (the chat template's own
rendering, the KV cache kept), rows at different turns decode together, observation tokens stay out of the loss
while the policy's log-probs equal a forward over the whole conversation, the built-in tools never take the run
down, environment rewards reach the reward functions, a raising plugin is named, and kill -9 + resume reproduces
a multi-turn run."""
import json
import os
import shutil
import time

import numpy as np
import pytest

from micro_model import config_file, kill_after_checkpoint, micro_overrides, train_process
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
from paddle_rl.rollout.episodes import EpisodeError, EpisodeRunner, Step, ToolEnvironment, calculator, load_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = '''
from paddle_rl.rollout.episodes import Step


class Countdown:
    """Answers a turn with an observation while the sample has turns left (len(src) % 3 of them), then ends the
    episode with a reward of the last turn's length parity."""

    def reset(self, record):
        self.left = len(record["src"]) % 3
        self.steps = 0

    def step(self, turn):
        self.steps += 1
        if self.left <= 0:
            return Step(done=True, reward=float(len(turn) % 2))
        self.left -= 1
        return Step(observation=f"result {self.steps}", reward=0.5)


class Broken:
    def reset(self, record):
        pass

    def step(self, turn):
        raise KeyError("boom")
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "env_plugin.py"
    path.write_text(PLUGIN)
    return str(path)


def _records(micro, count):
    return [json.loads(line) for line in open(micro["train"])][:count]


def _stops(tok):
    """Frequent stop tokens for the random micro model, so that turns end within a few tokens."""
    return sorted({tok.encode(c)[0] for c in "aeiou "} | set(tok.eos_token_ids))


def test_observations_are_fed_back_and_policy_logprobs_equal_a_full_forward(micro, plugin):
    from paddle_rl.layouts import build_layout
    from paddle_rl.models import load_model
    from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key
    tok, model = micro["tokenizer"], load_model(micro["model"])
    records = _records(micro, 6)
    runner = EpisodeRunner(load_environment(f"{plugin}:Countdown"), records, 4, tok, _stops(tok), max_turns=3)
    keys = [sample_key(1, 1, i, j) for i in range(6) for j in range(4)]
    params = SamplingParams(max_dec_len=120, temperature=1.0, stop_token_ids=_stops(tok))
    out = RolloutEngine(model, tok.pad_token_id, tok.eos_token_ids).generate([tok.encode(r["src"]) for r in records],
                                                                          4, params, keys, runner)
    turns = out["turns"]
    assert set(turns.tolist()) == {1, 2, 3}  # episodes of different lengths, decoded in one running batch
    planned = np.minimum(np.repeat([len(r["src"]) % 3 for r in records], 4) + 1, 3)
    finished = ~out["truncated"]  # a truncated row ran out of tokens before its last turn
    assert (turns[finished] == planned[finished]).all() and (turns <= planned).all() and finished.mean() > 0.5
    # each observation is the template's `tool` turn plus the next generation prompt, out of the loss mask
    mask, tokens = out["response_mask"], out["response_ids"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
                                        {"role": "tool", "content": "result 1"}], add_generation_prompt=True)
    after_turn = rendered.split("A", 1)[1]   # "<|im_end|>\n<|im_start|>tool\nresult 1<|im_end|>\n..."
    seen = 0
    for row in np.flatnonzero(turns == 2):
        gap = np.flatnonzero(mask[row, :out["lengths"][row]] == 0)
        ended_by_eos = tokens[row, gap[0] - 1] in tok.eos_token_ids  # then the turn's own end is not repeated
        want = tok.encode(after_turn[len("<|im_end|>"):] if ended_by_eos else after_turn)
        assert tokens[row, gap].tolist() == want and (np.diff(gap) == 1).all()
        seen += 1
    assert seen
    assert (out["rollout_logp"][mask == 0] == 0).all()
    # one decode step per token after the first, whatever the turn: no re-prefill between turns
    assert int(out["decode_steps"].sum()) == int((out["lengths"] - 1).sum())
    # the policy's log-probs against a forward over the whole conversation, observations included
    out["group"] = np.arange(out.size) // 4
    batch = out.with_prompt_layout(tok.pad_token_id)
    logp = build_layout().logprobs(model, batch, 1.0, 24)
    assert np.abs(logp - batch["rollout_logp"] * mask).max() <= 1e-5
    reward = out["env_reward"]
    # the episode's rewards summed (0.5 per observation, the last turn's parity); none for a row cut off first
    assert np.isfinite(reward[finished]).all() and set(np.unique(reward[finished])) <= {0.0, 0.5, 1.0, 1.5, 2.0}


def test_the_tool_environment_never_takes_the_run_down():
    env = ToolEnvironment()
    env.reset({})
    call = '<tool_call>{{"name": "{}", "arguments": {{"{}": {}}}}}</tool_call>'
    assert env.step("the sum is " + call.format("calculator", "expression", json.dumps("17 + 25 * 2"))) \
        == Step("67", tool_calls=1)
    assert env.step("no call: the answer is 4").done
    bad = env.step(call.format("calculator", "expression", json.dumps("__import__('os')")) + call.format(
        "search", "q", '"x"') + "<tool_call>{not json</tool_call>")
    assert bad.tool_calls == 3 and bad.tool_errors == 3 and bad.observation.count("error:") == 3
    assert calculator("2 ** 10") == "1024" and calculator("7 / 2") == "3.5"
    start = time.time()
    hang = env.step(call.format("python", "code", json.dumps("while True: pass")))
    flood = env.step(call.format("python", "code", json.dumps("print('x' * 10**8)")))
    raises = env.step(call.format("python", "code", json.dumps("raise ValueError('nope')")))
    ok = env.step(call.format("python", "code", json.dumps("print(sum(range(10)))")))
    assert time.time() - start < 30
    assert hang.tool_errors == 1 and "timeout" in hang.observation
    assert flood.tool_errors == 1 and len(flood.observation) < 3000
    assert raises.tool_errors == 1 and "ValueError: nope" in raises.observation
    assert ok == Step("45", tool_calls=1)


def _overrides(micro, plugin, out, **extra):
    tok = micro["tokenizer"]
    values = dict(do_eval=False, max_steps=3, env_plugin=f"{plugin}:Countdown", max_turns=3, max_dec_len=40,
                  stop_token_ids=json.dumps(_stops(tok)), reward_funcs="env", kl_loss_coeff=0.05, save_steps=2)
    values.update(extra)
    return micro_overrides(micro, str(out), **values)


def test_training_masks_observations_and_rewards_from_the_environment(micro, plugin, tmp_path):
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, _overrides(micro, plugin, tmp_path / "run")))
    trainer.train()
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    for row in rows:
        assert 1.0 <= row["episode/turns/mean"] <= 3.0 and row["episode/policy_token_share"] < 1.0
        assert np.isfinite(row["actor/pg_loss"]) and row["reward/env_mean"] == row["reward/mean"]
    assert max(r["reward/std"] for r in rows) > 0
    with pytest.raises(EpisodeError, match=r"env_plugin .*:Broken Broken.step raised on sample \d+ of prompt \S+ "
                                           r"\(row \d+\): KeyError"):
        RLTrainer(load_config(None, _overrides(micro, plugin, tmp_path / "broken",
                                               env_plugin=f"{plugin}:Broken"))).train()
    with pytest.raises(ConfigError, match="async_rollout: not with env_plugin"):
        load_config(None, _overrides(micro, plugin, tmp_path / "x", async_rollout=True))


def test_kill_9_mid_run_and_resume_reproduces_a_multi_turn_run(micro, plugin, tmp_path):
    base = _overrides(micro, plugin, tmp_path / "a", max_steps=4)
    cfg = config_file(base, tmp_path / "cfg.yaml")
    ref = train_process(cfg)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out_b = tmp_path / "b"
    kill_after_checkpoint(cfg, out_b, delay=0.3)  # into step 3's episodes
    resumed = train_process(cfg, f"output_dir={out_b}", "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]  # noqa
    assert strip(read_metrics(str(out_b / "metrics.jsonl"))) == strip(read_metrics(str(tmp_path / "a" /
                                                                                         "metrics.jsonl")))


def test_a_records_tool_schemas_reach_the_chat_template(tmp_path):
    """ms-swift `tools` (a list or its JSON string) and verl `extra_info.tools` are rendered by the template."""
    from paddle_rl.data.records import ChatForm, RecordError, to_prompt_record
    from paddle_rl.data.templates import QWEN25_CHAT_TEMPLATE
    from paddle_rl.models import Tokenizer
    folder = tmp_path / "tok"
    shutil.copytree(os.path.join(ROOT, "data", "tiny_tool", "model"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # Qwen2.5's layout with a tools block first, as its own template writes the schemas into the system turn
    config["chat_template"] = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}"
                               "{{- t | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}" + QWEN25_CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    chat = ChatForm(Tokenizer.from_pretrained(str(folder)))
    schema = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    plain = to_prompt_record({"messages": messages, "solution": "4"}, "src", "tgt", chat)["prompt"]
    assert "calculator" not in plain and plain.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
    for raw in ({"messages": messages, "tools": schema, "solution": "4"},
                {"messages": messages, "tools": json.dumps(schema), "solution": "4"},
                {"prompt": messages, "extra_info": {"tools": schema}, "solution": "4"}):
        prompt = to_prompt_record(raw, "src", "tgt", chat)["prompt"]
        assert prompt == "<|im_start|>system\n# Tools\n" + json.dumps(schema[0], sort_keys=True) + "<|im_end|>\n" + plain
    with pytest.raises(RecordError, match="'tools' must be a list of tool schemas"):
        to_prompt_record({"messages": messages, "tools": {"x": 1}, "solution": "4"}, "src", "tgt", chat)


# ---- an environment's config keys are declared where it registers; a plugin class declares its own
OPTION_PLUGIN = '''
from paddle_rl.config.fields import at_least
from paddle_rl.config.options import option


class Echo:
    OPTIONS = (option("echo_times_test", int, 1, "How often the observation repeats the letter.",
                      check=at_least(1)),)

    def __init__(self, echo_times_test):
        self.times = echo_times_test

    def reset(self, record):
        pass

    def step(self, turn):
        return "x" * self.times
'''


def test_the_built_in_environments_declare_their_keys():
    from paddle_rl.config.options import PIECE_OPTIONS
    from paddle_rl.rollout import ENVIRONMENTS
    assert [o.key for o in ENVIRONMENTS["tools"].options] == ["env_tools", "max_tool_calls_per_turn",
                                                              "sandbox_allow_network", "sandbox_allow_unisolated"]
    assert [o.key for o in ENVIRONMENTS["agent"].options] == ["agent_command", "agent_timeout", "agent_concurrency",
                                                              "agent_on_failure", "agent_sandbox",
                                                              "agent_allow_network", "agent_memory_mb",
                                                              "agent_processes", "agent_sandbox_binds"]
    assert PIECE_OPTIONS.readers("env_tools") == [("environment", "tools")]
    with pytest.raises(ConfigError, match="max_tool_calls_per_turn: must be >= 1, got 0"):
        load_config(None, {"actor_model_name_or_path": "m", "max_tool_calls_per_turn": 0})


def test_an_environment_with_a_new_key_is_one_registration():
    """register_environment declares the key it reads (after the loader was imported): read, checked, passed."""
    from paddle_rl.config.fields import at_least
    from paddle_rl.config.options import PIECE_OPTIONS, option
    from paddle_rl.rollout.episodes import ENVIRONMENTS, episode_maker, register_environment
    seen = []

    @register_environment("steps_test", options=(option("steps_test_budget", int, 2, "Turns.", check=at_least(1)),))
    def steps_episodes(config, tokenizer, stop_ids):
        seen.append(config.steps_test_budget)
        return lambda records, prompts, uids, n: None
    try:
        config = load_config(None, {"actor_model_name_or_path": "m", "env_plugin": "steps_test",
                                    "steps_test_budget": 5})
        episode_maker(config, None, [])
        episode_maker(load_config(None, {"actor_model_name_or_path": "m", "env_plugin": "steps_test"}), None, [])
        assert seen == [5, 2]
        with pytest.raises(ConfigError, match="steps_test_budget: must be >= 1, got 0"):
            load_config(None, {"actor_model_name_or_path": "m", "env_plugin": "steps_test", "steps_test_budget": 0})
    finally:
        del ENVIRONMENTS["steps_test"]
        PIECE_OPTIONS.withdraw(("environment", "steps_test"))
    with pytest.raises(ConfigError, match="unknown key 'steps_test_budget'"):
        load_config(None, {"actor_model_name_or_path": "m", "steps_test_budget": 5})


def test_a_plugin_environment_declares_its_keys(micro, tmp_path):
    """A plugin class's OPTIONS: the key of a YAML file naming the plugin is read, checked and given to each
    instance; an unknown key is still an error; a config without such keys imports no plugin file."""
    from paddle_rl.config.options import PIECE_OPTIONS
    from paddle_rl.rollout.episodes import episode_maker
    tok = micro["tokenizer"]
    path = tmp_path / "echo_env.py"
    path.write_text(OPTION_PLUGIN)
    run = tmp_path / "run.yaml"
    run.write_text(f"actor_model_name_or_path: m\nenv_plugin: {path}:Echo\necho_times_test: 3\n")
    spec = f"{path}:Echo"
    try:
        config = load_config(str(run))
        assert config.echo_times_test == 3
        runner = episode_maker(config, tok, _stops(tok))([{"uid": "a"}], ["p"], ["a"], 2)
        assert [env.times for env in runner.envs] == [3, 3]
        with pytest.raises(ConfigError, match="echo_times_test: must be >= 1, got 0"):
            load_config(str(run), ["echo_times_test=0"])
        with pytest.raises(ConfigError, match=r"unknown key 'echo_times_tset' \(did you mean 'echo_times_test'"):
            load_config(str(run), ["echo_times_tset=2"])
    finally:
        PIECE_OPTIONS.withdraw(("environment", spec))
    broken = tmp_path / "broken_env.py"
    broken.write_text("raise RuntimeError('not imported while every key is known')\n")
    spec = f"{broken}:Echo"
    assert load_config(None, {"actor_model_name_or_path": "m", "env_plugin": spec}).env_plugin == spec
    with pytest.raises(ConfigError, match="env_plugin .*broken_env.py:Echo: import failed: RuntimeError"):
        load_config(None, {"actor_model_name_or_path": "m", "env_plugin": f"{broken}:Echo", "echo_times_test": 2})

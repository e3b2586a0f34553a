"""Agent programs as environments (env_plugin: agent): real programs in processes of their own talk to the
trainer's recording proxy on 127.0.0.1; the recorded samples hold exactly the tokens and log-probs the engine
generated for each request, the fed-in tokens out of the loss; rewards come from the program's last line or from a
rule on the transcript; programs that hang, exit non-zero or print garbage give a zero-reward sample or a named
error; and a short run trains on the recorded samples (the bundled tool agent, configs/tiny_tool_agent.py)."""
import json
import os
import sys
import time

import numpy as np
import pytest

from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import read_metrics
from paddle_rl.rollout.agents import AgentEnvironment, AgentError, AgentSettings
from paddle_rl.rollout.episodes import continuation_renderer
from paddle_rl.rollout.keys import call_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "data", "tiny_tool")
TOOL_AGENT = [sys.executable, os.path.join(ROOT, "configs", "tiny_tool_agent.py")]
MAX_DEC_LEN = 120

# a program on urllib alone (fast to start): chat turns as the bundled agent, a reward line of its own, and the
# misbehaviours its record asks for
PROGRAM = r'''
import json, os, subprocess, sys, time, urllib.error, urllib.request

task = json.load(sys.stdin)
record = task["record"]
mode = record.get("mode", "ok")
if mode == "no_request":
    print(json.dumps({"reward": 1.0}))
    sys.exit(0)


def post(body, key=os.environ["OPENAI_API_KEY"], path="/chat/completions"):
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + path, json.dumps(body).encode(),
                                     {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as answer:
            return 200, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


question = record["src"].split("user\n", 1)[1].split("<|im_end|>", 1)[0]
system = [{"role": "system", "content": "odd"}] if record.get("vary") and task["sample"] % 2 else []
messages = system + [{"role": "user", "content": question}]
status, answer = post({"messages": messages, "logprobs": True})
assert status == 200, answer
reply = answer["choices"][0]
messages.append({"role": "assistant", "content": reply["message"]["content"]})
if mode == "budget":   # turns without max_tokens until the budget is spent: each answered, the last ones empty
    statuses = []
    for _ in range(40):
        messages.append({"role": "tool", "content": "1"})
        status, answer = post({"messages": messages})
        statuses.append([status, answer["choices"][0]["finish_reason"] if status == 200 else answer])
        if status != 200:
            break
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    with open(record["out"], "w") as f:
        json.dump(statuses, f)
if mode == "probe":   # the proxy's refusals, written where the test reads them
    found = {"unknown_session": post({"messages": messages}, key="session-x")[0],
             "not_continued": post({"messages": messages[:1] + [{"role": "tool", "content": "1"}]}),
             "temperature": post({"messages": messages + [{"role": "tool", "content": "1"}], "temperature": 0.5}),
             "n": post({"messages": messages + [{"role": "tool", "content": "1"}], "n": 2})[0],
             "answer_logprobs": [c["logprob"] for c in reply["logprobs"]["content"]],
             "answer_ids": reply["token_ids"]}
    with open(record["out"], "w") as f:
        json.dump(found, f)
if mode == "hang":
    with open(record["out"], "w") as f:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(300)
if mode == "exit":
    print("something broke", file=sys.stderr)
    sys.exit(3)
if reply["finish_reason"] == "stop" and "<tool_call>" in reply["message"]["content"]:
    messages.append({"role": "tool", "content": "247"})
    status, answer = post({"messages": messages})
    assert status == 200, answer
print("a log line")
print("garbage" if mode == "garbage" else json.dumps({"reward": 0.25 * task["sample"], "tool_calls": 1}))
'''


@pytest.fixture(scope="module")
def tool_model():
    from paddle_rl.models import Tokenizer, load_model
    from paddle_rl.rollout import RolloutEngine
    tok = Tokenizer.from_pretrained(os.path.join(TOOL, "model"))
    model = load_model(os.path.join(TOOL, "model"))
    stops = sorted(set(tok.eos_token_ids) | set(model.config.eos_token_ids))
    return tok, RolloutEngine(model, tok.pad_token_id, stops), stops


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "agent.py"
    path.write_text(PROGRAM)
    return [sys.executable, str(path)]


def _config(*overrides):
    return load_config(None, [f"actor_model_name_or_path={TOOL}/model", *overrides])


def _records(count, **extra):
    rows = [json.loads(line) for line in open(os.path.join(TOOL, "tool", "train.jsonl"))][:count]
    return [dict(r, **extra) for r in rows]


def _rollout(tool_model, command, records, n, keys_seed=5, **settings):
    from paddle_rl.rollout import SamplingParams, sample_key
    tok, engine, stops = tool_model
    values = dict(timeout=60.0, concurrency=8, on_failure="zero", max_turns=3, max_prompt_len=64,
                  program_reward=False)
    values.update(settings)
    env = AgentEnvironment(AgentSettings(command, vocab_size=tok.vocab_size, **values), tok, stops,
                           {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_dec_len": 1,
                            "max_dec_len": MAX_DEC_LEN})
    params = SamplingParams(max_dec_len=MAX_DEC_LEN, min_dec_len=1, temperature=1.0, stop_token_ids=stops)
    keys = [sample_key(keys_seed, 1, f"t:{i}", j) for i in range(len(records)) for j in range(n)]
    try:
        episodes = env.episodes(records, [r["src"] for r in records], [f"t:{i}" for i in range(len(records))], n)
        out = engine.generate([tok.encode(r["src"]) for r in records], n, params, keys, episodes)
    finally:
        env.close()
    return out, keys


def _answers(out, row):
    """[(start, end)] of the row's policy segments (each one request's answer)."""
    mask = out["response_mask"][row, :out["lengths"][row]]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_recorded_tokens_and_logprobs_are_what_the_engine_generated(tool_model):
    """The bundled tool agent (the `requests` package, chat turns) on 3 prompts x 4 samples: each answer's tokens
    and log-probs equal a generation of its own by the engine (its context, its key, the budget left), bit for bit;
    between answers, the tool's answer rendered by the chat template, out of the loss and without log-probs."""
    from paddle_rl.rollout import SamplingParams
    tok, engine, stops = tool_model
    out, keys = _rollout(tool_model, TOOL_AGENT, _records(3), 4)
    assert not out["agent_failed"].any() and np.isnan(out["env_reward"]).all()
    assert (out["turns"] == out["tool_calls"] + 1).all() and out["tool_calls"].any()   # some episodes call the tool
    render = continuation_renderer(tok, stops)
    for row in range(out.size):
        k = int(out["lengths"][row])
        tokens, logp, mask = out["response_ids"][row, :k], out["rollout_logp"][row, :k], out["response_mask"][row, :k]
        prompt = list(out["prompt_ids"][row])
        assert prompt == tok.encode(_records(3)[row // 4]["src"])   # the chat template renders the dataset prompt
        segments = _answers(out, row)
        assert len(segments) == out["turns"][row]
        for call, (start, end) in enumerate(segments):
            own = engine.generate([prompt + tokens[:start].tolist()], 1,
                                  SamplingParams(max_dec_len=MAX_DEC_LEN - start, min_dec_len=1, temperature=1.0,
                                                 stop_token_ids=stops), [call_key(keys[row], call)])
            n = int(own["lengths"][0])
            assert end - start == n and tokens[start:end].tolist() == own["response_ids"][0, :n].tolist()
            assert np.array_equal(logp[start:end], own["rollout_logp"][0, :n])
            if call:   # what the agent sent after the previous answer: a `tool` message in the template
                before = segments[call - 1][1]
                fed = tokens[before:start].tolist()
                observation = tok.decode(fed).split("tool\n", 1)[1].split("<|im_end|>", 1)[0]
                assert fed == render([], [{"role": "tool", "content": observation}], int(tokens[before - 1]))
                assert (mask[before:start] == 0).all() and (logp[before:start] == 0).all()
    assert out["policy_tokens"].sum() == out["response_mask"].sum() < out["lengths"].sum()


def test_rewards_from_the_program_or_from_a_rule_and_samples_that_start_differently(tool_model, program):
    """The program's last line gives the reward (env_reward, the reward function `env`); with a rule (`math`) the
    rule scores the recorded transcript. Samples of one prompt that start from different prompt tokens (a system
    message on odd samples) are told apart for the shared-prompt passes: their log-probs equal the rollout's."""
    from paddle_rl.layouts import build_layout
    from paddle_rl.rewards import build_reward
    from paddle_rl.trainer.scoring import score
    tok, engine, _ = tool_model
    records = _records(2, vary=True)
    out, _ = _rollout(tool_model, program, records, 4, program_reward=True)
    assert not out["agent_failed"].any()
    assert out["env_reward"].tolist() == [0.0, 0.25, 0.5, 0.75] * 2 and (out["tool_calls"] == 1).all()
    assert out["prompt_variant"].tolist() == [0, 1, 0, 1] * 2
    items = [{"prompt": r["src"], "record": r, "ground_truth": r["tgt"]} for r in records for _ in range(4)]
    out["item"] = np.array(items, dtype=object)
    for funcs, want in ((["env"], out["env_reward"]), (["math"], None)):
        config = _config(f"reward_funcs={','.join(funcs)}")
        score(out, tok, build_reward(config))
        if want is None:   # the math rule on each decoded transcript
            texts = tok.decode_batch(out.responses())
            want = [float(f"<answer>{r['ground_truth']}</answer>" in t) for r, t in zip(items, texts)]
        assert out["reward"].tolist() == pytest.approx(list(want))
    out["group"] = np.arange(out.size) // 4
    batch = out.with_prompt_layout(tok.pad_token_id)
    logp = build_layout().logprobs(engine.model, batch, 1.0, 8)
    gap = np.abs(logp - batch["rollout_logp"] * batch["response_mask"])
    # a later request's context is prefilled whole: its log-probs agree with one forward within float rounding
    print("largest log-prob gap", gap.max(), "at", batch["rollout_logp"][np.unravel_index(gap.argmax(), gap.shape)])
    assert gap.max() <= 1e-4


def test_the_proxy_refuses_what_would_break_the_sample(tool_model, program, tmp_path):
    """An unknown session (401), a conversation that does not continue the last answer, a temperature other than
    the trainer's, n > 1: refused with the reason; the answer's log-probs are the recorded ones."""
    out_file = tmp_path / "probe.json"
    # unsandboxed: the program writes its findings into a file of the host (tests/test_agent_sandbox.py: the sandbox)
    out, _ = _rollout(tool_model, program, _records(1, mode="probe", out=str(out_file)), 1, sandbox=False)
    found = json.loads(out_file.read_text())
    assert found["unknown_session"] == 401 and found["n"] == 400
    status, body = found["not_continued"]
    assert status == 400 and "messages[1]: the conversation does not continue" in body["error"]["message"]
    status, body = found["temperature"]
    assert status == 400 and "temperature: 0.5 differs from the trainer's 1.0" in body["error"]["message"]
    start, end = _answers(out, 0)[0]
    assert found["answer_ids"] == out["response_ids"][0, start:end].tolist()
    assert found["answer_logprobs"] == out["rollout_logp"][0, start:end].tolist()


def test_a_request_past_the_budget_gets_an_empty_answer(tool_model, program, tmp_path):
    """A program that leaves max_tokens out keeps asking after the response budget (max_dec_len) is spent: each
    request is answered (200), those past the budget with an empty answer cut for length, never a refusal of a
    max_tokens it did not send (the bundled agent used to exit 1 there)."""
    out_file = tmp_path / "budget.json"
    # unsandboxed: the program writes its findings into a file of the host (tests/test_agent_sandbox.py: the sandbox)
    _rollout(tool_model, program, _records(1, mode="budget", out=str(out_file)), 1, sandbox=False, max_turns=60)
    statuses = json.loads(out_file.read_text())
    assert len(statuses) == 40 and all(status == 200 for status, _ in statuses), statuses
    assert statuses[-1][1] == "length"


def _ended(pid: int, wait: float = 10.0) -> bool:
    """Whether process `pid` has ended (gone, or a zombie nobody has reaped yet: a killed grandchild whose new
    parent does not wait for it), allowing the kernel `wait` seconds to deliver the kill on a loaded machine."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("mode,reason", [("hang", "ran past agent_timeout \\(5 s\\) and was killed"),
                                         ("exit", "exited with status 3"),
                                         ("garbage", "its last stdout line is not a JSON object with a \"reward\": "
                                                     "'garbage'"),
                                         ("no_request", "made no completion request")])
def test_a_misbehaving_program_gives_a_zero_reward_sample_or_a_named_error(tool_model, program, tmp_path, mode,
                                                                           reason):
    from paddle_rl.rewards import build_reward
    from paddle_rl.trainer.scoring import score
    tok = tool_model[0]
    # the hanging programs run alone: a timeout short enough to keep the test quick would also cut well-behaved
    # programs short on a loaded machine
    records = _records(1, mode=mode, out=str(tmp_path / "pids")) + ([] if mode == "hang" else _records(2)[1:])
    timeout = 5.0 if mode == "hang" else 120.0   # the well-behaved programs finish well within it
    start = time.monotonic()
    # the hanging program writes its processes' ids on the host: unsandboxed (test_agent_sandbox.py: in the sandbox)
    sandbox = mode != "hang"
    out, _ = _rollout(tool_model, program, records, 2, program_reward=True, timeout=timeout, sandbox=sandbox)
    if mode == "hang":   # agent_timeout is enforced: the rollout does not wait for the programs' own 300 s
        assert time.monotonic() - start < 120, time.monotonic() - start
    assert out["agent_failed"].tolist() == [True, True] + ([] if mode == "hang" else [False, False])
    out["item"] = np.array([{"prompt": r["src"], "record": r, "ground_truth": r["tgt"]} for r in records
                            for _ in range(2)], dtype=object)
    score(out, tok, build_reward(_config("reward_funcs=env,math")))
    assert out["reward"][:2].tolist() == [0.0, 0.0]
    if mode != "hang":
        assert out["reward"][2:].tolist() == pytest.approx([0.0 + out["reward/math"][2], 0.25 + out["reward/math"][3]])
    if mode == "hang":   # the program and its child were killed with their process group
        for pid in map(int, (tmp_path / "pids").read_text().split()):
            assert _ended(pid), f"process {pid} of the hanging program is still running"
    if mode == "no_request":   # nothing to train: the dataset prompt and one fed-in token
        assert out["lengths"][:2].tolist() == [1, 1] and out["response_mask"][:2].sum() == 0
    with pytest.raises(AgentError, match=rf"env_plugin agent: .*agent.py {reason} on sample \d of prompt t:0 \(row "
                                         rf"\d\)" + ("; its stderr ends: something broke" if mode == "exit" else "")):
        _rollout(tool_model, program, records, 2, program_reward=True, timeout=timeout, on_failure="error",
                 sandbox=sandbox)


def test_agent_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="agent_command: required with env_plugin: agent"):
        _config("env_plugin=agent")
    with pytest.raises(ConfigError, match="agent_command: acts only with env_plugin: agent"):
        _config("agent_command=python a.py")
    with pytest.raises(ConfigError, match="agent_on_failure: must be zero or error, got 'skip'"):
        _config("env_plugin=agent", "agent_command=python a.py", "agent_on_failure=skip")


def test_a_run_trains_on_the_recorded_samples(tmp_path):
    """configs/tiny_tool_agent_grpo.yaml cut to 2 steps of 2 prompts x 4 samples, with an evaluation: the bundled
    agent's episodes are trained on (tool answers out of the loss) and evaluated greedily through the same proxy."""
    from paddle_rl.trainer import RLTrainer
    overrides = [f"output_dir={tmp_path}", "max_steps=2", "global_batch_size=2", "global_mini_batch_size=2",
                 "rollout_n=4", "eval_steps=2", "max_eval_samples=4", "save_strategy=no", "disable_tqdm=true",
                 "report_to=none", f"agent_command={' '.join(TOOL_AGENT)}"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        RLTrainer(load_config("configs/tiny_tool_agent_grpo.yaml", overrides)).train()
    finally:
        os.chdir(cwd)
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    train = [r for r in rows if "actor/pg_loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(train) == 2 and [r["step"] for r in evals] == [0, 2]
    for row in train:
        assert row["episode/agent_failed_share"] == 0.0 and row["episode/policy_token_share"] <= 1.0
        assert np.isfinite(row["actor/pg_loss"]) and row["episode/turns/mean"] >= 1.0
    assert any(r["episode/policy_token_share"] < 1.0 for r in train)   # some episodes called the tool
    assert all(r["eval/agent_failed_share"] == 0.0 and r["eval/num_samples"] == 4.0 for r in evals)

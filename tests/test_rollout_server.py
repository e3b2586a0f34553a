"""The rollout server as real processes on 127.0.0.1: its batched endpoint equals the engine bit for bit, weight
pushes are versioned, the OpenAI endpoints work with the `openai` client, the API key is checked before the body,
and a trainer on servers reproduces the inline run exactly, through a server killed mid-generation."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from extras import extra
from micro_model import build_micro, micro_overrides
from paddle_rl.config import ConfigError, load_config
from paddle_rl.monitor import TIMING_PREFIXES, read_metrics
from paddle_rl.rollout.client import RolloutServerClient, RolloutServerError
from paddle_rl.rollout.wire import batch_from_parts, batch_from_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "r0ll-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`paddle-rl rollout-server` in a process of its own."""

    def __init__(self, model_dir: str, *args, api_key: str = KEY, overrides=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.cmd = [sys.executable, "-m", "paddle_rl", "rollout-server", _config(model_dir), *overrides,
                    "--port", str(self.port), *args]
        self.log_path = os.path.join(os.path.dirname(model_dir), f"server-{self.port}.log")
        self.log = open(self.log_path, "w+")
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT,
                                                              "PADDLE_RL_ROLLOUT_API_KEY": self.api_key},
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self) -> "Server":
        """The same command on the same port, after the process is gone (its log starts afresh)."""
        assert self.proc.poll() is not None
        self.log.close()
        self.log = open(self.log_path, "w+")
        self._start()
        return self

    def wait(self, timeout: float = 120.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"rollout server did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self) -> RolloutServerClient:
        return RolloutServerClient(self.url, self.api_key, timeout=60.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def _config(model_dir: str) -> str:
    """A server's config file: the actor and the rollout settings (the trainer's sampling keys travel with each
    request)."""
    path = os.path.join(os.path.dirname(model_dir), "server.yaml")
    with open(path, "w") as f:
        f.write(f"actor_model_name_or_path: {model_dir}\n")
    return path


@pytest.fixture(scope="module")
def server(micro):
    s = Server(micro["model"]).wait()
    try:
        yield s
    finally:
        s.stop()


def _engine(micro):
    from paddle_rl.models import Tokenizer, load_model
    from paddle_rl.rollout import RolloutEngine
    model = load_model(micro["model"])
    tokenizer = Tokenizer.from_pretrained(micro["model"])
    return RolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_ids), model


def _request(micro, n=3):
    from paddle_rl.rollout import SamplingParams, sample_key
    tokenizer = micro["tokenizer"]
    prompts = [tokenizer.encode(t) for t in ("Zoey says", "Oliver is a knave", "who is a knight?", "A")]
    keys = [sample_key(5, 1, f"p{i}", j) for i in range(len(prompts)) for j in range(n)]
    params = SamplingParams(max_dec_len=10, min_dec_len=1, temperature=1.0, top_p=0.9,
                            stop_token_ids=tokenizer.eos_token_ids)
    return prompts, keys, params


def _same(a, b, columns=("response_ids", "response_mask", "rollout_logp", "lengths", "truncated", "group", "sample",
                         "decode_steps")):
    for c in columns:
        assert a[c].dtype == b[c].dtype and a[c].shape == b[c].shape, c
        assert np.array_equal(a[c], b[c]), c
    assert [list(p) for p in a["prompt_ids"]] == [list(p) for p in b["prompt_ids"]]


def test_generate_equals_the_engine_and_weights_are_versioned(micro, server):
    """The batched endpoint returns the engine's StepBatch bit for bit, whole or split into two requests (the
    rollout is keyed per sample); a weight push changes what it generates and every row says its version."""
    from paddle_rl.models.pretrained import hf_state
    from safetensors.numpy import save
    engine, model = _engine(micro)
    prompts, keys, params = _request(micro)
    local = engine.generate(prompts, 3, params, keys)
    client = server.client()
    health = client.health()
    assert health["version"] is None and health["model"]["architecture"] == "Qwen2ForCausalLM"
    assert health["model"]["vocab_size"] == model.config.vocab_size
    whole = batch_from_rows(client.generate(prompts, 3, params, keys)["rows"], prompts, 3, engine.pad_id)
    _same(whole, local)
    assert (whole["policy_version"] == -1).all()
    # two servers' worth of requests: prompts 0, 2 and 1, 3, each with its own keys and global group ids, as JSON
    # rows and as safetensors columns
    rows, parts = [], []
    for share in ([0, 2], [1, 3]):
        args = ([prompts[g] for g in share], 3, params, [keys[g * 3 + j] for g in share for j in range(3)])
        rows += client.generate(*args, groups=share)["rows"]
        answer = client.generate(*args, groups=share, fmt="safetensors")
        assert answer["version"] is None and answer["stats"]["generate_s"] > 0
        parts.append(answer["columns"])
    _same(batch_from_rows(rows, prompts, 3, engine.pad_id), local)
    _same(batch_from_parts(parts, prompts, 3, engine.pad_id), local)
    # new weights (every tensor scaled): version 7 generates what the engine generates with them
    state = {k: (v * 1.5).astype(np.float32) for k, v in hf_state(model).items()}
    client.push_weights(save(state), 7)
    from paddle_rl.models import load_weights
    load_weights(model, state)
    pushed = batch_from_rows(client.generate(prompts, 3, params, keys)["rows"], prompts, 3, engine.pad_id)
    _same(pushed, engine.generate(prompts, 3, params, keys))
    assert not np.array_equal(pushed["rollout_logp"], local["rollout_logp"])
    assert (pushed["policy_version"] == 7).all() and client.health()["version"] == 7
    # a push whose tensors do not fit is refused naming the tensor; the server keeps version 7
    bad = dict(state)
    bad["model.norm.weight"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(RolloutServerError, match="model.norm.weight.*shape") as e:
        client.push_weights(save(bad), 8)
    assert not e.value.unreachable and client.health()["version"] == 7
    client.push_weights(save(hf_state(_engine(micro)[1])), 0)  # the original weights, for the other tests


def test_api_key_is_checked_before_the_body(micro, server):
    url = server.url
    # GET /health needs no key; every other request needs it, one with a body is refused before its body is read
    # (the declared 10 GB never arrive)
    assert httpx.get(url + "/health").json()["api_key_required"] is True
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    docs = httpx.get(url + "/docs").text   # the docs page and its assets need neither a key nor a CDN
    assert "/docs-assets/" in docs and "cdn." not in docs
    asset = docs.split('src="', 1)[1].split('"', 1)[0]
    assert httpx.get(url + asset).status_code == 200
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/weights HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n")
        s.settimeout(10.0)
        answer = b""
        while b"API key" not in answer:  # the server closes the connection after its answer
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 401") and "missing or wrong API key" in answer
    r = httpx.post(url + "/v1/generate", json={"prompts": [[1]], "n": 1}, headers={"X-API-Key": "wrong"})
    assert r.status_code == 401
    r = httpx.post(url + "/v1/generate", json={"prompts": [[1]], "n": 1, "params": {"temperature": 0.0}},
                   headers={"X-API-Key": KEY})
    assert r.status_code == 200 and len(r.json()["rows"]) == 1
    # bad requests name their field
    r = httpx.post(url + "/v1/generate", json={"prompts": [[1]], "n": 2, "params": {"temprature": 1.0}},
                   headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "temprature" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/generate", json={"prompts": [[1]], "n": 1, "params": {}}, headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "keys: required" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/generate", json={"prompts": [[10 ** 6]], "n": 1, "params": {"temperature": 0}},
                   headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    # a non-loopback address without a key is refused at start-up
    proc = subprocess.run([sys.executable, "-m", "paddle_rl", "rollout-server", _config(micro["model"]),
                           "--host", "0.0.0.0", "--port", str(free_port())], cwd=ROOT, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if k != "PADDLE_RL_ROLLOUT_API_KEY"})
    assert proc.returncode == 2 and "--host 0.0.0.0 is reachable from other machines" in proc.stderr


def test_openai_client(micro, server):
    """The `openai` package against /v1/completions and /v1/chat/completions: seeded samples repeat, greedy
    decoding is the engine's, stop strings cut the text, token ids come as an extension field."""
    openai = extra("openai")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    name = api.models.list().data[0].id
    assert name == "model"
    tokenizer = micro["tokenizer"]
    out = api.completions.create(model=name, prompt="Zoey says", n=3, max_tokens=8, temperature=1.0, seed=4,
                                 logprobs=0)
    again = api.completions.create(model=name, prompt="Zoey says", n=3, max_tokens=8, temperature=1.0, seed=4)
    assert len(out.choices) == 3 and [c.text for c in out.choices] == [c.text for c in again.choices]
    for c in out.choices:
        ids = c.model_extra["token_ids"]
        assert 1 <= len(ids) <= 8 and c.finish_reason in ("stop", "length")
        assert len(c.logprobs.token_logprobs) == len(ids) and all(v <= 0 for v in c.logprobs.token_logprobs)
        assert c.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in out.choices)
    assert out.model_extra["policy_version"] == server.client().health()["version"]
    # greedy: the engine's own greedy tokens
    from paddle_rl.rollout import SamplingParams
    engine, _ = _engine(micro)
    prompt = tokenizer.encode("Oliver is")
    want = engine.generate([prompt], 1, SamplingParams(max_dec_len=6, temperature=0.0))
    got = api.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
    assert got.choices[0].model_extra["token_ids"] == want["response_ids"][0, :int(want["lengths"][0])].tolist()
    # a stop string: the text ends before it
    text = got.choices[0].text
    assert len(text) > 2
    stop = text[1:3]
    cut = api.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    kept = cut.choices[0].model_extra["token_ids"]   # the tokens up to the one completing the stop string
    assert kept == got.choices[0].model_extra["token_ids"][:len(kept)]
    assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
    chat = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "Who is a knight?"}],
                                       max_tokens=5, temperature=0.7, seed=1, logprobs=True, n=2)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "Who is a knight?"}])
    assert chat.model_extra["prompt_token_ids"] == tokenizer.encode(templated)
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == len(chat.choices[0].model_extra["token_ids"])
    parts = api.chat.completions.create(model=name, max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "a knight?"}]}])
    assert parts.model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError, match="image_url are not supported"):
        api.chat.completions.create(model=name, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        api.completions.create(model=name, prompt="a", presence_penalty=0.5)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").completions.create(model=name, prompt="a")


def test_a_lora_path_is_served_merged(micro, tmp_path):
    """A config with lora_path: the server holds the base with the adapter merged in, and its greedy samples are
    the in-process engine's on the adapted model (its log-probs equal within rounding: merged in numpy there)."""
    import paddle
    from paddle_rl.models import LoraSettings, load_model
    from paddle_rl.models.lora import save_adapter
    from paddle_rl.models.pretrained import hf_state
    from paddle_rl.rollout import RolloutEngine, SamplingParams
    settings = LoraSettings(rank=4, alpha=8.0)
    adapted = load_model(micro["model"], lora=settings)
    paddle.seed(1)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            p.set_value(paddle.randn(p.shape, p.dtype) * 0.5)
    adapter = str(tmp_path / "adapter")
    save_adapter(adapter, hf_state(adapted, frozen=False), settings)
    tokenizer = micro["tokenizer"]
    engine = RolloutEngine(adapted, tokenizer.pad_token_id, tokenizer.eos_token_ids)
    prompts = [tokenizer.encode("Zoey says"), tokenizer.encode("Oliver")]
    params = SamplingParams(max_dec_len=8, temperature=0.0)
    want = engine.generate(prompts, 1, params)
    base = engine.bind(load_model(micro["model"])).generate(prompts, 1, params)
    s = Server(micro["model"], overrides=[f"lora_path={adapter}"]).wait()
    try:
        got = batch_from_rows(s.client().generate(prompts, 1, params)["rows"], prompts, 1, engine.pad_id)
    finally:
        s.stop()
    assert np.array_equal(got["response_ids"], want["response_ids"])
    assert np.allclose(got["rollout_logp"], want["rollout_logp"], atol=1e-5)
    assert not np.allclose(want["rollout_logp"], base["rollout_logp"], atol=1e-3)  # the adapter changes them


# ---------------------------------------------------------------------------------------------------- the trainer
def _overrides(micro, out, **extra_values):
    values = dict(do_eval=False, max_steps=3, save_steps=1000, kl_loss_coeff=0.05)
    values.update(extra_values)
    return micro_overrides(micro, str(out), **values)


def _rows(out, drop=()):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES + ("rollout_server/",) + drop)}
            for r in read_metrics(os.path.join(str(out), "metrics.jsonl"))]


def _train(overrides, before_take=None):
    from paddle_rl.trainer import RLTrainer
    trainer = RLTrainer(load_config(None, overrides))
    if before_take is not None:
        take = trainer.rollout.take

        def wrapped(step, draw):
            before_take(trainer, step)
            return take(step, draw)
        trainer.rollout.take = wrapped
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    from test_parallel import PLUGIN
    path = tmp_path_factory.mktemp("rewards") / "reward.py"
    path.write_text(PLUGIN)
    return str(path)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_on_a_server_equals_the_inline_run(micro, server, tmp_path, lora):
    """Same seeds, one server: every metric of 3 steps equals the inline run's (the server gets each step's
    weights, version = RL steps applied; the whole model in float32). A LoRA actor sends its adapters alone, which the
    server folds into its own base weights: the samples, and so every metric but the rollout-vs-trainer gap, are
    equal; the gap differs at rounding (the trainer's rollout multiplies by weights merged in Paddle, the server's
    were merged in numpy: rollout_corr/ratio/max 1.0000005 against 1.0)."""
    extra_values = dict(lora_rank=4, lora_alpha=8, learning_rate=1e-2) if lora else {}
    _train(_overrides(micro, tmp_path / "inline", **extra_values))
    versions = []
    trainer = _train(_overrides(micro, tmp_path / "server", rollout_server_urls=server.url,
                                rollout_server_api_key=KEY, **extra_values),
                     before_take=lambda t, step: versions.append(t.step))
    rows = read_metrics(str(tmp_path / "server" / "metrics.jsonl"))
    gap = ("rollout_corr/",) if lora else ()
    assert _rows(tmp_path / "server", gap) == _rows(tmp_path / "inline", gap) and len(rows) == 3
    for a, b in zip(_rows(tmp_path / "server"), _rows(tmp_path / "inline")):
        gaps = {k: (a[k], b[k]) for k in b if k.startswith("rollout_corr/") and not abs(a[k] - b[k]) < 1e-6}
        assert not gaps
    assert [r["rollout_server/resent_groups"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["time/weights_push"] > 0 for r in rows)
    assert versions == [0, 1, 2] and server.client().health()["version"] == 2
    assert trainer.rollout.gone == {}
    full = sum(int(np.prod(p.shape)) for p in _engine(micro)[1].parameters()) * 4
    pushed = [r["rollout_server/weights_push_bytes"] for r in rows]
    if lora:  # the adapters alone travel; the server folds them into its own copy of the base weights
        assert trainer.actor.lora is not None and all(b < full / 4 for b in pushed), (pushed, full)
    else:
        assert all(full < b < full + 2 ** 16 for b in pushed), (pushed, full)


def test_an_adapter_push_folds_into_the_same_base_only(micro, tmp_path):
    """A LoRA run pushes its adapters alone: a server whose own weights are not the trainer's base (the same
    model and tokenizer, every tensor x 1.01) refuses the first push naming the mismatch, and the run stops."""
    import shutil
    from safetensors.numpy import save_file
    from paddle_rl.model_files.safetensors_io import load_state
    folder = str(tmp_path / "other" / "model")
    shutil.copytree(micro["model"], folder)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(folder, name))
    save_file({k: (v * 1.01).astype(np.float32) for k, v in load_state(micro["model"]).items()},
              os.path.join(folder, "model.safetensors"))
    s = Server(folder).wait()
    try:
        with pytest.raises(RolloutServerError, match="other base weights than this server's") as e:
            _train(_overrides(micro, tmp_path / "run", max_steps=1, lora_rank=4, lora_alpha=8,
                              rollout_server_urls=s.url, rollout_server_api_key=KEY))
        assert s.url in str(e.value) and not e.value.unreachable
        assert s.client().health()["version"] is None   # nothing was loaded
    finally:
        s.stop()


def test_dynamic_sampling_rounds_on_a_server_equal_the_inline_run(micro, server, plugin, tmp_path):
    """DAPO's extra generation rounds of a step go to the server too (keys per round), pushing the weights once a
    step: the inline run's metrics, rounds included."""
    extra_values = dict(reward_plugins=plugin, reward_funcs="some_groups_flat", dynamic_sampling=True,
                        max_gen_batches=3, dynamic_sampling_fallback="keep", max_steps=2)
    _train(_overrides(micro, tmp_path / "inline", **extra_values))
    _train(_overrides(micro, tmp_path / "server", rollout_server_urls=server.url, rollout_server_api_key=KEY,
                      **extra_values))
    rows = _rows(tmp_path / "server")
    assert rows == _rows(tmp_path / "inline") and max(r["batch/gen_rounds"] for r in rows) > 1


def test_config_refuses_what_servers_cannot_do(micro, tmp_path):
    def problems(**values):
        with pytest.raises(ConfigError) as e:
            load_config(None, _overrides(micro, tmp_path, **values))
        return str(e.value)
    assert "rollout_server_urls: 'localhost:8732' is not an http:// or https:// URL" in problems(
        rollout_server_urls="localhost:8732")
    assert "a URL is listed twice" in problems(rollout_server_urls="http://a:1,http://a:1/")
    assert "rollout_server_urls: not with async_rollout" in problems(rollout_server_urls="http://a:1",
                                                                     async_rollout=True)
    assert "rollout_server_urls: not with env_plugin" in problems(rollout_server_urls="http://a:1", env_plugin="tools")
    assert "rollout_server_timeout: must be > 0" in problems(rollout_server_urls="http://a:1",
                                                             rollout_server_timeout=0)
    config = load_config(None, _overrides(micro, tmp_path, rollout_server_urls="http://a:1, https://b:2"))
    assert config.rollout_server_urls == ["http://a:1", "https://b:2"]


def test_start_up_faults_name_the_server(micro, server, tmp_path):
    # nobody listens on this port
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=f"rollout_server_urls: {dead} cannot be reached at start-up"):
        _train(_overrides(micro, tmp_path / "a", rollout_server_urls=f"{server.url},{dead}",
                          rollout_server_api_key=KEY))
    # a server of another model (hidden size 48, another vocabulary) is refused at first contact
    other = build_micro(str(tmp_path / "other"), hidden=48, seed=5)
    with open(os.path.join(other["model"], "tokenizer.json")) as f:
        vocab = json.load(f)
    vocab["model"]["vocab"]["renamed-token"] = vocab["model"]["vocab"].pop(next(iter(vocab["model"]["vocab"])))
    with open(os.path.join(other["model"], "tokenizer.json"), "w") as f:
        json.dump(vocab, f)
    s = Server(other["model"]).wait()
    try:
        with pytest.raises(ConfigError) as e:
            _train(_overrides(micro, tmp_path / "b", rollout_server_urls=s.url, rollout_server_api_key=KEY))
        message = str(e.value)
        assert s.url in message and "hidden_size: trainer 32, server 48" in message
        assert "tokenizer_vocab_sha256" in message
        # a dropped server that answers again with another model stays out of the run, the warning naming why
        from paddle_rl.trainer import RLTrainer
        trainer = RLTrainer(load_config(None, _overrides(micro, tmp_path / "d", rollout_server_urls=server.url,
                                                         rollout_server_api_key=KEY)))
        rollout = trainer.rollout
        rollout.clients.append(RolloutServerClient(s.url, KEY))
        rollout.gone[s.url] = "killed"
        assert rollout._rejoin() == 0 and [c.url for c in rollout.live] == [server.url]
        assert "hidden_size: trainer 32, server 48" in rollout.gone[s.url]
        rollout.close()
    finally:
        s.stop()
    # a wrong key is refused at start-up
    with pytest.raises(ConfigError, match=f"{server.url} refuses the trainer's API key .*HTTP 401"):
        _train(_overrides(micro, tmp_path / "c", rollout_server_urls=server.url, rollout_server_api_key="wrong"))


def test_a_server_that_stops_answering_is_dropped_after_the_timeout(micro, tmp_path):
    """A server stopped (SIGSTOP: it accepts connections, the kernel queues them, nothing answers) before step 2
    counts as gone once rollout_server_timeout passes: the run stops naming its URL and the timeout, instead of
    waiting for ever."""
    s = Server(micro["model"]).wait()
    try:
        def stop_before_step_2(trainer, step):
            if step == 2:
                s.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(RolloutServerError) as e:
            _train(_overrides(micro, tmp_path / "run", max_steps=2, rollout_server_urls=s.url,
                              rollout_server_api_key=KEY, rollout_server_timeout=2), before_take=stop_before_step_2)
        message = str(e.value)
        assert f"every rollout server is gone ({s.url})" in message and "Timeout" in message, message
        assert len(read_metrics(str(tmp_path / "run" / "metrics.jsonl"))) == 1
    finally:
        s.proc.send_signal(signal.SIGCONT)
        s.stop()


def test_a_killed_server_is_resent_rejoins_after_its_weights_and_losing_all_stops_the_run(micro, tmp_path):
    """Two servers. Step 2: kill -9 a while it generates; its groups go to b. Before step 3: a is restarted on its
    port; the probe between steps takes it back, and it loads version 2 before it gets any prompt. Before step 4:
    kill b (its push fails; a generates everything). Before step 5: kill a: the run stops naming both URLs. The
    four steps' metrics equal the inline run's (keyed per sample: who generates which group changes nothing)."""
    # 64 tokens per response (min_dec_len = max_dec_len), 4 prompts: a server's share takes long enough to be killed in
    long = dict(max_dec_len=64, min_dec_len=64, global_batch_size=4, global_mini_batch_size=2)
    a, b = Server(micro["model"], "--access-log"), Server(micro["model"])
    a.wait(), b.wait()
    try:
        _train(_overrides(micro, tmp_path / "inline", max_steps=4, **long))
        killed = {}

        def faults(trainer, step):
            if step == 2:
                def watch():  # kill a once step 2's weights are in and its share is queued or generating
                    probe = httpx.Client(timeout=5.0)
                    while a.proc.poll() is None:
                        health = probe.get(a.url + "/health").json()
                        if health["version"] == 1 and health["queued"] >= 1:
                            killed["queued"] = True
                            a.kill()
                            return
                        time.sleep(0.002)
                threading.Thread(target=watch, daemon=True).start()
            if step == 3:
                assert a.proc.poll() == -signal.SIGKILL and a.url in trainer.rollout.gone
                a.restart().wait()
                assert a.client().health()["version"] is None   # the config's weights, not the run's
            if step == 4:
                b.kill()
            if step == 5:
                a.kill()

        with pytest.raises(RolloutServerError) as e:
            _train(_overrides(micro, tmp_path / "servers", max_steps=5, rollout_server_urls=f"{a.url},{b.url}",
                              rollout_server_api_key=KEY, **long), before_take=faults)
        assert killed == {"queued": True}
        assert f"every rollout server is gone ({b.url}, {a.url})" in str(e.value)
        rows = read_metrics(str(tmp_path / "servers" / "metrics.jsonl"))
        assert [r["rollout_server/resent_groups"] for r in rows] == [0.0, 2.0, 0.0, 0.0]   # a's share: groups 0, 2
        assert [r["rollout_server/rejoined"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
        assert [r["rollout_server/servers_alive"] for r in rows] == [2.0, 1.0, 2.0, 1.0]
        assert _rows(tmp_path / "servers") == _rows(tmp_path / "inline")
        # the restarted a: the probe, then version 2's weights, then step 3's prompts; version 3, step 4's (all)
        log = a.output()
        posts = [line.split('"POST ')[1].split(" ")[0] for line in log.splitlines() if '"POST ' in line]
        assert posts == ["/v1/weights", "/v1/generate", "/v1/weights", "/v1/generate"], log
        assert log.index("weights version 2 loaded") < log.index('"POST /v1/generate')
        assert "weights version 3 loaded" in log
    finally:
        a.stop()
        b.stop()


def test_server_refuses_the_tensor_parallel_keys_it_cannot_honour(micro, tmp_path):
    """One process holds the whole model: a config asking to split it (a trainer's file with TP 2, or a rollout
    TP) is refused by name, never served unsplit without a word; set to 1, the same config serves."""
    from paddle_rl.rollout_server.cli import build_service
    overrides = micro_overrides(micro, str(tmp_path))
    for extra_keys in (["tensor_parallel_degree=2"], ["rollout_tensor_parallel_degree=2"],
                       ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]):
        with pytest.raises(ConfigError) as err:
            build_service(None, overrides + extra_keys)
        message = str(err.value)
        assert "a rollout server holds the whole model in one process and cannot split it" in message
        for key in extra_keys:
            assert key.replace("=", " ") in message and key.split("=")[0] + "=1" in message
    service, _ = build_service(None, overrides + ["tensor_parallel_degree=1"])
    assert service.identity["vocab_size"] > 0

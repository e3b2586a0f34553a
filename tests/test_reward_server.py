"""The reward server as a real process on 127.0.0.1, and the trainer-side client against it."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from urllib.parse import urljoin

import httpx
import numpy as np
import paddle
import pytest

from paddle_rl.config import RLConfig
from paddle_rl.rewards import RewardSample, RewardServerClient, RewardServerError, build_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KK_TRUTH = "(1) Zoey is a knight\n(2) Oliver is a knave"
KK_RIGHT = "Zoey is honest.</think>\n<answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer><|im_end|>"
KK_WRONG = "hmm</think><answer>(1) Zoey is a knave\n(2) Oliver is a knave</answer>"
KK_UNPARSED = "hmm</think><answer>Zoey is a knight</answer>"
KK_BAD = "<think>hmm</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>"

PLUGIN = textwrap.dedent('''
    import time

    def nap(completions, **kwargs):
        for c in completions:
            if "SLEEP" in c:
                time.sleep(60)
        return [1.0] * len(completions)

    def sleepy(completions, **kwargs):
        for c in completions:
            if "SLEEP" in c:
                time.sleep(60)
        return [0.0] * len(completions)

    def boom(completions, **kwargs):
        if any("BOOM" in c for c in completions):
            raise RuntimeError("cannot score this")
        return [0.0] * len(completions)
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "reward_server", "--port", str(self.port), *args],
                                     cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout=180.0):   # two servers with three workers start in 25-70 s on 2 busy cores
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"reward server exited ({self.proc.returncode}):\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("reward server did not come up")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugins") / "slow_rewards.py"
    plugin.write_text(PLUGIN)
    main = Server("--reward", "kk", "--plugin", str(plugin), "--workers", "2", "--sample-timeout", "1",
                  "--max-request-mb", "1",
                  "--route", "slow=nap", "--route", "boom=boom", "--route", "gsm8k=gsm8k", "--route", "math=math",
                  "--route", "fmt=format", "--route", "cos=cosine", "--route", "rep=repetition",
                  "--route", "long=soft_overlong",
                  "--set", "max_dec_len=100", "--set", "overlong_reward_buffer=20", "--set", "cosine_max_len=100")
    keyed = Server("--reward", "kk,sleepy", "--plugin", str(plugin), "--route", "slow=nap", "--workers", "1",
                   "--sample-timeout", "1", "--timeout-score", "-7", env={"PADDLE_RL_REWARD_API_KEY": "s3cret"})
    try:
        yield {"main": main.wait(), "keyed": keyed.wait()}
    finally:
        main.stop()
        keyed.stop()


def post(url, payload, **kw):
    return httpx.post(url, json=payload, timeout=30.0, **kw)


# ---------------------------------------------------------------------------------------------------- protocol

def test_paddlenlp_protocol_round_trip(servers):
    url = servers["main"].url
    responses = [KK_RIGHT, KK_WRONG, KK_UNPARSED, KK_BAD,
                 "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>ok</think><answer>(1) Zoey is a "
                 "knight\n(2) Oliver is a knave</answer><|im_end|>",
                 "<|im_start|>assistant\nok</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>"]
    r = post(url + "/", {"src": ["prompt"] * 6, "tgt": [KK_TRUTH] * 6, "response": responses})
    assert r.status_code == 200
    body = r.json()
    assert body["error_code"] == 0 and body["error_msg"] == "Success"
    assert body["score"] == [3.0, -0.5, -1.0, -3.0, 3.0, -3.0]
    empty = post(url + "/", {"src": [], "tgt": [], "response": []}).json()
    assert empty["error_code"] == 0 and empty["score"] == []


def test_bad_requests_get_error_codes(servers):
    url = servers["main"].url
    r = httpx.post(url + "/", content=b'{"src": ["a"], "tgt": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error_code"] == 1001 and "malformed JSON" in r.json()["error_msg"]
    r = post(url + "/", {"src": ["a", "b"], "tgt": ["x"], "response": ["r", "s"]})
    assert r.status_code == 400 and r.json()["error_code"] == 1001
    assert "equal lengths, got 2, 1 and 2" in r.json()["error_msg"]
    r = post(url + "/", {"src": ["a"], "tgt": ["x"]})
    assert r.status_code == 400 and "response" in r.json()["error_msg"]
    r = post(url + "/", {"src": ["a"], "tgt": ["x"], "response": [3]})
    assert r.status_code == 400 and r.json()["error_code"] == 1001
    big = "x" * (1024 * 1024 + 10)
    r = post(url + "/", {"src": ["a"], "tgt": ["x"], "response": [big]})
    assert r.status_code == 413 and r.json()["error_code"] == 1002
    # a scoring error names the function and the sample
    r = post(url + "/", {"src": ["a", "b"], "tgt": [KK_TRUTH, "no roles here"], "response": [KK_RIGHT, KK_RIGHT]})
    assert r.status_code == 422 and r.json()["error_code"] == 2001
    assert "'kk'" in r.json()["error_msg"] and "sample 1" in r.json()["error_msg"]
    r = post(url + "/v1/score", {"samples": [{"response": "x", "data_source": "boom"},
                                             {"response": "BOOM", "data_source": "boom"}]})
    assert r.status_code == 422 and "'boom'" in r.json()["error_msg"] and "slow_rewards.py" in r.json()["error_msg"]
    assert r.json()["failed_sample"] == 1
    assert httpx.get(url + "/openapi.json").json()["paths"]["/v1/score"]["post"]


def test_v1_rules_against_hand_numbers(servers):
    url = servers["main"].url
    samples = [
        {"response": KK_RIGHT, "tgt": KK_TRUTH},                                            # kk 3
        {"response": "so #### 1,234", "solution": "1234", "data_source": "gsm8k"},         # 1
        {"response": "the answer is 7", "solution": "7", "data_source": "gsm8k"},          # strict: 0
        {"response": "so \\boxed{\\frac{1}{2}}", "solution": "0.5", "data_source": "math"},  # 1
        {"response": "<answer>3</answer> \\boxed{2}", "solution": "2", "data_source": "math"},  # 0
        {"response": "x</think>\n<answer>1</answer><|im_end|>", "data_source": "fmt"},   # 1
        {"response": "x</think>\n<answer>1</answer> more", "data_source": "fmt"},        # 0
        {"response": "\\boxed{7}", "solution": "7", "response_length": 50, "data_source": "cos"},  # 0.75
        {"response": "\\boxed{8}", "solution": "7", "response_length": 50, "data_source": "cos"},  # -0.25
        {"response": "a b c a b c", "data_source": "rep"},                                  # -0.25
        {"response": "x", "response_length": 90, "data_source": "long"},                   # -0.5
        {"response": "x", "record": {"data_source": "long"}, "response_length": 70},       # 0
    ]
    r = post(url + "/v1/score", {"samples": samples})
    assert r.status_code == 200, r.text
    body = r.json()
    np.testing.assert_allclose(body["score"], [3, 1, 0, 1, 0, 1, 0, 0.75, -0.25, -0.25, -0.5, 0], atol=1e-6)
    assert body["per_function"]["kk"][0] == 3.0 and body["per_function"]["kk"][1] is None
    assert body["per_function"]["gsm8k"][1:3] == [1.0, 0.0]
    assert body["correct"][:5] == [True, True, False, True, False]


# ---------------------------------------------------------------------------------------------------- docs

class _AssetLinks(HTMLParser):
    """Every URL a docs page makes the browser load: script src, link href, img src, redoc spec-url, and the
    schema URL of Swagger UI's inline script."""

    def __init__(self):
        super().__init__()
        self.urls, self.scripts = [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href", "spec-url"):
            if attrs.get(name):
                self.urls.append(attrs[name])
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.scripts.append(data)
            self.urls += re.findall(r"\burl:\s*['\"]([^'\"]+)['\"]", data)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_are_served_without_internet(servers, page):
    """The docs pages load nothing from another host: every script, style, icon and the schema come from the
    server itself (FastAPI's defaults point at a CDN, which leaves the page blank offline)."""
    url = servers["main"].url
    r = httpx.get(url + page, timeout=10.0)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    links = _AssetLinks()
    links.feed(r.text)
    assert any(u.endswith("/openapi.json") for u in links.urls), links.urls
    assert any(u.endswith(".js") for u in links.urls), links.urls
    here = ("//" + url.split("//", 1)[1], url)
    off_host = [u for u in re.findall(r"(?:https?:)?//[^\s'\"<>)]+", r.text) if not u.startswith(here)]
    assert off_host == [], f"{page} refers to other hosts: {off_host}"
    for link in links.urls:
        absolute = urljoin(url + page, link)
        assert absolute.startswith(url + "/"), f"{page}: {link} is not on this server"
        asset = httpx.get(absolute, timeout=10.0)
        assert asset.status_code == 200 and len(asset.content) > 0, (link, asset.status_code)
    if page == "/docs":
        assert any(u.endswith(".css") for u in links.urls), links.urls
        assert '"validatorUrl": null' in r.text          # no schema URL sent to the online validator


# ---------------------------------------------------------------------------------------------------- load

def kk_request(k: int):
    """A request whose 4 samples have known scores, with names unique to request k."""
    a, b = f"Ann{k}", f"Bob{k}"
    truth = f"(1) {a} is a knight\n(2) {b} is a knave"
    variants = [(f"ok</think><answer>(1) {a} is a knight\n(2) {b} is a knave</answer>", 3.0),
                (f"ok</think><answer>(1) {a} is a knave\n(2) {b} is a knave</answer>", -0.5),
                (f"ok</think><answer>{a} is a knight</answer>", -1.0),
                (f"ok</think><answer>(1) {a} is a knight (2) {b} is a knave", -3.0)]
    rotate = k % 4
    variants = variants[rotate:] + variants[:rotate]
    # a response scored against another request's truth would score -1 (its names do not parse)
    payload = {"src": [f"q{k}"] * 4, "tgt": [truth] * 4, "response": [v[0] for v in variants]}
    return payload, [v[1] for v in variants]


def test_load_32_clients_200_requests_none_lost(servers):
    url = servers["main"].url + "/"
    jobs = [kk_request(k) for k in range(200)]
    with httpx.Client(timeout=30.0, limits=httpx.Limits(max_connections=32)) as client:
        def call(k):
            payload, expected = jobs[k]
            r = client.post(url, json=payload)
            return k, r.status_code, r.json(), expected
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=32) as pool:
            results = list(pool.map(call, range(200)))
        elapsed = time.monotonic() - start
    assert len(results) == 200
    seen = set()
    for k, status, body, expected in results:
        assert status == 200 and body["error_code"] == 0, body
        assert body["score"] == expected, (k, body["score"], expected)
        seen.add(k)
    assert seen == set(range(200))
    assert elapsed < 30.0, f"200 requests took {elapsed:.1f}s"


# ---------------------------------------------------------------------------------------------------- timeouts

def test_hung_scorer_hits_the_sample_timeout(servers):
    url = servers["main"].url
    start = time.monotonic()
    r = post(url + "/v1/score", {"samples": [{"response": "fine", "data_source": "slow"},
                                             {"response": "SLEEP please", "data_source": "slow"},
                                             {"response": KK_RIGHT, "tgt": KK_TRUTH}]})
    elapsed = time.monotonic() - start
    assert r.status_code == 422
    body = r.json()
    assert body["error_code"] == 2002 and body["failed_sample"] == 1
    assert "sample 1" in body["error_msg"] and "1s" in body["error_msg"]
    assert elapsed < 10.0
    # the server is still serving, with the hung worker replaced
    ok = post(url + "/", {"src": ["q"], "tgt": [KK_TRUTH], "response": [KK_RIGHT]}).json()
    assert ok["score"] == [3.0]
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health").json()["workers_alive"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    health = httpx.get(url + "/health").json()
    assert health["workers_alive"] == 2 and health["stats"]["timeouts"] >= 1


def test_api_key_and_timeout_score(servers):
    url = servers["keyed"].url
    payload = {"src": ["q"], "tgt": [KK_TRUTH], "response": [KK_RIGHT]}
    r = post(url + "/", payload)
    assert r.status_code == 401 and r.json()["error_code"] == 1003
    assert post(url + "/", payload, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post(url + "/", payload, headers={"Authorization": "Bearer s3cret"}).json()["score"] == [3.0]
    assert post(url + "/", payload, headers={"X-API-Key": "s3cret"}).json()["score"] == [3.0]
    assert httpx.get(url + "/health").json()["api_key_required"] is True
    # with --timeout-score the hung sample is scored -7 and reported, never silently
    r = post(url + "/v1/score", {"samples": [{"response": KK_RIGHT, "tgt": KK_TRUTH},
                                             {"response": "SLEEP", "data_source": "slow"}]},
             headers={"X-API-Key": "s3cret"})
    assert r.status_code == 200 and r.json()["score"] == [3.0, -7.0] and r.json()["timed_out"] == [1]
    # the client sends the key from the config
    client = RewardServerClient(url, api_key="s3cret", retries=0)
    assert client([RewardSample("q", KK_RIGHT, {"tgt": KK_TRUTH})]).scores.tolist() == [3.0]
    with pytest.raises(RewardServerError, match="HTTP 401"):
        RewardServerClient(url, api_key="nope", retries=0, on_failure="skip")(
            [RewardSample("q", KK_RIGHT, {"tgt": KK_TRUTH})])


def _raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 20.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head + body)
    return sock


def _read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never answers)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize("key_header", [b"", b"X-API-Key: wrong\r\n", b"Authorization: Bearer wrong\r\n"])
def test_wrong_key_is_refused_before_the_body_is_read(servers, key_header):
    """A request announcing a 30 MiB body but sending 12 bytes of it gets 401 at once: the key is checked from the
    headers (reading the body first would wait for the missing bytes until the socket's timeout)."""
    port = servers["keyed"].port

    def head(key_line):
        return (b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n" % (30 * 1024 * 1024) + key_line + b"\r\n")
    with _raw_request(port, head(key_header), b'{"samples": ') as sock:
        answer = _read_response(sock)
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized", answer[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error_code"] == 1003 and "API key" in body["error_msg"]
    # the right key with the same partial body: the server waits for the rest (nothing comes back yet)
    with _raw_request(port, head(b"X-API-Key: s3cret\r\n"), b'{"samples": ', timeout=1.0) as sock:
        with pytest.raises(socket.timeout):
            sock.recv(1)


def test_max_connections_refuses_past_the_cap():
    """--max-connections 2: while two connections are open (each with a request in flight), requests on further
    connections get 503 without waiting; once one closes, requests are served again."""
    server = Server("--reward", "kk", "--workers", "1", "--max-connections", "2").wait()
    payload = {"src": ["q"], "tgt": [KK_TRUTH], "response": [KK_RIGHT]}
    holders = []
    try:
        for _ in range(2):   # a served request first (the connection is the server's), then a body never finished
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=20.0)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            holders.append(sock)
        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(lambda _: httpx.post(server.url + "/", json=payload, timeout=20.0), range(6)))
        assert [r.status_code for r in answers] == [503] * 6, [r.text for r in answers]
        assert httpx.get(server.url + "/health", timeout=20.0).status_code == 503
        holders.pop().close()
        deadline, status = time.monotonic() + 20, None
        while time.monotonic() < deadline and status != 200:
            r = post(server.url + "/", payload)
            status = r.status_code
            time.sleep(0.05)
        assert status == 200 and r.json()["score"] == [3.0]
        # the trainer's client retries a 503 and gets its scores once a connection is free
        samples, expected = _kk_samples(4)
        client = RewardServerClient(server.url, retries=20, backoff=0.05, batch_size=1, max_concurrency=4)
        np.testing.assert_array_equal(client(samples).scores, expected)
    finally:
        for sock in holders:
            sock.close()
        server.stop()


def test_non_loopback_bind_needs_a_key_or_allow_no_key():
    from paddle_rl.config import ConfigError
    from reward_server.cli import check_bind
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_RL_REWARD_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "reward_server", "--host", "0.0.0.0", "--port", str(free_port()),
                           "--reward", "kk", "--workers", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--host 0.0.0.0" in proc.stderr and "--allow-no-key" in proc.stderr and "--api-key" in proc.stderr
    assert "Uvicorn running" not in proc.stderr
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"):
        with pytest.raises(ConfigError, match=rf"--host {re.escape(host)} .*--allow-no-key"):
            check_bind(host, "", False)
        check_bind(host, "s3cret", False)
        check_bind(host, "", True)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_bind(host, "", False)


@pytest.mark.parametrize("protocol", ["paddlenlp", "v1"])
def test_client_warns_about_timed_out_samples(servers, protocol, caplog):
    """Samples the server gave its --timeout-score are named in a warning (by their index in the whole batch),
    under the PaddleNLP protocol as under v1."""
    client = RewardServerClient(servers["keyed"].url, api_key="s3cret", retries=0, batch_size=2, protocol=protocol)
    samples = [RewardSample("q", KK_RIGHT, {"tgt": KK_TRUTH}), RewardSample("q", KK_WRONG, {"tgt": KK_TRUTH}),
               RewardSample("q", "SLEEP", {"tgt": KK_TRUTH})]
    with caplog.at_level("WARNING", logger="paddle_rl"):
        result = client(samples)
    assert result.scores.tolist() == [3.0, -0.5, -7.0] and result.skipped is None
    warnings = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(warnings) == 1 and "samples [2] timed out" in warnings[0] and servers["keyed"].url in warnings[0]


def test_client_refuses_soft_overlong_twice(servers):
    """enable_overlong_reward_buffer on the trainer side and a server applying soft_overlong: a configuration
    error naming both, even under reward_server_on_failure: skip."""
    sample = RewardSample("q", "x", {"data_source": "long"}, response_length=90)
    base = dict(use_rm_server=True, reward_server=servers["main"].url, reward_server_retries=0,
                reward_server_on_failure="skip", overlong_reward_buffer=20)
    assert build_reward(RLConfig(**base))([sample]).scores.tolist() == [-0.5]
    with pytest.raises(RewardServerError, match=r"'soft_overlong'.*enable_overlong_reward_buffer: true.*twice"):
        build_reward(RLConfig(**base, enable_overlong_reward_buffer=True))([sample])


# ---------------------------------------------------------------------------------------------------- client

def _kk_samples(n):
    out, expected = [], []
    for k in range(n):
        payload, scores = kk_request(k)
        out.append(RewardSample(payload["src"][0], payload["response"][k % 4], {"tgt": payload["tgt"][0]}, 40))
        expected.append(scores[k % 4])
    return out, expected


def test_client_matches_in_process_scores(servers):
    samples, expected = _kk_samples(21)
    config = RLConfig(use_rm_server=True, reward_server=servers["main"].url, per_device_reward_batch_size=4,
                      reward_server_retries=0)
    reward = build_reward(config)
    result = reward(samples)
    np.testing.assert_array_equal(result.scores, expected)
    np.testing.assert_array_equal(result.per_function["kk"], expected)
    np.testing.assert_array_equal(result.correct, np.array(expected) == 3.0)
    assert result.skipped is None
    local = build_reward(RLConfig(reward_funcs=["kk"]))(samples)
    np.testing.assert_array_equal(local.scores, result.scores)
    paddlenlp = RewardServerClient(servers["main"].url, batch_size=8, protocol="paddlenlp")(samples)
    np.testing.assert_array_equal(paddlenlp.scores, expected)
    # a scoring error is not retried and names the server
    bad = [RewardSample("q", KK_RIGHT, {"tgt": "no roles"})]
    with pytest.raises(RewardServerError, match=r"(?s)127\.0\.0\.1.*after 1 attempt:.*sample 0"):
        RewardServerClient(servers["main"].url, retries=3, backoff=5.0)(bad)


def test_killed_server_retries_then_fails_loudly():
    server = Server("--reward", "kk", "--workers", "1").wait()
    samples, expected = _kk_samples(6)
    base = dict(use_rm_server=True, reward_server=server.url, per_device_reward_batch_size=3,
                reward_server_retries=2, reward_server_backoff=0.05, reward_server_timeout=5.0)
    reward = build_reward(RLConfig(**base))
    skipping = build_reward(RLConfig(**base, reward_server_on_failure="skip"))
    np.testing.assert_array_equal(reward(samples).scores, expected)
    server.kill()
    start = time.monotonic()
    with pytest.raises(RewardServerError) as e:
        reward(samples)
    message = str(e.value)
    assert server.url in message and "after 3 attempts" in message and "ConnectError" in message
    assert message.count("attempt 3:") == 2            # both requests of the batch failed, each retried twice
    assert time.monotonic() - start < 5.0
    result = skipping(samples)
    assert result.skipped.all() and np.isnan(result.scores).all()
    assert result.metrics()["reward/skipped"] == 6.0


def test_broadcast_packing_round_trip():
    import pickle
    from paddle_rl.rewards.client import pack_result, unpack_result
    from paddle_rl.rewards.base import RewardResult
    result = RewardResult(np.array([3.0, -0.5], dtype=np.float32),
                          {"kk": np.array([3.0, -0.5]), "math": np.array([np.nan, 1.0])},
                          np.array([True, False]), np.array([False, True]))
    back, failure = unpack_result(pickle.loads(pickle.dumps(pack_result(result))))
    assert failure is None
    np.testing.assert_array_equal(back.scores, result.scores)
    assert list(back.per_function) == ["kk", "math"]
    np.testing.assert_array_equal(back.per_function["math"], [np.nan, 1.0])
    np.testing.assert_array_equal(back.correct, result.correct)
    np.testing.assert_array_equal(back.skipped, result.skipped)
    assert unpack_result(pack_result(None, "RewardServerError: down")) == (None, "RewardServerError: down")
    assert json.dumps(back.metrics())


BROADCAST_SCRIPT = textwrap.dedent('''
    import os
    import paddle.distributed as dist
    from paddle_rl.rewards import RewardSample, RewardServerClient

    dist.init_parallel_env()
    group = dist.new_group([0, 1])
    truth = "(1) Zoey is a knight\\n(2) Oliver is a knave"
    client = RewardServerClient(os.environ["REWARD_URL"], broadcast_group=group, retries=0)
    if dist.get_rank() != 0:
        client.url = "http://127.0.0.1:1"      # only the group's first rank may call the server
    result = client([RewardSample("q", "x</think><answer>(1) Zoey is a knight\\n(2) Oliver is a knave</answer>",
                                  {"tgt": truth}), RewardSample("q", "bad", {"tgt": truth})])
    print("RESULT", dist.get_rank(), result.scores.tolist(), result.correct.tolist(),
          {k: v.tolist() for k, v in result.per_function.items()}, flush=True)
    client.url = "http://127.0.0.1:1"
    try:
        client([RewardSample("q", "bad", {"tgt": truth})])
    except Exception as e:
        print("FAILED", dist.get_rank(), type(e).__name__, "connect" in str(e).lower(), flush=True)

    # the broadcast alone: the first rank's result, NaNs, skip marks and function names included
    import numpy as np
    from paddle_rl.rewards import RewardResult
    from paddle_rl.rewards.client import broadcast_result
    mine = RewardResult(np.array([np.nan, 1.5], dtype=np.float32),
                        {"gsm8k": np.array([np.nan, 1.0], dtype=np.float32),
                         "format": np.array([np.nan, 0.5], dtype=np.float32)},
                        np.array([False, True]), np.array([True, False]))
    if dist.get_rank() != 0:
        mine = RewardResult(np.zeros(2, dtype=np.float32), {"other": np.zeros(2, dtype=np.float32)})
    shared, failure = broadcast_result(mine, None, group)
    print("SHARED", dist.get_rank(), failure, np.nan_to_num(shared.scores, nan=-99).tolist(),
          {k: np.nan_to_num(v, nan=-99).tolist() for k, v in shared.per_function.items()},
          shared.correct.tolist(), shared.skipped.tolist(), flush=True)
''')


def test_tensor_parallel_group_broadcasts_rank0_scores(servers, tmp_path):
    if paddle.is_compiled_with_cuda():
        pytest.skip("the two-process check runs on a CPU build (gloo)")
    script = tmp_path / "broadcast.py"
    script.write_text(BROADCAST_SCRIPT)
    logs = tmp_path / "logs"
    env = {**os.environ, "REWARD_URL": servers["main"].url, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                           "--log_dir", str(logs), str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    text = "".join(p.read_text() for p in logs.iterdir() if p.is_file())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + text[-2000:]
    for rank in (0, 1):
        assert f"RESULT {rank} [3.0, -3.0] [True, False] {{'kk': [3.0, -3.0]}}" in text
        assert f"FAILED {rank} RewardServerError True" in text      # rank 1's error carries rank 0's reason
        assert (f"SHARED {rank} None [-99.0, 1.5] {{'gsm8k': [-99.0, 1.0], 'format': [-99.0, 0.5]}} "
                f"[False, True] [True, False]") in text


def test_cli_settings(tmp_path):
    import argparse
    from reward_server.cli import add_reward_server_subparser, settings_from_args
    parser = argparse.ArgumentParser(prog="paddle-rl")
    add_reward_server_subparser(parser.add_subparsers(dest="command"))
    fixture = os.path.join(ROOT, "tests", "fixtures", "paddlenlp_grpo_argument.yaml")
    args = parser.parse_args(["reward-server", "--config", fixture, "--reward", "math,format", "--weights", "1,0.5",
                              "--route", "kk=kk", "--set", "cosine_max_len=512", "--timeout-score", "-1"])
    assert args.host == "127.0.0.1" and args.port == 8731 and args.func.__name__ == "run_reward_server"
    settings = settings_from_args(args)
    values = settings.config_values
    assert values["reward_funcs"] == ["math", "format"] and values["reward_weights"] == [1.0, 0.5]
    assert values["reward_routes"] == {"kk": ["kk"]} and values["cosine_max_len"] == 512
    assert values["use_rm_server"] is False and settings.timeout_score == -1.0
    from paddle_rl.config import ConfigError
    with pytest.raises(ConfigError, match="reward_funcs: unknown reward function 'kkk' \\(did you mean 'kk'\\?\\)"):
        settings_from_args(parser.parse_args(["reward-server", "--reward", "kkk"]))
    with pytest.raises(ConfigError, match="soft_overlong.*enable_overlong_reward_buffer"):
        settings_from_args(parser.parse_args(["reward-server", "--reward", "kk,soft_overlong",
                                              "--set", "enable_overlong_reward_buffer=true"]))
    # the keys the rules declare where they register are checked here too (the server checks only reward keys)
    with pytest.raises(ConfigError, match="cosine_max_len: must be > 0 or -1, got 0"):
        settings_from_args(parser.parse_args(["reward-server", "--reward", "cosine", "--set", "cosine_max_len=0"]))


def test_sigterm_stops_the_server_and_leaves_nothing_in_tmpdir(tmp_path):
    """SIGTERM: the server shuts down, its workers stop and the process exits 0 through Python's exit handlers, so
    multiprocessing's forkserver folder (pymp-*, with its socket) is removed from TMPDIR (uvicorn raises the signal
    again after its shutdown; under the default handler the process ended before them)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = Server("--reward", "kk", "--workers", "1", env={"TMPDIR": str(tmp)}).wait()
    assert any(p.name.startswith("pymp-") for p in tmp.iterdir())   # the forkserver's folder, while it serves
    server.stop()
    assert server.proc.returncode == 0, server.proc.stdout.read()
    assert sorted(p.name for p in tmp.iterdir()) == []

"""Both HTTP servers (the reward server, the rollout server) as real processes on 127.0.0.1 with an API key and small
limits, against hostile clients on raw sockets (tools/hostile_clients.py): a request head or body trickled byte by
byte, a head too large, bodies over the limit, malformed JSON and safetensors, weight pushes of another shape or
dtype or without the key, and floods of idle connections. Each gets a named 4xx / 503 or is closed after its
stated timeout, and a well-behaved client is served meanwhile. The rate it keeps is measured by the tool itself
(docs/reliability.md), not here."""
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from hostile_clients import (REWARD_KEY, ROLLOUT_KEY, Polite, bad_safetensors, big_head, closed_by_server,
                             malformed_json, open_idle, oversized, post, reward_server, rollout_server, slow_body,
                             slow_head, status_of)

LIMITS = ("--header-timeout", "1", "--body-timeout", "1", "--max-connections", "8", "--max-header-kb", "4")
CAP = 8


@pytest.fixture(scope="module")
def servers(micro, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    reward = reward_server(*LIMITS, "--max-request-mb", "1", log=str(logs / "reward.log"))
    rollout = rollout_server(micro["model"], *LIMITS, "--max-request-mb", "1", "--max-weights-mb", "4",
                             "--max-queued", "1", log=str(logs / "rollout.log"))
    try:
        yield {"reward": reward.wait(), "rollout": rollout.wait()}
    finally:
        reward.stop()
        rollout.stop()


def _path(kind):
    return "/" if kind == "reward" else "/v1/generate"


def _key(kind):
    return REWARD_KEY if kind == "reward" else ROLLOUT_KEY


@pytest.mark.parametrize("kind", ["reward", "rollout"])
def test_a_trickled_head_is_closed_after_the_header_timeout(servers, kind):
    """Slowloris: a head one byte every 0.1 s gets 408 naming header_timeout after about 1 s, where uvicorn alone
    would wait for ever."""
    server = servers[kind]
    answer, seconds = slow_head(server.port, _path(kind), byte_delay=0.1, timeout=20.0)
    assert status_of(answer) == 408 and b"request head not complete after 1 s (header_timeout)" in answer, answer
    assert 0.9 < seconds < 5.0
    # a connection that sends nothing at all is closed after the same time, without an answer
    with socket.create_connection(("127.0.0.1", server.port), timeout=20.0) as sock:
        start = time.monotonic()
        assert sock.recv(100) == b"" and 0.9 < time.monotonic() - start < 5.0


@pytest.mark.parametrize("kind", ["reward", "rollout"])
def test_a_trickled_body_gets_408_and_without_the_key_401_at_once(servers, kind):
    server = servers[kind]
    body = b'{"prompts": [[1, 2]], "n": 1, "params": {"temperature": 0}}' if kind == "rollout" else None
    extra = {"body": body} if body else {}
    answer, seconds = slow_body(server.port, _path(kind), _key(kind), byte_delay=0.1, timeout=20.0, **extra)
    assert status_of(answer) == 408 and b"request body not complete after 1." in answer, answer
    assert b"body_timeout" in answer and 0.9 < seconds < 5.0
    # without the key the head alone is answered: the body is never waited for
    answer, seconds = slow_body(server.port, _path(kind), "wrong", byte_delay=0.5, timeout=20.0, **extra)
    assert status_of(answer) == 401 and seconds < 0.9, (answer, seconds)


@pytest.mark.parametrize("kind", ["reward", "rollout"])
def test_heads_and_bodies_over_the_limits(servers, kind):
    server = servers[kind]
    answer, _ = big_head(server.port, 64 * 1024)
    assert status_of(answer) == 431 and b"request head over 4096 bytes (max_header_bytes)" in answer, answer[:300]
    for declared in (True, False):   # a declared length is refused before reading; a chunked body once past 1 MiB
        answer, _ = oversized(server.port, _path(kind), _key(kind), 2 * 2 ** 20, declared=declared)
        assert status_of(answer) == 413 and b"exceeds the limit of 1048576 bytes" in answer, answer[:300]
    assert httpx.get(server.url + "/health", timeout=10.0).status_code == 200


@pytest.mark.parametrize("kind", ["reward", "rollout"])
def test_malformed_json_is_named(servers, kind):
    server = servers[kind]
    for what, body in malformed_json().items():
        r = post(server.url, _path(kind), body, _key(kind))
        assert r.status_code == 400, (what, r.text)
        message = r.json()["error_msg"] if kind == "reward" else r.json()["error"]["message"]
        if what == "nested 100000 deep":
            assert "recursion limit" in message, message
        elif what != "a list, not an object":
            assert "JSON" in message or "invalid request" in message, (what, message)
    assert Polite(kind, server.url).one()


@pytest.mark.parametrize("kind", ["reward", "rollout"])
def test_an_idle_flood_does_not_shut_out_a_polite_client(servers, kind):
    """5 x the cap of trickled heads and as many idle connections, opened while a polite client sends 20 requests
    on its keep-alive connection: every one of its requests is answered; the flood's connections are closed (to
    make room, or at the header timeout), a trickled head answered 408 or 503 naming the rule. uvicorn's own cap
    (limit_concurrency) answered the polite client 503 here."""
    server = servers[kind]
    before = httpx.get(server.url + "/health").json()["connections"]
    polite = Polite(kind, server.url)
    assert polite.one()
    answers, idle = [], []

    def trickle():
        answers.append(slow_head(server.port, _path(kind), byte_delay=0.05, timeout=20.0)[0])

    trickles = [threading.Thread(target=trickle) for _ in range(5 * CAP)]
    for t in trickles:
        t.start()
    ok = []
    for _ in range(20):
        idle += open_idle(server.port, 2)
        ok.append(polite.one())
        time.sleep(0.02)
    for t in trickles:
        t.join(30)
    assert ok == [True] * 20
    time.sleep(1.5)   # the header timeout closes what was not closed to make room
    assert closed_by_server(idle) == len(idle)
    statuses = [status_of(a) for a in answers]
    assert set(statuses) <= {408, 503}, statuses
    after = httpx.get(server.url + "/health").json()["connections"]
    assert after["evicted_idle"] > before["evicted_idle"]
    for s in idle:
        s.close()
    polite.client.close()   # its keep-alive connection would count against the cap below
    # the oldest idle connection makes room: CAP idle connections, then one more once they have waited 0.25 s
    # (idle_grace: header_timeout / 4): the first is closed at once, long before the header timeout
    time.sleep(1.5)
    first = open_idle(server.port, CAP)
    time.sleep(0.4)
    start = time.monotonic()
    extra = open_idle(server.port, 1)
    first[0].settimeout(5.0)
    assert first[0].recv(10) == b"" and time.monotonic() - start < 0.5
    assert closed_by_server(first[1:]) == 0
    for s in first + extra:
        s.close()


def test_connections_all_busy_get_a_named_503(servers):
    """With the cap's worth of keyed bodies in progress, a new connection is answered 503 naming the cap; once
    those bodies time out (1 s) the server serves again."""
    server = servers["reward"]
    held = []
    for _ in range(CAP):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=20.0)
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nX-API-Key: " + REWARD_KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        held.append(sock)
    time.sleep(0.2)
    r = httpx.get(server.url + "/health", timeout=10.0)
    assert r.status_code == 503 and "8 connections open (the cap, max_connections 8)" in r.text, r.text
    for sock in held:
        sock.settimeout(10.0)
        assert sock.recv(100).startswith(b"HTTP/1.1 408")
        sock.close()
    assert Polite("reward", server.url).one()


def _weights(url) -> dict:
    """The weights the server generates with, by name."""
    r = httpx.get(url + "/v1/weights", headers={"X-API-Key": ROLLOUT_KEY}, timeout=30.0)
    assert r.status_code == 200, r.text
    return load_safetensors(r.content)


def _bytes(state: dict) -> dict:
    return {name: (value.dtype, value.shape, value.tobytes()) for name, value in state.items()}


def _push(url, body: bytes, key=ROLLOUT_KEY, version="5") -> httpx.Response:
    headers = {"X-Policy-Version": version, "Content-Type": "application/octet-stream"}
    if key:
        headers["X-API-Key"] = key
    return httpx.post(url + "/v1/weights", content=body, headers=headers, timeout=30.0)


def test_weight_pushes_without_the_key_or_that_do_not_fit_change_nothing(servers):
    """The weights' bytes (GET /v1/weights) are the same after pushes without the key or with a wrong one, a body
    that is not safetensors, a float64 or float16 push, one with a tensor of another shape (the others scaled; the
    final norm is among the last parameters loaded, so a push checked as it is written would have replaced the
    layers before it), one lacking a tensor and one with a tensor the model does not
    have; every push is answered 400 / 401 naming why. A push that fits then changes them."""
    server = servers["rollout"]
    url = server.url
    assert httpx.get(url + "/v1/weights", timeout=10.0).status_code == 401
    state = _weights(url)
    original = _bytes(state)
    scaled = {k: v * 1.5 for k, v in state.items()}
    names = sorted(state)
    assert httpx.get(url + "/health").json()["version"] is None
    refused = {}
    for key in (None, "wrong"):
        refused[f"key {key}"] = _push(url, save_safetensors(scaled), key=key)
    for what, body in bad_safetensors().items():
        refused[what] = _push(url, body)
    for dtype in (np.float64, np.float16):
        refused[str(dtype)] = _push(url, save_safetensors({k: v.astype(dtype) for k, v in scaled.items()}))
    misshapen = dict(scaled)
    misshapen["model.norm.weight"] = np.zeros(7, np.float32)
    refused["shape"] = _push(url, save_safetensors(misshapen))
    refused["missing"] = _push(url, save_safetensors({k: v for k, v in scaled.items() if k != names[0]}))
    refused["unknown"] = _push(url, save_safetensors({**scaled, "model.extra.weight": np.zeros(2, np.float32)}))
    refused["version"] = _push(url, save_safetensors(scaled), version="seven")
    messages = {what: r.json()["error"]["message"] for what, r in refused.items()}
    statuses = {what: r.status_code for what, r in refused.items()}
    assert statuses == {what: 401 if what.startswith("key") else 400 for what in refused}, messages
    assert "missing or wrong API key" in messages["key None"]
    for what in bad_safetensors():
        assert "weights: the body is not a safetensors file" in messages[what], (what, messages[what])
    assert "is float64; a push holds float32 tensors" in messages["<class 'numpy.float64'>"]
    assert "is float16; a push holds float32 tensors" in messages["<class 'numpy.float16'>"]
    assert "model.norm.weight gives shape [7]" in messages["shape"], messages["shape"]
    assert f"lacks tensor {names[0]}" in messages["missing"]
    assert "model.extra.weight is not a tensor of this model" in messages["unknown"]
    assert "X-Policy-Version: expected an integer" in messages["version"]
    assert _bytes(_weights(url)) == original and httpx.get(url + "/health").json()["version"] is None
    # the check can fail: a push that fits changes the bytes; the original put back
    assert _push(url, save_safetensors(scaled), version="6").status_code == 200
    assert _bytes(_weights(url)) == _bytes(scaled) != original and httpx.get(url + "/health").json()["version"] == 6
    assert _push(url, save_safetensors(state), version="0").status_code == 200
    assert _bytes(_weights(url)) == original


def test_a_queue_past_max_queued_gets_503(servers, micro):
    """--max-queued 1: while one long generation holds the engine, a second request is answered 503 naming it."""
    url = servers["rollout"].url
    long = {"prompts": [[1, 2, 3]] * 2, "n": 4, "params": {"temperature": 0.0, "max_dec_len": 120,
                                                          "min_dec_len": 120}}
    answers = {}

    def first():
        answers["first"] = post(url, "/v1/generate", json.dumps(long).encode(), ROLLOUT_KEY)

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health").json()["queued"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    second = post(url, "/v1/generate", b'{"prompts": [[1]], "n": 1, "params": {"temperature": 0}}', ROLLOUT_KEY)
    t.join(60)
    assert answers["first"].status_code == 200
    assert second.status_code == 503 and "requests queued for the engine (max_queued 1)" in second.text, second.text

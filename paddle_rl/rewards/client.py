"""Scoring through an HTTP reward server, with timeouts, retries and no silent zeros.

Responses are sent `batch_size` at a time (per_device_reward_batch_size), several requests in flight. A request
is retried on connection errors, timeouts and HTTP 408/429/5xx, waiting backoff, 2*backoff, 4*backoff, ...
seconds; other 4xx answers and scoring errors are not retried. When a request still fails:

- on_failure="error" (default): RewardServerError naming the URL, the samples and every attempt.
- on_failure="skip": its samples come back with `skipped=True` and NaN scores (a warning is logged); the caller
  drops them. Configuration errors (401/403/404/413/400) raise even then.

Samples the server scored with its timeout score (`--timeout-score`, listed in `timed_out`) are logged as a
warning naming them, under either protocol.

Under tensor parallelism, pass `broadcast_group` (a paddle.distributed group): its first rank calls the server
and broadcasts the whole result (scores, per-function scores, correctness, skip marks) to the others, so every
rank of the group computes the same advantages (GDPO uses the per-function scores).
"""
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

import numpy as np

from ..parallel.watchdog import watched
from .base import RewardResult, RewardSample, concat_results

logger = logging.getLogger("paddle_rl")

API_KEY_ENV = "PADDLE_RL_REWARD_API_KEY"
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
SKIPPABLE_STATUS = {422}
OVERLONG_RULE, OVERLONG_KEY = "soft_overlong", "enable_overlong_reward_buffer"


class RewardServerError(RuntimeError):
    """The reward server could not score a batch; the message names the URL and each attempt."""


class _Failure(Exception):
    def __init__(self, message: str, retry: bool, skippable: bool = True):
        super().__init__(message)
        self.retry, self.skippable = retry, skippable


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _error_text(resp) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and ("error_msg" in body or "detail" in body):
            return f"error_code {body.get('error_code')}: {body.get('error_msg') or body.get('detail')}"
    except ValueError:
        pass
    return resp.text[:300]


class RewardServerClient:
    def __init__(self, url: str, batch_size: int = 8, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 1.0, on_failure: str = "error", protocol: str = "auto",
                 api_key: Optional[str] = None, broadcast_group=None, max_concurrency: int = 8,
                 overlong_in_objective: bool = False):
        if on_failure not in ("error", "skip"):
            raise ValueError(f"on_failure: expected error or skip, got {on_failure!r}")
        if protocol not in ("auto", "v1", "paddlenlp"):
            raise ValueError(f"protocol: expected auto, v1 or paddlenlp, got {protocol!r}")
        self.url = url
        self.batch_size = max(1, int(batch_size))
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.on_failure, self.protocol = on_failure, protocol
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.broadcast_group = broadcast_group
        self.max_concurrency = max(1, int(max_concurrency))
        # the objective applies the soft overlong penalty (enable_overlong_reward_buffer): a server that applies
        # it too (its soft_overlong function) is a configuration error, found from /v1/score's per_function
        self.overlong_in_objective = bool(overlong_in_objective)
        self._http = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config, broadcast_group=None) -> "RewardServerClient":
        return cls(config.reward_server, batch_size=config.per_device_reward_batch_size,
                   timeout=config.reward_server_timeout, retries=config.reward_server_retries,
                   backoff=config.reward_server_backoff, on_failure=config.reward_server_on_failure,
                   protocol=config.reward_server_protocol, api_key=config.reward_server_api_key or None,
                   broadcast_group=broadcast_group,
                   overlong_in_objective=bool(getattr(config, OVERLONG_KEY, False)))

    # ------------------------------------------------------------------------------------------ endpoints
    @property
    def v1_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/v1/score") else base + "/v1/score"

    def _client(self):
        with self._lock:
            if self._http is None:
                import httpx
                limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
                self._http = httpx.Client(timeout=self.timeout, limits=limits)
            return self._http

    def close(self):
        if self._http is not None:
            self._http.close()
            self._http = None

    def _headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def unreachable(self) -> Optional[str]:
        """None when an HTTP server answers at the URL (any status: a PaddleNLP-protocol server answers GET with
        405), else what went wrong, naming the URL. Connection errors are retried as a scoring request's are."""
        import httpx
        for attempt in range(self.retries + 1):
            try:
                with httpx.Client(timeout=min(self.timeout, 10.0)) as client:
                    client.get(self.url, headers=self._headers())
                return None
            except httpx.TransportError as e:
                failure = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        return f"no server answers at {self.url} ({failure}, {self.retries + 1} attempt(s))"

    # ------------------------------------------------------------------------------------------ one request
    def _post(self, url: str, payload: dict):
        import httpx
        body = json.dumps(payload, default=_jsonable, ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": "application/json", **self._headers()}
        try:
            resp = self._client().post(url, content=body, headers=headers)
        except httpx.TimeoutException as e:
            raise _Failure(f"timed out after {self.timeout:g}s ({type(e).__name__})", retry=True) from None
        except httpx.TransportError as e:
            raise _Failure(f"{type(e).__name__}: {e}", retry=True) from None
        return resp

    def _v1(self, samples: List[RewardSample]) -> Optional[Tuple[RewardResult, List[int]]]:
        payload = {"samples": [{"prompt": s.prompt, "response": s.response, "response_length": int(s.response_length),
                                "truncated": bool(s.truncated), "record": s.record} for s in samples]}
        resp = self._post(self.v1_url, payload)
        if resp.status_code in (404, 405) and self.protocol == "auto":
            return None
        body = self._checked(resp, len(samples))
        per = {name: np.array([np.nan if v is None else float(v) for v in values], dtype=np.float32)
               for name, values in (body.get("per_function") or {}).items()}
        if self.overlong_in_objective and OVERLONG_RULE in per:
            raise _Failure(f"the server applies the reward function {OVERLONG_RULE!r} and this run has {OVERLONG_KEY}: "
                           f"true: the DAPO soft overlong penalty would count twice; drop one of them",
                           retry=False, skippable=False)
        correct = body.get("correct")
        correct = None if correct is None else np.array(correct, dtype=bool)
        return RewardResult(np.array(body["score"], dtype=np.float32), per, correct), body["timed_out"]

    def _paddlenlp(self, samples: List[RewardSample]) -> Tuple[RewardResult, List[int]]:
        payload = {"src": [s.prompt for s in samples],
                   "tgt": [_label_text(s.ground_truth) for s in samples],
                   "response": [s.response for s in samples]}
        body = self._checked(self._post(self.url, payload), len(samples))
        return RewardResult(np.array(body["score"], dtype=np.float32)), body["timed_out"]

    def _checked(self, resp, n: int) -> dict:
        status = resp.status_code
        if status >= 400:
            retry = status in RETRY_STATUS
            raise _Failure(f"HTTP {status}: {_error_text(resp)}", retry=retry,
                           skippable=retry or status in SKIPPABLE_STATUS)
        try:
            body = resp.json()
        except ValueError:
            raise _Failure(f"HTTP {status}: not JSON: {resp.text[:200]!r}", retry=True) from None
        if not isinstance(body, dict):
            raise _Failure(f"HTTP {status}: expected a JSON object, got {type(body).__name__}", retry=False)
        if body.get("error_code", 0) != 0:
            raise _Failure(f"error_code {body.get('error_code')}: {body.get('error_msg')}", retry=False)
        scores = body.get("score")
        if not isinstance(scores, list) or len(scores) != n:
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise _Failure(f"expected {n} scores, got {got}", retry=False, skippable=False)
        for i, v in enumerate(scores):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise _Failure(f"score of sample {i} is {v!r}, not a finite number", retry=False, skippable=False)
        timed_out = body.get("timed_out")
        if timed_out is None:                          # absent from PaddleNLP's own server
            timed_out = []
        if not isinstance(timed_out, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                                      for i in timed_out):
            raise _Failure(f"timed_out is {timed_out!r}, not a list of sample indices below {n}", retry=False,
                           skippable=False)
        body["timed_out"] = timed_out
        return body

    def _request(self, samples: List[RewardSample]) -> Tuple[RewardResult, List[int]]:
        """The result of one request and the (request-local) indices of samples given the timeout score."""
        if self.protocol != "paddlenlp":
            result = self._v1(samples)
            if result is not None:
                return result
            logger.info("reward server %s has no /v1/score: using the PaddleNLP protocol (POST %s)", self.url, self.url)
            self.protocol = "paddlenlp"
        return self._paddlenlp(samples)

    def _score_chunk(self, samples: List[RewardSample], first: int) -> RewardResult:
        attempts, failure = [], None
        where = f"sample {first}" if len(samples) == 1 else f"samples {first}..{first + len(samples) - 1}"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                result, timed_out = self._request(samples)
            except _Failure as e:
                failure = e
                attempts.append(f"attempt {attempt + 1}: {e}")
                if not e.retry:
                    break
                continue
            if timed_out:
                logger.warning("reward server %s: samples %s timed out and got the server's timeout score",
                               self.url, [first + i for i in timed_out])
            return result
        message = (f"reward server {self.url} failed to score {where} after {len(attempts)} attempt"
                   f"{'s' if len(attempts) > 1 else ''}:\n  " + "\n  ".join(attempts))
        if self.on_failure == "skip" and failure.skippable:
            logger.warning("%s\n  -> %d samples marked skipped", message, len(samples))
            n = len(samples)
            return RewardResult(np.full(n, np.nan, dtype=np.float32), {}, None, np.ones(n, dtype=bool))
        raise RewardServerError(message)

    # ------------------------------------------------------------------------------------------ batch
    def score(self, samples: List[RewardSample]) -> RewardResult:
        """Score on this process (no broadcast)."""
        if not samples:
            return RewardResult(np.zeros(0, dtype=np.float32))
        starts = list(range(0, len(samples), self.batch_size))
        chunks = [(samples[s:s + self.batch_size], s) for s in starts]
        if len(chunks) == 1:
            parts = [self._score_chunk(*chunks[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks))) as pool:
                futures = [pool.submit(self._score_chunk, c, s) for c, s in chunks]
                errors, parts = [], []
                for f in futures:
                    try:
                        parts.append(f.result())
                    except RewardServerError as e:
                        errors.append(str(e))
                if errors:
                    raise RewardServerError("\n".join(errors))
        result = concat_results(parts)
        if result.skipped is not None and not result.skipped.any():
            result.skipped = None
        return result

    def __call__(self, samples: List[RewardSample]) -> RewardResult:
        group = self.broadcast_group
        if group is not None and _distributed_ready() and getattr(group, "nranks", 1) > 1:
            return self._score_and_broadcast(samples, group)
        return self.score(samples)

    # ------------------------------------------------------------------------------------------ tensor parallel
    def _score_and_broadcast(self, samples, group) -> RewardResult:
        import paddle.distributed as dist
        src = group.ranks[0]
        error, result = None, None
        if dist.get_rank() == src:
            try:
                result = self.score(samples)
            except Exception as e:  # noqa: BLE001 - re-raised after the others are told
                error = e
        shared, failure = broadcast_result(result, None if error is None else f"{type(error).__name__}: {error}",
                                           group)
        if error is not None:
            raise error
        if result is not None:
            return result
        if failure is not None:
            raise RewardServerError(f"reward server {self.url}: rank {src} of the tensor-parallel group failed to "
                                    f"score the batch: {failure}")
        if len(shared) != len(samples):
            raise RewardServerError(f"reward server {self.url}: rank {src} of the tensor-parallel group scored "
                                    f"{len(shared)} samples, this rank holds {len(samples)}")
        return shared


def _distributed_ready() -> bool:
    try:
        import paddle.distributed as dist
        return dist.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def pack_result(result: Optional[RewardResult], failure: Optional[str] = None) -> dict:
    """A picklable dict of a result (or of the failure message of the rank that could not score)."""
    if failure is not None or result is None:
        return {"failure": failure or "no result"}
    return {"failure": None, "scores": np.asarray(result.scores, dtype=np.float32),
            "per_function": {name: np.asarray(v, dtype=np.float32) for name, v in result.per_function.items()},
            "correct": None if result.correct is None else np.asarray(result.correct, dtype=bool),
            "skipped": None if result.skipped is None else np.asarray(result.skipped, dtype=bool)}


def unpack_result(packed: dict) -> Tuple[Optional[RewardResult], Optional[str]]:
    """Inverse of pack_result: (result, None), or (None, the failure message)."""
    if packed["failure"] is not None:
        return None, packed["failure"]
    return RewardResult(packed["scores"], dict(packed["per_function"]), packed["correct"], packed["skipped"]), None


def broadcast_result(result: Optional[RewardResult], failure: Optional[str], group) -> Tuple[Optional[RewardResult],
                                                                                          Optional[str]]:
    """The group's first rank's (result, failure message) on every rank of `group`: scores, per-function scores
    (names and NaNs included), correctness and skip marks, so ranks holding the same responses agree exactly.
    Every rank of the group must call it; the arguments of the other ranks are ignored."""
    import paddle.distributed as dist  # only where the trainer calls: reward-server workers run without Paddle

    src = group.ranks[0]
    payload = [pack_result(result, failure) if dist.get_rank() == src else None]
    with watched(f"broadcast of rewards from rank {src}", group):
        dist.broadcast_object_list(payload, src=src, group=group)
    return unpack_result(payload[0])


def _label_text(truth) -> Optional[str]:
    """A ground truth as the PaddleNLP protocol's text `tgt`: a string as it is, a one-item list its item, any other
    list or mapping as JSON (never Python's printed form, which no rule parses)."""
    if truth is None or isinstance(truth, str):
        return truth
    if isinstance(truth, list) and len(truth) == 1 and isinstance(truth[0], str):
        return truth[0]
    if isinstance(truth, (list, dict)):
        return json.dumps(truth, ensure_ascii=False)
    return str(truth)

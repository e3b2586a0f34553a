"""A client of one rollout server (`paddle-rl rollout-server`, paddle_rl/rollout_server/app.py): its health, a
weight push, a batched generation. Every failure is a RolloutServerError naming the URL; `unreachable` says whether
the server is gone (connection refused or reset, a timeout, a 5xx answer), which the trainer answers by sending
that server's prompt groups to the others, rather than a request the server refused (4xx), which stops the run.
"""
from typing import Optional

import httpx
import numpy as np

from .wire import generate_request, part_from_safetensors

VERSION_HEADER = "X-Policy-Version"
KIND_HEADER = "X-Weights-Kind"


def _slices(body: bytes, size: int = 16 * 2 ** 20):
    view = memoryview(body)
    for start in range(0, len(body), size):
        yield view[start:start + size]


class RolloutServerError(RuntimeError):
    """A rollout server failed a request; the message names its URL."""

    def __init__(self, message: str, url: str, unreachable: bool):
        super().__init__(message)
        self.url, self.unreachable = url, unreachable


class RolloutServerClient:
    def __init__(self, url: str, api_key: str = "", timeout: float = 3600.0, connect_timeout: float = 10.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=connect_timeout))
        self.version: Optional[int] = None   # the version this client last pushed

    def _request(self, method: str, path: str, doing: str, raw: bool = False, **kwargs):
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise RolloutServerError(f"rollout server {self.url}: {doing} failed: {type(e).__name__}: {e}", self.url,
                                     unreachable=True) from None
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            raise RolloutServerError(f"rollout server {self.url}: {doing} failed: HTTP {resp.status_code}: {message}",
                                     self.url, unreachable=resp.status_code >= 500)
        return resp.content if raw else resp.json()

    def health(self, timeout: Optional[float] = None) -> dict:
        """GET /health; `timeout`: seconds for this request alone (a probe of a dropped server), else the client's."""
        extra = {} if timeout is None else {"timeout": httpx.Timeout(timeout)}
        return self._request("GET", "/health", "GET /health", **extra)

    def check_key(self, timeout: Optional[float] = None) -> None:
        """GET /v1/models, which needs the API key (GET /health does not): a wrong or missing key is a 401."""
        extra = {} if timeout is None else {"timeout": httpx.Timeout(timeout)}
        self._request("GET", "/v1/models", "GET /v1/models (checking the API key)", **extra)

    def push_weights(self, body: bytes, version: int, kind: str = "full") -> dict:
        """`body`: a safetensors file (safetensors.numpy.save) of the whole model under Hugging Face names (`kind`
        full), or of a LoRA actor's adapters with metadata lora_scaling and base_sha256 (`kind` lora). Sent in
        16 MiB slices: handed one bytes object, httpx sent 256 MiB to a server on 127.0.0.1 in 10-20 s (25 MB/s),
        in slices in 0.6 s."""
        out = self._request("POST", "/v1/weights", f"pushing weights version {version}", content=_slices(body),
                            headers={VERSION_HEADER: str(version), KIND_HEADER: kind,
                                     "Content-Type": "application/octet-stream",
                                     "Content-Length": str(len(body))})
        if out.get("version") != version:
            raise RolloutServerError(f"rollout server {self.url}: pushing weights version {version}: the server "
                                     f"answered version {out.get('version')!r}", self.url, unreachable=False)
        self.version = version
        return out

    def generate(self, prompts, n: int, params, keys: Optional[np.ndarray] = None, groups=None,
                 fmt: str = "json") -> dict:
        """The answer to `prompts`, `n` samples each (rollout/wire.py): {"version", "rows", "stats"} in format
        json, {"version", "columns", "stats"} in format safetensors."""
        doing = f"generating {len(prompts)} prompt groups"
        body = generate_request(prompts, n, params, keys, groups, fmt)
        if fmt == "json":
            return self._request("POST", "/v1/generate", doing, json=body)
        return part_from_safetensors(self._request("POST", "/v1/generate", doing, raw=True, json=body))

    def close(self) -> None:
        self.http.close()

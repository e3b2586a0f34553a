"""The rollout server's FastAPI application: one RolloutEngine served over HTTP.

POST /v1/generate           the suite's batched endpoint (rollout/wire.py): prompt ids, n, sampling parameters,
                            per-sample keys, group ids -> each sample's tokens, log-probs, finish reason, length,
                            decode steps and the policy version that generated it
POST /v1/weights            a versioned weight push: the body is a safetensors file of the whole model under
                            Hugging Face names (a LoRA trainer sends its merged weights), the version in the header
                            X-Policy-Version; applied after the requests already queued, before the ones after it,
                            and only whole: a push refused for any tensor changes no weight
GET  /v1/weights            the weights the server generates with, as such a file (the version in its metadata)
GET  /health                the loaded policy version, the model's identity (architecture, vocabulary size and
                            hash, ...) and the engine's precision settings
POST /v1/completions        OpenAI-compatible (prompt text or token ids; n, temperature, top_p, max_tokens, stop,
POST /v1/chat/completions   logprobs, seed); the chat endpoint renders the model's own chat template. Extensions:
                            each choice's `token_ids`, the answer's `prompt_token_ids` and `policy_version`, and top_k,
                            repetition_penalty, min_tokens in the request
GET  /v1/models             the one model served

The request parsing and the answers of the OpenAI endpoints are rollout/openai_api.py's (shared with the agent proxy).
One thread runs the engine, so requests (and weight pushes) are served one at a time, in arrival order. Errors are
OpenAI's shape: {"error": {"message", "type", "code"}} with an HTTP status; the message names the field.
Every request but GET /health and the docs pages passes `RequestGate` first: the API key from the headers alone
(401 before a byte of a body is read), then the body up to the endpoint's limit (413) within its deadline (408).
Below it, http_guard.py's connection rules (request-head deadline and size, the connection cap).
"""
import asyncio
import json
import logging
import resource
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import paddle
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from ..http_auth import BodyTimeout, key_matches, read_body, replaying
from ..http_guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MIN_BODY_RATE, ConnectionLimits
from ..models import load_weights
from ..models.pretrained import hf_state, state_problem
from ..models.lora import adapted_modules, base_digest, fold_adapters, is_adapter_name
from ..model_files.safetensors_io import load_state
from ..rollout.openai_api import (CHAT_FIELDS, COMPLETION_FIELDS, RequestError, chat_logprobs, chat_messages,
                                  check_fields, check_tokens, choices_of, completion_logprobs, completion_prompts,
                                  openai_keys, render_chat, sampling_from_openai)
from ..rollout.sampling import SamplingParams
from ..rollout.wire import (FORMATS, WireError, batch_to_rows, batch_to_safetensors, keys_from_wire, model_identity,
                            params_from_wire)

logger = logging.getLogger("paddle_rl.rollout_server")

VERSION_HEADER = "X-Policy-Version"
KIND_HEADER = "X-Weights-Kind"   # full: the whole model; lora: adapters to fold into the actor's own weights
WEIGHT_KINDS = ("full", "lora")
WEIGHTS_PATH = "/v1/weights"
DOCS_ASSETS = "/docs-assets"   # Swagger UI / ReDoc files, served from the fastapi-offline package (no CDN)
OPEN_PATHS = ("/health", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")   # no key needed


@dataclass
class ServerSettings:
    max_request_bytes: int = 64 * 1024 * 1024      # JSON requests
    max_weights_bytes: int = 64 * 1024 ** 3        # a weight push
    api_key: str = ""
    served_model_name: str = "model"
    body_timeout: float = DEFAULT_BODY_TIMEOUT     # seconds for a body, plus 1 s per min_body_rate MiB received
    min_body_rate: float = DEFAULT_MIN_BODY_RATE   # MiB/s
    max_queued: int = 256                          # requests waiting for or on the engine thread; 503 beyond
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


def error_response(message: str, status: int, kind: str = "invalid_request_error", code=None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status,
                        headers=headers)


class RequestGate:
    """For every request but GET /health and the docs pages: the API key from the headers (401 without reading the
    body); then, for a request with a body, the body read up to its endpoint's limit (413 beyond; a declared
    Content-Length over it is refused before reading) within its deadline (408 past it: `read_body`) and handed
    on."""

    def __init__(self, app, limit: int, weights_limit: int, api_key: str = "", body_timeout: Optional[float] = None,
                 min_body_rate: float = DEFAULT_MIN_BODY_RATE):
        self.app, self.limit, self.weights_limit, self.api_key = app, limit, weights_limit, api_key
        self.body_timeout, self.min_body_rate = body_timeout, min_body_rate

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(DOCS_ASSETS + "/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and not key_matches(headers, self.api_key):
            response = error_response("missing or wrong API key (send Authorization: Bearer KEY or X-API-Key: KEY)",
                                      401, "authentication_error", headers={"Connection": "close"})
            return await response(scope, receive, send)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.weights_limit if path == WEIGHTS_PATH else self.limit
        try:
            body, oversize = await read_body(receive, headers, limit, self.body_timeout, self.min_body_rate)
        except BodyTimeout as e:
            response = error_response(str(e), 408, code="body_timeout", headers={"Connection": "close"})
            return await response(scope, receive, send)
        if oversize is not None:
            return await self._too_large(scope, receive, send, oversize, limit)
        if body is None:
            return
        scope = dict(scope, gate_body=body)   # the endpoints read it from here: no second copy
        return await self.app(scope, replaying(body, receive), send)

    @staticmethod
    async def _too_large(scope, receive, send, size, limit):
        response = error_response(f"request body of {size}+ bytes exceeds the limit of {limit} bytes", 413,
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


def _set_device(device: str) -> None:
    paddle.set_device(device)


class RolloutService:
    """The engine and its state; every call that touches the model runs on the one engine thread."""

    def __init__(self, engine, tokenizer, stop_ids, default_max_tokens: int, device: str = "cpu",
                 base_folder: Optional[str] = None):
        self.engine = engine
        self.base_folder = base_folder   # the actor's own weights (no lora_path): what adapter pushes fold into
        self._base = None                # its tensors, read at the first adapter push
        self._digests = {}               # modules -> base_digest of their base weights
        self.device = device
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.default_max_tokens = default_max_tokens
        self.identity = model_identity(engine.model.config, tokenizer)
        self.version = None   # None: the weights the server loaded; then the version of the last push
        # the engine thread computes on the model's device (set there too, in case Paddle keeps it per thread)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=_set_device, initargs=(device,))
        self.queued = 0
        self.served = {"generate_requests": 0, "samples": 0, "tokens": 0, "weight_pushes": 0}

    @property
    def engine_settings(self) -> dict:
        e = self.engine
        return {"rollout_dtype": e.rollout_dtype, "quant_type": e.quant_type, "kv_cache_dtype": e.kv_cache_dtype,
                "max_num_seqs": e.max_num_seqs, "max_cache_tokens": e.max_cache_tokens, "device": self.device}

    async def run(self, fn, *args):
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)
        finally:
            self.queued -= 1

    # ---------------------------------------------------------------- on the engine thread
    def generate(self, prompts, n: int, params: SamplingParams, keys, groups):
        start = time.perf_counter()
        version = self.version
        batch = self.engine.generate(prompts, n, params, keys, groups=groups)
        batch["policy_version"] = np.full(batch.size, -1 if version is None else version, dtype=np.int64)
        stats = dict(self.engine.stats, generate_s=time.perf_counter() - start,
                     peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        self.served["generate_requests"] += 1
        self.served["samples"] += batch.size
        self.served["tokens"] += int(batch["lengths"].sum())
        return batch, version, stats

    def load(self, body: bytes, version: int, kind: str = "full") -> float:
        """Every tensor checked (names, float32, shapes) before any weight is written: a refused push changes
        nothing."""
        start = time.perf_counter()
        try:
            state = load_safetensors(body)
        except Exception as e:  # noqa: BLE001 - the body is the client's: a 400 naming why
            raise RequestError(f"weights: the body is not a safetensors file ({e})") from None
        wrong = sorted(k for k, v in state.items() if v.dtype != np.float32)
        if wrong:   # never cast: the trainer sends float32 (a float64 / float16 / integer push is another client's)
            raise RequestError(f"weights: {wrong[0]} is {state[wrong[0]].dtype}; a push holds float32 tensors")
        if kind == "lora":
            state = self._fold(state, safetensors_metadata(body))
        problem = state_problem(self.engine.model, state, exact=kind == "full")
        if problem:
            raise RequestError(f"weights: {problem}")
        load_weights(self.engine.model, state)
        self.version = version
        self.served["weight_pushes"] += 1
        return time.perf_counter() - start


    def _fold(self, adapters: dict, metadata: dict) -> dict:
        """The whole model of an adapter-only push: the actor's own weights with W + B A * scaling folded into each
        adapted module, once the base the trainer's adapters train on (metadata base_sha256) is this one."""
        if not self.base_folder:
            raise RequestError("weights: this server holds no base weights to fold adapters into")
        other = sorted(k for k in adapters if not is_adapter_name(k))
        if other:
            raise RequestError(f"weights: an adapter push holds only lora_A / lora_B tensors, not {other[0]}")
        try:
            scaling = float(metadata["lora_scaling"])
            digest = metadata["base_sha256"]
        except (KeyError, ValueError) as e:
            raise RequestError(f"weights: an adapter push needs metadata lora_scaling and base_sha256 ({e})") from None
        if self._base is None:
            self._base = load_state(self.base_folder)
        modules = tuple(adapted_modules(adapters))
        missing = [m for m in modules if f"{m}.weight" not in self._base or f"{m}.lora_B.weight" not in adapters]
        if missing:
            raise RequestError(f"weights: adapters of {missing[0]}, which has no weight in {self.base_folder} or "
                               "no lora_B in the push")
        if modules not in self._digests:
            self._digests[modules] = base_digest(self._base, modules)
        if self._digests[modules] != digest:
            raise RequestError(f"weights: the trainer's adapters train on other base weights than this server's "
                               f"({self.base_folder}: sha256 {self._digests[modules][:16]}..., the trainer's "
                               f"{digest[:16]}...)")
        try:
            return {**self._base, **fold_adapters(self._base, adapters, scaling)}
        except ValueError as e:   # shapes that do not multiply
            raise RequestError(f"weights: {e}") from None


    def weights(self) -> bytes:
        """The weights the engine generates with, a safetensors file under Hugging Face names (float32), the version
        in its metadata."""
        version = "" if self.version is None else str(self.version)
        return save_safetensors(hf_state(self.engine.model), metadata={"version": version})


def safetensors_metadata(body: bytes) -> dict:
    """The `__metadata__` of a safetensors file's header (8 bytes of length, then JSON)."""
    size = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + size]).get("__metadata__") or {}


# ---------------------------------------------------------------- the application
def create_app(service: RolloutService, settings: ServerSettings) -> FastAPI:
    app = FastAPIOffline(title="paddle-rl rollout server", version="1.0",
                         description="A RolloutEngine over HTTP: batched keyed generation, versioned weight pushes, "
                                     "OpenAI-compatible completions.", static_url=DOCS_ASSETS,
                         swagger_ui_parameters={"validatorUrl": None})
    app.add_middleware(RequestGate, limit=settings.max_request_bytes, weights_limit=settings.max_weights_bytes,
                       api_key=settings.api_key, body_timeout=settings.body_timeout,
                       min_body_rate=settings.min_body_rate)
    vocab = service.identity["vocab_size"]

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return error_response(str(exc), exc.status, exc.kind, exc.code)

    async def json_body(request: Request) -> dict:
        raw = request.scope["gate_body"]
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"malformed JSON: {e}") from None
        except RecursionError:
            raise RequestError("malformed JSON: nested deeper than the parser's recursion limit") from None
        if not isinstance(body, dict):
            raise RequestError(f"expected a JSON object, got {type(body).__name__}")
        return body

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is not None and name != settings.served_model_name:
            raise RequestError(f"model: {name!r} is not served here (this server serves "
                               f"{settings.served_model_name!r})", 404, code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": service.version, "model": service.identity,
                "engine": service.engine_settings, "served_model_name": settings.served_model_name,
                "queued": service.queued, "served": dict(service.served),
                "api_key_required": bool(settings.api_key), "connections": dict(settings.connections.stats)}

    async def run(fn, *args):
        """`fn` on the engine thread, or 503 while `max_queued` requests wait for it."""
        if service.queued >= settings.max_queued:
            raise RequestError(f"server busy: {service.queued} requests queued for the engine (max_queued "
                               f"{settings.max_queued}); retry later", 503, "server_error", code="busy")
        return await service.run(fn, *args)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "paddle-rl"}]}

    @app.post("/v1/generate")
    async def generate(request: Request):
        body = await json_body(request)
        unknown = sorted(set(body) - {"prompts", "n", "params", "keys", "groups", "format"})
        if unknown:
            raise RequestError(f"unknown field(s): {', '.join(unknown)}")
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts or not all(
                isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompts):
            raise RequestError("prompts: expected a non-empty list of token-id lists")
        check_tokens(prompts, vocab)
        n = body.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"n: expected an integer >= 1, got {n!r}")
        groups = body.get("groups")
        if groups is not None and (not isinstance(groups, list) or len(groups) != len(prompts) or not all(
                isinstance(g, int) and not isinstance(g, bool) for g in groups)):
            raise RequestError(f"groups: expected {len(prompts)} integers (one per prompt)")
        try:
            params = params_from_wire(body.get("params", {}))
            keys = keys_from_wire(body.get("keys"), len(prompts) * n)
        except WireError as e:
            raise RequestError(str(e)) from None
        if keys is None and not params.greedy:
            raise RequestError("keys: required unless params.temperature is 0 (one per sample)")
        fmt = body.get("format") or "json"
        if fmt not in FORMATS:
            raise RequestError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        batch, version, stats = await run(service.generate, prompts, n, params, keys, groups)
        if fmt == "safetensors":
            return Response(batch_to_safetensors(batch, version, stats), media_type="application/octet-stream")
        return {"version": version, "rows": batch_to_rows(batch), "stats": stats}

    @app.post(WEIGHTS_PATH)
    async def weights(request: Request):
        raw = request.headers.get(VERSION_HEADER)
        try:
            version = int(raw)
        except (TypeError, ValueError):
            raise RequestError(f"{VERSION_HEADER}: expected an integer header, got {raw!r}") from None
        kind = request.headers.get(KIND_HEADER, "full")
        if kind not in WEIGHT_KINDS:
            raise RequestError(f"{KIND_HEADER}: expected one of {', '.join(WEIGHT_KINDS)}, got {kind!r}")
        body = request.scope["gate_body"]   # RequestGate's copy (Starlette's request.body() would make another)
        load_s = await run(service.load, body, version, kind)
        logger.info("weights version %d loaded (%s, %.1f MB, %.2f s)", version, kind, len(body) / 2 ** 20, load_s)
        return {"version": version, "load_s": load_s}

    @app.get(WEIGHTS_PATH)
    async def current_weights():
        return Response(await run(service.weights), media_type="application/octet-stream")

    async def complete(body: dict, prompts, chat: bool, logprobs: bool):
        check_tokens(prompts, vocab)
        default = service.default_max_tokens if chat else 16
        params, n, stops, seed = sampling_from_openai(body, service.tokenizer, service.stop_ids, default, chat)
        keys = openai_keys(seed, len(prompts), n, params.greedy)
        batch, version, _ = await run(service.generate, prompts, n, params, keys, None)
        return choices_of(service.tokenizer, batch, stops, logprobs, chat, prompts) + (version,)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        check_fields(body, COMPLETION_FIELDS)
        check_model(body)
        logprobs = completion_logprobs(body)
        prompts = completion_prompts(service.tokenizer, body.get("prompt"))
        choices, usage, version = await complete(body, prompts, False, logprobs)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": settings.served_model_name, "choices": choices, "usage": usage,
                "prompt_token_ids": prompts, "policy_version": version}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        check_fields(body, CHAT_FIELDS)
        check_model(body)
        messages = chat_messages(body)
        logprobs = chat_logprobs(body)
        text = render_chat(service.tokenizer, messages)
        prompts = [service.tokenizer.encode(text)]
        choices, usage, version = await complete(body, prompts, True, logprobs)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": settings.served_model_name, "choices": choices, "usage": usage,
                "prompt_token_ids": prompts[0], "policy_version": version}

    return app

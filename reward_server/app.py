"""The reward server's FastAPI application.

POST /          PaddleNLP protocol: {"src": [...], "tgt": [...], "response": [...]} ->
                {"error_code": 0, "error_msg": "Success", "score": [...]}
POST /v1/score  {"samples": [{"response": ..., "prompt": ..., "response_length": ..., "record": {...}, ...}]} ->
                total scores plus each reward function's scores and correctness
GET  /health    liveness, reward functions, worker state
GET  /docs, /redoc, /openapi.json   interactive docs and schema; their scripts and styles are served by this
                server (under /docs-assets), so they work without internet access

Error codes (the HTTP status says whether a retry can help):
  1001 invalid request (malformed JSON, wrong types, unequal list lengths)   400
  1002 request too large (bytes or samples)                                  413
  1003 missing or wrong API key                                              401
  1004 the body did not arrive in time (slow client)                         408
  2001 a reward function raised on a sample (the message names it)          422
  2002 a sample exceeded the per-sample time limit                           422
  2003 the scoring process died on a sample                                  500
  2004 too many samples waiting                                              503
"""
import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field

from paddle_rl.config import config_from_values
from paddle_rl.http_auth import BodyTimeout, key_matches, read_body, replaying
from paddle_rl.http_guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MIN_BODY_RATE, ConnectionLimits
from paddle_rl.rewards import build_local_reward

from .pool import ScoringFailure, ScoringPool

logger = logging.getLogger("reward_server")

INVALID, TOO_LARGE, UNAUTHORIZED, SLOW_BODY = 1001, 1002, 1003, 1004
SCORING_ERROR, TIMEOUT, CRASH, BUSY = 2001, 2002, 2003, 2004
FAILURE_CODES = {"error": (SCORING_ERROR, 422), "timeout": (TIMEOUT, 422), "crash": (CRASH, 500)}
SAMPLE_FIELDS = ("response", "prompt", "response_length", "truncated", "record")
DOCS_ASSETS = "/docs-assets"                 # Swagger UI / ReDoc files, served from the fastapi-offline package


@dataclass
class ServerSettings:
    config_values: dict                    # RLConfig keys for the reward functions (reward_funcs, ...)
    workers: int = 2
    sample_timeout: float = 10.0           # seconds per sample
    timeout_score: Optional[float] = None  # score of a timed-out sample; None: the request fails (2002)
    max_request_bytes: int = 32 * 1024 * 1024
    max_samples: int = 16384               # per request
    max_pending: int = 65536               # samples queued across requests
    api_key: str = ""
    body_timeout: float = DEFAULT_BODY_TIMEOUT     # seconds for a body, plus 1 s per min_body_rate MiB received
    min_body_rate: float = DEFAULT_MIN_BODY_RATE   # MiB/s
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


# ------------------------------------------------------------------------------------------------ schemas

class PaddleNLPRequest(BaseModel):
    src: List[Any] = Field(description="Prompts (chat-templated text), one per response.")
    tgt: List[Any] = Field(description="Labels / ground truths, one per response.")
    response: List[str] = Field(description="Decoded responses, special tokens kept.")


class PaddleNLPResponse(BaseModel):
    error_code: int = 0
    error_msg: str = "Success"
    score: List[float] = []
    timed_out: List[int] = Field(default=[], description="Samples that got the timeout score.")


class ScoreSample(BaseModel):
    model_config = ConfigDict(extra="allow")
    response: str = Field(description="Decoded response, special tokens kept.")
    prompt: Any = Field(default="", description="The prompt as the model saw it.")
    response_length: int = Field(default=0, description="Response length in tokens (cosine, soft_overlong).")
    truncated: bool = Field(default=False, description="Hit the length limit without EOS.")
    record: Dict[str, Any] = Field(default={}, description="The dataset record: solution / tgt / ground_truth, "
                                                            "data_source, extra fields. Other top-level keys of "
                                                            "the sample are added to it.")


class ScoreRequest(BaseModel):
    samples: List[ScoreSample]


class ScoreResponse(BaseModel):
    error_code: int = 0
    error_msg: str = "Success"
    score: List[float] = []
    per_function: Dict[str, List[Optional[float]]] = Field(
        default={}, description="Each reward function's unweighted score; null where it did not apply.")
    correct: Optional[List[Optional[bool]]] = None
    timed_out: List[int] = []


def error(code: int, message: str, status: int, headers: Optional[dict] = None, **extra) -> JSONResponse:
    return JSONResponse({"error_code": code, "error_msg": message, "score": [], **extra}, status_code=status,
                        headers=headers)


# ------------------------------------------------------------------------------------------------ request gate

class RequestGate:
    """Stands before the application for every request with a body (every method but GET / HEAD / OPTIONS): the
    API key is checked from the headers alone (401 without reading a byte of the body), then the body is read up
    to `limit` bytes (413 beyond; a declared Content-Length over the limit is refused before reading) within its
    deadline (408 past it: `read_body`) and handed on as JSON."""

    def __init__(self, app, limit: int, api_key: str = "", body_timeout: Optional[float] = None,
                 min_body_rate: float = DEFAULT_MIN_BODY_RATE):
        self.app, self.limit, self.api_key = app, limit, api_key
        self.body_timeout, self.min_body_rate = body_timeout, min_body_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and not key_matches(headers, self.api_key):
            response = error(UNAUTHORIZED, "missing or wrong API key (send Authorization: Bearer KEY or "
                                           "X-API-Key: KEY)", 401, headers={"Connection": "close"})
            return await response(scope, receive, send)
        try:
            body, oversize = await read_body(receive, headers, self.limit, self.body_timeout, self.min_body_rate)
        except BodyTimeout as e:
            response = error(SLOW_BODY, str(e), 408, headers={"Connection": "close"})
            return await response(scope, receive, send)
        if oversize is not None:
            return await self._too_large(scope, receive, send, oversize)
        if body is None:
            return
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
        scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])  # every endpoint takes JSON
        return await self.app(scope, replaying(body, receive), send)

    async def _too_large(self, scope, receive, send, size):
        response = error(TOO_LARGE, f"request body of {size}+ bytes exceeds the limit of {self.limit} bytes", 413,
                         headers={"Connection": "close"})   # the rest of the body is not read
        await response(scope, receive, send)


# ------------------------------------------------------------------------------------------------ app

def create_app(settings: ServerSettings, pool: Optional[ScoringPool] = None) -> FastAPI:
    """The application; its lifespan starts and stops the scoring pool."""
    scorer = build_local_reward(config_from_values(settings.config_values))  # fail at start-up on a bad configuration
    description = {"reward_funcs": [f"{n} x {w:g}" for n, w in zip(scorer.names, scorer.weights)],
                   "reward_routes": {k: [n for n, _ in v] for k, v in scorer.routes.items()}}
    del scorer

    @asynccontextmanager
    async def lifespan(app):
        app.state.pool = pool or ScoringPool(settings.config_values, settings.workers, settings.sample_timeout,
                                             settings.timeout_score, settings.max_pending)
        if pool is None:
            await asyncio.get_running_loop().run_in_executor(None, app.state.pool.start)
        logger.info("reward server ready: %s, %d workers, %gs per sample", description["reward_funcs"],
                    settings.workers, settings.sample_timeout)
        try:
            yield
        finally:
            if pool is None:
                await asyncio.get_running_loop().run_in_executor(None, app.state.pool.close)

    # FastAPI's /docs and /redoc load Swagger UI / ReDoc from a CDN (a blank page without internet access);
    # fastapi-offline serves the same pages with their JS, CSS and favicon from its package, under DOCS_ASSETS.
    # Swagger UI's online validator (a badge fetched from swagger.io with this server's schema URL) is off.
    app = FastAPIOffline(title="paddle-rl reward server", version="1.0", lifespan=lifespan,
                         description="Rule and plugin rewards over HTTP, PaddleNLP-compatible at POST /.",
                         static_url=DOCS_ASSETS, swagger_ui_parameters={"validatorUrl": None})
    app.add_middleware(RequestGate, limit=settings.max_request_bytes, api_key=settings.api_key,
                       body_timeout=settings.body_timeout, min_body_rate=settings.min_body_rate)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors()[:5]:
            if e.get("type") == "json_invalid":
                position = e.get("loc", ("body", "?"))[-1]
                problems.append(f"malformed JSON at character {position}: {(e.get('ctx') or {}).get('error', '')}")
                continue
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        return error(INVALID, "invalid request: " + "; ".join(problems), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 400:   # FastAPI's answer to a body json.loads raised on other than a syntax error
            return error(INVALID, f"invalid request: {exc.detail} (not JSON this server reads: nested deeper than "
                                  "the parser's recursion limit, or not UTF-8)", 400)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def score(request: Request, samples: List[dict]):
        if len(samples) > settings.max_samples:
            return None, error(TOO_LARGE, f"{len(samples)} samples exceed the limit of {settings.max_samples} "
                                          f"per request", 413)
        try:
            batch = request.app.state.pool.submit(samples)
        except OverflowError as e:
            return None, error(BUSY, f"server busy: {e}", 503)
        try:
            results = await asyncio.wrap_future(batch.future)
        except ScoringFailure as failure:
            code, status = FAILURE_CODES[failure.kind]
            logger.warning("request failed: %s", failure.message)
            return None, error(code, failure.message, status, failed_sample=failure.index)
        return results, None

    @app.post("/", response_model=PaddleNLPResponse,
              summary="Score responses (PaddleNLP protocol)")
    async def paddlenlp_score(request: Request, body: PaddleNLPRequest):
        lengths = (len(body.src), len(body.tgt), len(body.response))
        if len(set(lengths)) != 1:
            return error(INVALID, f"src, tgt and response must have equal lengths, got {lengths[0]}, {lengths[1]} "
                                  f"and {lengths[2]}", 400)
        samples = [{"prompt": src, "response": response, "record": {"src": src, "tgt": tgt}}
                   for src, tgt, response in zip(body.src, body.tgt, body.response)]
        results, failed = await score(request, samples)
        if failed is not None:
            return failed
        return {"error_code": 0, "error_msg": "Success", "score": [r.score for r in results],
                "timed_out": [i for i, r in enumerate(results) if r.timed_out]}

    @app.post("/v1/score", response_model=ScoreResponse,
              summary="Score records with per-function breakdowns")
    async def v1_score(request: Request, body: ScoreRequest):
        samples = []
        for s in body.samples:
            record = dict(s.record)
            record.update(s.model_extra or {})
            samples.append({"prompt": s.prompt, "response": s.response, "response_length": s.response_length,
                            "truncated": s.truncated, "record": record})
        results, failed = await score(request, samples)
        if failed is not None:
            return failed
        names = list(dict.fromkeys(n for r in results for n in r.per_function))
        per = {n: [r.per_function.get(n) for r in results] for n in names}
        has_correct = any(r.correct is not None for r in results)
        return {"error_code": 0, "error_msg": "Success", "score": [r.score for r in results], "per_function": per,
                "correct": [r.correct for r in results] if has_correct else None,
                "timed_out": [i for i, r in enumerate(results) if r.timed_out]}

    @app.get("/health", summary="Liveness and configuration")
    async def health(request: Request):
        pool = request.app.state.pool
        return {"status": "ok", **description, "workers": len(pool.workers), "workers_alive": pool.alive,
                "sample_timeout": pool.sample_timeout, "timeout_score": pool.timeout_score,
                "pending": pool.pending, "stats": dict(pool.stats), "api_key_required": bool(settings.api_key),
                "connections": dict(settings.connections.stats)}

    return app


"""`paddle-rl rollout-server CONFIG [key=value ...]`: load the actor the config names and serve its rollout engine
over HTTP (app.py). The config's model keys (actor_model_name_or_path, tokenizer_name_or_path, lora_path) and
rollout keys (rollout_max_num_seqs, rollout_kv_cache_tokens, rollout_dtype, kv_cache_dtype, rollout_quant_type,
max_dec_len as the chat endpoint's default max_tokens) are read; the trainer's sampling settings travel with each
request. Imports of Paddle and FastAPI wait until the command runs (`paddle-rl --help` stays light)."""
import logging
import os
import sys

from ..config import ConfigError, load_config
from ..errors import setup_error_types
from ..http_auth import bind_problem, is_loopback
from ..http_guard import add_limit_arguments, limits_from_args, serve

DEFAULT_PORT = 8732
API_KEY_ENV = "PADDLE_RL_ROLLOUT_API_KEY"


def add_rollout_server_subparser(subparsers):
    p = subparsers.add_parser("rollout-server", help="serve the rollout engine of a config's actor over HTTP",
                              description="Serve the rollout engine of the config's actor over HTTP: POST "
                                          "/v1/generate (batched, keyed per sample), POST /v1/weights (versioned "
                                          "pushes), OpenAI-compatible /v1/completions and /v1/chat/completions, "
                                          "GET /health (docs/rollout_server.md).")
    p.add_argument("config", nargs="?", default=None,
                   help="YAML argument file naming the actor (actor_model_name_or_path); optional with overrides "
                        "or flags (`swift rollout`'s --model M)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the file's keys")
    p.add_argument("--host", default="127.0.0.1",
                   help="Address to bind (default 127.0.0.1: this machine only). Any other address needs an API key, "
                        "or --allow-no-key.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port (default {DEFAULT_PORT}).")
    p.add_argument("--api-key", default=None,
                   help=f"Require this key (Authorization: Bearer KEY or X-API-Key: KEY); default ${API_KEY_ENV}.")
    p.add_argument("--allow-no-key", action="store_true",
                   help="Serve a non-loopback --host without an API key (anyone who can reach the port can generate "
                        "and replace the weights).")
    p.add_argument("--served-model-name", default=None,
                   help="The model name of the OpenAI endpoints (default: the actor folder's name).")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="Largest JSON request body (default 64 MiB).")
    p.add_argument("--max-weights-mb", type=float, default=65536.0,
                   help="Largest weight push (default 64 GiB).")
    p.add_argument("--max-queued", type=int, default=256, metavar="N",
                   help="Requests that may wait for the engine at once (default 256); beyond, HTTP 503.")
    add_limit_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="Log every request.")
    p.set_defaults(func=run_rollout_server, takes_overrides=True)
    return p


def build_service(config_path: str, overrides):
    """(RolloutService, the actor folder) of a config: its actor (a LoRA adapter of lora_path merged in), tokenizer
    and the rollout engine with the config's rollout settings."""
    # deferred: Paddle, the model code and FastAPI load when the server starts, not when the CLI builds its parser
    from ..models import Tokenizer, load_model
    from ..models.lora import merge_state
    from ..models.pretrained import hf_state, load_weights
    from ..ops import configure
    from ..parallel.device import select_device
    from ..rollout import EngineSettings, RolloutEngine
    from ..trainer.preflight import check_paths
    from .app import RolloutService

    config = load_config(config_path, overrides)
    split = [f"{key} {getattr(config, key)}" for key in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                                         "rollout_tensor_parallel_degree") if getattr(config, key) > 1]
    if split:  # not honoured here: refused, never served unsplit without a word
        raise ConfigError(f"{', '.join(split)}: a rollout server holds the whole model in one process and cannot "
                          f"split it; start it with {' '.join(k.split()[0] + '=1' for k in split)} (a trainer on "
                          "any layout sends it whole weights)")
    check_paths(config, data=False)
    device = select_device()   # the first visible GPU (CUDA_VISIBLE_DEVICES picks the server's), else the CPU
    configure(config.use_custom_ops)
    folder = config.actor_model_name_or_path
    model = load_model(folder)
    if config.lora_path:  # the engine holds a plain model: the adapter merged into its weights
        adapted = load_model(folder, adapter=config.lora_path)
        load_weights(model, merge_state(hf_state(adapted), adapted.lora))
        del adapted
    model.eval()
    for p in model.parameters():
        p.stop_gradient = True
    tokenizer = Tokenizer.from_pretrained(config.tokenizer_name_or_path or folder)
    stop_ids = sorted(set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids))
    if not stop_ids:
        raise ValueError(f"{config.tokenizer_name_or_path or folder}: no EOS token")
    engine = RolloutEngine(model, settings=EngineSettings.from_config(config, tokenizer.pad_token_id, stop_ids))
    return RolloutService(engine, tokenizer, stop_ids, config.max_dec_len, device, base_folder=folder), folder


def run_rollout_server(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("paddle_rl.rollout_server")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    problem = bind_problem(args.host, api_key, args.allow_no_key, "generate with the model and replace its weights",
                           API_KEY_ENV)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.max_queued < 1:
            raise ValueError(f"--max-queued: must be >= 1, got {args.max_queued}")
        connections, body_timeout, min_body_rate = limits_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        service, folder = build_service(args.config, args.overrides)
    except setup_error_types() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # deferred: FastAPI loads with the server, not with the parser
    from .app import ServerSettings, create_app
    settings = ServerSettings(max_request_bytes=int(args.max_request_mb * 2 ** 20),
                              max_weights_bytes=int(args.max_weights_mb * 2 ** 20), api_key=api_key,
                              served_model_name=args.served_model_name or os.path.basename(os.path.normpath(folder)),
                              body_timeout=body_timeout, min_body_rate=min_body_rate, max_queued=args.max_queued,
                              connections=connections)
    if not is_loopback(args.host) and not api_key:
        log.warning("serving %s without an API key (--allow-no-key): anyone who can reach this port can use the "
                    "server", args.host)
    identity = service.identity
    log.info("rollout server: %s (%s, vocab %d) from %s, engine %s, on %s:%d", settings.served_model_name,
             identity["architecture"], identity["vocab_size"], folder, service.engine_settings, args.host, args.port)
    serve(create_app(service, settings), args.host, args.port, log_level=args.log_level, access_log=args.access_log,
          **connections.uvicorn_options())
    return 0


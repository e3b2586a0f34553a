"""`paddle-rl reward-server` (also `python -m reward_server`): the HTTP reward server's command line.

The server depends on paddle_rl (config, rewards); paddle_rl's own command line imports this module lazily, so the
package paddle_rl never imports reward_server.
"""
import argparse
import logging
import os

from paddle_rl.config import ConfigError, config_from_values, parse_overrides
from paddle_rl.config.loader import read_values
from paddle_rl.http_auth import bind_problem, is_loopback
from paddle_rl.http_guard import add_limit_arguments, limits_from_args, serve
from paddle_rl.rewards.check import reward_config_errors
from paddle_rl.rewards.rules import rule_option_errors
from paddle_rl.rewards.client import API_KEY_ENV


def add_reward_server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to bind (default 127.0.0.1: this machine only). Any other address needs an API "
                             "key, or --allow-no-key.")
    parser.add_argument("--port", type=int, default=8731, help="Port (default 8731).")
    parser.add_argument("--reward", action="append", metavar="NAME[,NAME...]",
                        help="Reward functions to sum (repeatable or comma-separated; default: the config's "
                             "reward_funcs, else kk).")
    parser.add_argument("--weights", metavar="W[,W...]", help="Weights of the reward functions (default all 1).")
    parser.add_argument("--reward-model", metavar="FOLDER",
                        help="A *ForSequenceClassification checkpoint scored as the function reward_model (alone "
                             "when --reward is not given; each worker loads it).")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                        help="Python file whose functions become reward functions (repeatable).")
    parser.add_argument("--route", action="append", default=[], metavar="DATA_SOURCE=NAME[,NAME...]",
                        help="Score records with this data_source by these functions (repeatable).")
    parser.add_argument("--config", metavar="YAML", help="Read reward keys (reward_funcs, max_dec_len, cosine_*, "
                                                         "...) from a training config; other keys are ignored.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="Override a config key (repeatable), e.g. --set max_dec_len=2048.")
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                        help="Scoring processes (default min(4, CPUs)).")
    parser.add_argument("--sample-timeout", type=float, default=10.0,
                        help="Seconds one sample may take before its worker is replaced (default 10).")
    parser.add_argument("--timeout-score", type=float, default=None,
                        help="Score given to a timed-out sample (default: the request fails with error_code 2002).")
    parser.add_argument("--max-request-mb", type=float, default=32.0, help="Largest request body (default 32 MiB).")
    parser.add_argument("--max-samples", type=int, default=16384, help="Most samples in one request.")
    parser.add_argument("--api-key", default=None,
                        help=f"Require this key (Authorization: Bearer KEY or X-API-Key: KEY); default ${API_KEY_ENV}.")
    parser.add_argument("--allow-no-key", action="store_true",
                        help="Serve a non-loopback --host without an API key (anyone who can reach the port can use "
                             "the server and make it run its reward functions).")
    add_limit_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="Log every request.")
    return parser


def add_reward_server_subparser(subparsers):
    """Register `reward-server` on an argparse subparsers object; returns the new parser."""
    parser = subparsers.add_parser("reward-server", help="Serve rule / plugin rewards over HTTP.",
                                   description="Serve rule / plugin rewards over HTTP (PaddleNLP protocol at POST /, "
                                               "per-function scores at POST /v1/score, docs at /docs).")
    add_reward_server_arguments(parser)
    parser.set_defaults(func=run_reward_server)
    return parser


def _split(values):
    out = []
    for value in values or []:
        out += [v.strip() for v in str(value).split(",") if v.strip()]
    return out


def reward_config_values(config_path=None, overrides=None) -> dict:
    """Validated RLConfig keys for the reward functions: a YAML file's known keys plus overrides.

    Keys of other groups are read (max_dec_len, overlong_* matter to some rewards) but only the reward group is
    validated, so a training config without model paths serves as well.
    """
    # deferred: algorithms/ and rollout/ (Paddle) load when the server starts, their pieces and environments
    # declaring keys of a training config as they register (this process then holds Paddle; the workers, which get
    # the values read here, do not)
    import paddle_rl.algorithms  # noqa: F401
    import paddle_rl.rollout  # noqa: F401

    values, errors = read_values(config_path, dict(overrides or {}))
    values["use_rm_server"] = False
    if not errors:
        config = config_from_values(values)
        config._validate_reward(errors)
        errors += rule_option_errors(config)   # the keys the rules declare (cosine_max_len, repetition_n_grams, ...)
        if config.max_dec_len < 1:
            errors.append(f"max_dec_len: must be >= 1, got {config.max_dec_len}")
        if not errors:
            errors += reward_config_errors(config)   # function names (rules, plugins), overlong penalty once
    if errors:
        raise ConfigError("invalid reward server configuration:\n  " + "\n  ".join(errors))
    return values


def settings_from_args(args):
    # deferred: the application loads FastAPI, only when the server starts
    from .app import ServerSettings

    overrides = parse_overrides(args.overrides)
    if args.reward_model:
        overrides["reward_model_name_or_path"] = os.path.abspath(args.reward_model)
    if args.reward:
        overrides["reward_funcs"] = _split(args.reward)
    elif args.reward_model:
        overrides["reward_funcs"] = ["reward_model"]
    if args.weights:
        overrides["reward_weights"] = [float(w) for w in _split([args.weights])]
    if args.plugin:
        overrides["reward_plugins"] = [os.path.abspath(p) for p in args.plugin]
    if args.route:
        routes = dict(overrides.get("reward_routes") or {})
        for item in args.route:
            source, _, names = item.partition("=")
            if not source or not names:
                raise SystemExit(f"--route {item!r}: expected DATA_SOURCE=NAME[,NAME...]")
            routes[source.strip()] = _split([names])
        overrides["reward_routes"] = routes
    values = reward_config_values(args.config, overrides)
    if values.get("reward_plugins"):
        values["reward_plugins"] = [os.path.abspath(p) if p.endswith(".py") else p for p in values["reward_plugins"]]
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    if args.workers < 1:
        raise SystemExit("--workers: must be >= 1")
    if args.sample_timeout <= 0:
        raise SystemExit("--sample-timeout: must be > 0")
    connections, body_timeout, min_body_rate = limits_from_args(args)
    return ServerSettings(config_values=values, workers=args.workers, sample_timeout=args.sample_timeout,
                          timeout_score=args.timeout_score, max_request_bytes=int(args.max_request_mb * 1024 * 1024),
                          max_samples=args.max_samples, api_key=api_key, body_timeout=body_timeout,
                          min_body_rate=min_body_rate, connections=connections)


def check_bind(host: str, api_key: str, allow_no_key: bool) -> None:
    """A server reachable from other machines needs an API key unless --allow-no-key says otherwise (ConfigError)."""
    problem = bind_problem(host, api_key, allow_no_key, "make the server run its reward functions", API_KEY_ENV)
    if problem:
        raise ConfigError(problem)


def run_reward_server(args) -> int:
    # deferred: FastAPI loads when the server starts, not with the parser
    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("reward_server")
    try:
        settings = settings_from_args(args)
        check_bind(args.host, settings.api_key, args.allow_no_key)
        app = create_app(settings)
    except (ConfigError, ValueError) as e:
        log.error("%s", e)
        return 2
    if not is_loopback(args.host) and not settings.api_key:
        log.warning("serving %s without an API key (--allow-no-key): anyone who can reach this port can use the "
                    "server", args.host)
    serve(app, args.host, args.port, log_level=args.log_level, access_log=args.access_log,
          **settings.connections.uvicorn_options())
    return 0

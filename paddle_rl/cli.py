"""`paddle-rl train | sft | eval | score | data | convert | fetch | reward-server | rollout-server | bench | plot`."""
import argparse
import importlib
import json
import os
import subprocess
import sys

import yaml

from .config import OVERRIDE, ConfigError, config_and_overrides, load_config
from .env import configure_threads
from .errors import setup_error_types

# Subcommands registered by a module of their own: (name, module, function(subparsers), help if unavailable).
# When the module cannot be imported the subcommand still exists and, when run, stops naming what is missing.
REWARD_SERVER = ("reward-server", "reward_server.cli", "add_reward_server_subparser",
                 "serve rule / plugin rewards over HTTP")
ROLLOUT_SERVER = ("rollout-server", "paddle_rl.rollout_server.cli", "add_rollout_server_subparser",
                  "serve the rollout engine of a config's actor over HTTP")
BENCH = ("bench", "paddle_rl.bench", "add_bench_subparser", "time RL steps on a synthetic workload")
SCORE = ("score", "paddle_rl.score", "add_score_subparser",
         "score records that carry a response with the configured rewards")
CONVERT = ("convert", "paddle_rl.model_files.gguf_import", "add_convert_subparser",
           "convert a model file (GGUF) to a Hugging Face folder")
PLOT = ("plot", "paddle_rl.plot", "add_plot_subparser", "plot metrics of one or more runs side by side")
FETCH = ("fetch", "paddle_rl.model_files.hub", "add_fetch_subparser", "download and convert a known model once")
DATA_KK = ("kk", "paddle_rl.data.kk_cli", "add_kk_subparser", "generate Knights-and-Knaves puzzles")
DATA_ARITH = ("arith", "paddle_rl.data.arith", "add_arith_subparser", "addition problems in a model's chat template")
DATA_SHOW = ("show", "paddle_rl.data.show", "add_show_subparser",
             "print the first records of a config's datasets as the model sees them")
DATA_CONVERT = ("convert", "paddle_rl.data.convert", "add_convert_subparser",
                "convert GSM8K / MATH / NuminaMath files to the trainer's layouts")


def _unavailable_reason(module: str, error: ImportError) -> str:
    missing = getattr(error, "name", None) or module
    if missing.split(".")[0] in ("paddle_rl", "reward_server"):
        return f"cannot import {missing} ({error})"
    return f"the Python package {missing.split('.')[0]!r} cannot be imported ({error}); install it"


def _add_module_subcommand(subparsers, spec) -> None:
    name, module, function, help_text = spec
    try:
        register = getattr(importlib.import_module(module), function)
    except ImportError as e:
        reason = _unavailable_reason(module, e)
        p = subparsers.add_parser(name, help=f"{help_text} [unavailable: {reason}]",
                                  description=f"unavailable: {reason}")
        p.set_defaults(unavailable=f"{p.prog}: {reason}")
        return
    register(subparsers)


def _config_and_overrides(parser, args) -> None:
    """CONFIG is the one positional word that is not key=value (none: the run is given by overrides and flags
    alone); overrides keep their command-line order."""
    words = [w for w in (args.config, *args.overrides) if w is not None]
    configs, overrides = config_and_overrides(words)
    if len(configs) > 1 or not words:
        parser.error(f"{args.command}: expected a CONFIG file and / or key=value overrides and --key value flags, "
                     f"got {' '.join(words) or 'nothing'}")
    args.config, args.overrides = (configs or [None])[0], overrides


def _flag_value(values: list) -> str:
    """A flag's words as the text of a key=value override: none is true, one is itself (read as YAML), several a
    list (each read as YAML)."""
    if not values:
        return "true"
    if len(values) == 1:
        return values[0]
    return json.dumps([yaml.safe_load(v) if v.strip() else v for v in values])


def flags_as_overrides(argv: list, known: set) -> list:
    """`argv` with the `--key value [value ...]` flags no option of the command declares (other frameworks'
    spellings: ms-swift's `--num_generations 8`, `--reward_funcs accuracy format`, train.sh's `--model M`) written
    as key=value overrides, in their place. A flag takes the words after it up to the next `--option` or key=value
    (its first word always, `--system "a = b"`); `--key=value` is one word. CONFIG comes before the flags."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name, eq, first = word[2:].partition("=")
        if not word.startswith("--") or len(word) == 2 or word.split("=", 1)[0] in known:
            out.append(word)
            i += 1
            continue
        values, i = ([first] if eq else []), i + 1
        while not eq and i < len(argv) and not argv[i].startswith("--") and not (values and OVERRIDE.match(argv[i])):
            values.append(argv[i])
            i += 1
        out.append(f"{name}={_flag_value(values)}")
    return out


def _command_parser(parser, argv):
    """The sub-parser `argv` names (`data show` included), or None."""
    for word in argv[:2]:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or word not in action.choices:
            return None
        parser = action.choices[word]
        if parser.get_default("takes_overrides"):
            return parser
    return None


def _add_config_arguments(p, example: str) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="YAML argument file (PaddleNLP key names; ms-swift's and verl's are read too); optional "
                        "when the run is given by overrides and --key value flags")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help=f"overrides of the file's keys, anywhere on the command line, e.g. {example}")
    p.set_defaults(takes_overrides=True)


def _train(args) -> int:
    words = [w for w in (args.config, *args.overrides) if w is not None] + (["--sft"] if args.command == "sft" else [])
    if args.nproc_per_node > 1:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_rl.py")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc_per_node),
               "--log_dir", args.log_dir, script, *words]
        return subprocess.call(cmd)
    configure_threads()
    # deferred: run_rl loads the trainer and Paddle, only when training runs (after configure_threads)
    from .run_rl import main
    return main(words)


def _add_train(sub):
    for name, help_text, example in (
            ("train", "run GRPO / REINFORCE++ training from a YAML file", "rollout_n=4"),
            ("sft", "supervised fine-tuning on prompt / response records (a warm start for RL)", "max_steps=200")):
        p = sub.add_parser(name, help=help_text)
        _add_config_arguments(p, example)
        p.add_argument("--nproc_per_node", type=int, default=1,
                       help="processes (>1 goes through paddle.distributed.launch)")
        p.add_argument("--log_dir", default="log", help="per-rank logs of paddle.distributed.launch")
        p.set_defaults(func=_train)


def _eval(args) -> int:
    configure_threads()
    import json

    # deferred: the trainer loads Paddle, only when evaluation runs (after configure_threads)
    from .trainer.benchmark import run_benchmark
    from .trainer.evaluate import run_eval
    if args.write_responses is not None and os.path.isdir(args.write_responses):
        print(f"error: --write-responses: {args.write_responses} is a folder; name the JSONL file to write",
              file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, args.overrides)
        if args.benchmark is not None:
            metrics = run_benchmark(config, args.benchmark, limit=args.limit, samples=args.samples,
                                    write_responses=args.write_responses)
        elif args.limit != -1 or args.samples != 1:
            raise ConfigError("--limit / --samples: only with --benchmark (eval_datasets: max_eval_samples)")
        elif not config.eval_datasets:
            raise ConfigError("eval_datasets: required for evaluation")
        else:
            metrics = run_eval(config, write_responses=args.write_responses)
    except setup_error_types() as e:  # the message names the key / file: one line; anything else: traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, sort_keys=True))
    return 0


def _add_eval(sub):
    p = sub.add_parser("eval", help="greedy evaluation of a model folder on eval_datasets (accuracy, mean reward)")
    _add_config_arguments(p, "actor_model_name_or_path=output/checkpoint-60")
    p.add_argument("--write-responses", metavar="FILE", default=None,
                   help="write every response with its scores to FILE, one JSON object a line (the records of a "
                        "training run's eval_completions/step-N.jsonl); with --benchmark one record a sample: "
                        "task_id, prompt as the model saw it, completion, passed, failure kind")
    p.add_argument("--benchmark", choices=("humaneval", "gsm8k"), default=None,
                   help="a public benchmark instead of eval_datasets: its records (paddle-rl fetch humaneval | "
                        "gsm8k-test, cached), EvalPlus's instruct prompt (HumanEval) or verl's (GSM8K), scored by "
                        "the code rule in the sandbox or the gsm8k rule; prints pass@k and time per problem")
    p.add_argument("--limit", type=int, default=-1, metavar="N", help="--benchmark: the first N problems (-1: all)")
    p.add_argument("--samples", type=int, default=1, metavar="K",
                   help="--benchmark: samples per problem (1: greedy pass@1; K > 1: sampled with the config's "
                        "temperature / top_p, pass@1 and pass@K by the unbiased estimator)")
    p.set_defaults(func=_eval)


def _add_data(sub):
    p = sub.add_parser("data", help="build or convert datasets")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    _add_module_subcommand(data_sub, DATA_KK)
    _add_module_subcommand(data_sub, DATA_CONVERT)
    _add_module_subcommand(data_sub, DATA_ARITH)
    _add_module_subcommand(data_sub, DATA_SHOW)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paddle-rl", description="GRPO / REINFORCE++ for language models on Paddle.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_data(sub)
    _add_module_subcommand(sub, CONVERT)
    _add_module_subcommand(sub, FETCH)
    _add_module_subcommand(sub, REWARD_SERVER)
    _add_module_subcommand(sub, ROLLOUT_SERVER)
    _add_module_subcommand(sub, BENCH)
    _add_module_subcommand(sub, SCORE)
    _add_module_subcommand(sub, PLOT)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Like parse_args, except that train / eval take key=value overrides before and after options."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_parser(parser, argv)
    if command is not None:  # other frameworks' --key value flags become overrides (config/spellings.py reads them)
        argv = flags_as_overrides(argv, {o for a in command._actions for o in a.option_strings})
    args, extras = parser.parse_known_args(argv)
    if getattr(args, "unavailable", None):
        return args  # its options are unknown: the command only reports what is missing
    if getattr(args, "takes_overrides", False):
        unknown, overrides = config_and_overrides(extras)
        args.overrides = args.overrides + overrides
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides are written key=value)")
        _config_and_overrides(parser, args)
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if getattr(args, "unavailable", None):
        print(f"error: {args.unavailable}", file=sys.stderr)
        return 2
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

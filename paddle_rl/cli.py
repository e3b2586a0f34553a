"""`paddle-rl train | reward-server | data | eval | bench`."""
import argparse
import os
import subprocess
import sys

from .env import configure_threads


def _train(args) -> int:
    if args.nproc_per_node > 1:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_rl.py")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc_per_node),
               "--log_dir", args.log_dir, script, args.config, *args.overrides]
        return subprocess.call(cmd)
    configure_threads()
    from .run_rl import main
    return main([args.config, *args.overrides])


def _add_train(sub):
    p = sub.add_parser("train", help="run GRPO / REINFORCE++ training from a YAML file")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--nproc_per_node", type=int, default=1, help="processes (>1 goes through paddle.distributed.launch)")
    p.add_argument("--log_dir", default="log", help="per-rank logs of paddle.distributed.launch")
    p.set_defaults(func=_train)


def _eval(args) -> int:
    configure_threads()
    import json

    from .config import ConfigError, load_config
    from .data.loader import DatasetError
    from .trainer.evaluate import run_eval
    try:
        metrics = run_eval(load_config(args.config, args.overrides))
    except (ConfigError, DatasetError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, sort_keys=True))
    return 0


def _add_eval(sub):
    p = sub.add_parser("eval", help="greedy evaluation of a model folder on eval_datasets (accuracy, mean reward)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor_model_name_or_path=output/checkpoint-60")
    p.set_defaults(func=_eval)


def _add_data(sub):
    p = sub.add_parser("data", help="build or convert datasets")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    from .data.kk_cli import add_kk_subparser
    add_kk_subparser(data_sub)
    try:
        from .data.convert import add_convert_subparser
        add_convert_subparser(data_sub)
    except ImportError:
        pass


def _add_reward_server(sub):
    try:
        from .rewards.server_cli import add_reward_server_subparser
    except ImportError:
        return
    add_reward_server_subparser(sub)


def _add_bench(sub):
    try:
        from .bench import add_bench_subparser
    except ImportError:
        return
    add_bench_subparser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paddle-rl", description="GRPO / REINFORCE++ for language models on Paddle.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_data(sub)
    _add_reward_server(sub)
    _add_bench(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

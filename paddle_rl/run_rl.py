"""The script `python -m paddle.distributed.launch --nproc_per_node N paddle_rl/run_rl.py CONFIG [key=value ...]` runs."""
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

# after the thread settings of the launcher's process (paddle_rl/env.py), before Paddle loads
from paddle_rl.config import config_and_overrides, load_config  # noqa: E402
from paddle_rl.errors import setup_error_types  # noqa: E402
from paddle_rl.trainer import RLTrainer, SFTTrainer  # noqa: E402


def build_trainer(config_path, overrides, sft: bool = False):
    """Config -> RLTrainer (SFTTrainer with `sft`): every check that can fail before the first step (config,
    dashboards, paths, data, process grid, models)."""
    # the trainer is imported above: the algorithm's pieces (paddle_rl/algorithms) declare keys of the config as
    # they register
    config = load_config(config_path, overrides)
    return (SFTTrainer if sft else RLTrainer)(config)  # each starts with preflight: every missing prerequisite


def main(argv=None) -> int:
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog="run_rl.py", description="GRPO / REINFORCE++ training from a YAML file.")
    parser.add_argument("words", nargs="*", metavar="CONFIG | key=value",
                        help="YAML argument file (PaddleNLP key names; optional) and key=value overrides")
    parser.add_argument("--sft", action="store_true", help="supervised fine-tuning on prompt / response records")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    configs, overrides = config_and_overrides(args.words)
    if len(configs) > 1:
        parser.error(f"expected one CONFIG file and key=value overrides, got {' '.join(args.words)}")
    try:
        trainer = build_trainer(configs[0] if configs else None, overrides, sft=args.sft)
    except setup_error_types() as e:  # the message names the key / file / package: one line is enough
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer.train()  # anything raised from here on keeps its traceback
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1) > 1:
        # a multi-process run has written everything and its ranks passed a final barrier; the interpreter's
        # teardown of the gloo groups now and then aborts a rank (SIGABRT / SIGSEGV after all work is done),
        # which would turn a finished run into a failed one
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

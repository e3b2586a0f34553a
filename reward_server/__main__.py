"""`python -m reward_server --port 8731 --reward kk` (same options as `paddle-rl reward-server`)."""
import argparse
import sys

from .cli import add_reward_server_arguments, run_reward_server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reward_server",
                                     description="Serve paddle-rl rule / plugin rewards over HTTP.")
    add_reward_server_arguments(parser)
    return run_reward_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

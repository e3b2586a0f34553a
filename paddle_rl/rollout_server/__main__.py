"""`python -m paddle_rl.rollout_server CONFIG [key=value ...] --port 8732` (as `paddle-rl rollout-server`)."""
import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["rollout-server", *sys.argv[1:]]))

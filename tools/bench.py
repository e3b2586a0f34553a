"""Time RL steps of a synthetic workload through the real trainer (same as `paddle-rl bench`).

    python tools/bench.py --steps 3
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

from paddle_rl.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

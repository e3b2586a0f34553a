"""Throughput of rule rewards in process and through the reward server (samples per second).

    python tools/bench_reward_server.py --samples 4000 --batch 64 --concurrency 8 --workers 2

Starts `python -m reward_server` on a free 127.0.0.1 port for each reward (or uses --url), scores the same
samples through the trainer's client (RewardServerClient, /v1/score) and in process, checks that both agree,
and prints a table.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paddle_rl.config import RLConfig  # noqa: E402
from paddle_rl.rewards import RewardSample, RewardServerClient, build_reward  # noqa: E402

NAMES = ["Zoey", "Oliver", "Ava", "Liam", "Mia", "Noah", "Ella", "Jack"]


def kk_samples(n: int):
    out = []
    for k in range(n):
        people = NAMES[:2 + k % 5]
        roles = ["knight" if (k >> i) & 1 else "knave" for i in range(len(people))]
        truth = "\n".join(f"({i + 1}) {p} is a {r}" for i, (p, r) in enumerate(zip(people, roles)))
        guess = roles if k % 3 else roles[::-1]
        answer = "\n".join(f"({i + 1}) {p} is a {r}" for i, (p, r) in enumerate(zip(people, guess)))
        response = (f"Suppose {people[0]} is a knight; then ... statement {k} holds." * 4 +
                    f"</think>\n<answer>{answer}</answer><|im_end|>")
        out.append(RewardSample("<|im_start|>user\npuzzle<|im_end|>\n<|im_start|>assistant\n<think>", response,
                                {"tgt": truth}, response_length=200))
    return out


def math_samples(n: int):
    out = []
    for k in range(n):
        a, b = k % 17 + 1, k % 13 + 2
        shown = f"\\frac{{{a}}}{{{b}}}" if k % 2 else f"{a / b:.6f}"
        if k % 5 == 0:
            shown = f"\\frac{{{a + 1}}}{{{b}}}"
        response = f"Adding the parts gives {a}/{b}. So the answer is \\boxed{{{shown}}}.<|im_end|>"
        out.append(RewardSample("q", response, {"solution": f"\\frac{{{a}}}{{{b}}}"}, response_length=60))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(reward: str, workers: int):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "reward_server", "--port", str(port), "--reward", reward,
                             "--workers", str(workers), "--log-level", "warning"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"reward server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("reward server did not start")


def timed(fn, samples):
    start = time.perf_counter()
    result = fn(samples)
    return result, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=64, help="Samples per request (per_device_reward_batch_size).")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests in flight.")
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--rewards", default="kk,math")
    parser.add_argument("--url", help="Use this running server (serving the reward in --rewards) instead.")
    args = parser.parse_args(argv)

    rows = []
    for reward in [r.strip() for r in args.rewards.split(",") if r.strip()]:
        samples = (kk_samples if reward == "kk" else math_samples)(args.samples)
        local_fn = build_reward(RLConfig(reward_funcs=[reward]))
        local_fn(samples[:8])                                    # warm-up (math-verify's grammar)
        local, local_s = timed(local_fn, samples)
        rows.append((reward, "in process", len(samples), local_s))
        proc, url = (None, args.url) if args.url else start_server(reward, args.workers)
        try:
            client = RewardServerClient(url, batch_size=args.batch, retries=0, max_concurrency=args.concurrency)
            client(samples[:args.batch])                         # warm-up (connections, worker imports)
            remote, remote_s = timed(client, samples)
            client.close()
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        if not np.array_equal(local.scores, remote.scores):
            raise SystemExit(f"{reward}: server and in-process scores differ")
        rows.append((reward, f"server ({args.workers} workers, batch {args.batch}, {args.concurrency} in flight)",
                     len(samples), remote_s))
        print(f"{reward}: mean score {local.scores.mean():.3f}, accuracy {local.correct.mean():.3f}", flush=True)

    print(f"\n{'reward':8} {'mode':48} {'samples':>8} {'seconds':>8} {'samples/s':>10}")
    for reward, mode, n, seconds in rows:
        print(f"{reward:8} {mode:48} {n:8d} {seconds:8.2f} {n / seconds:10.0f}")


if __name__ == "__main__":
    main()

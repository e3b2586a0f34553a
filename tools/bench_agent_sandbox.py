"""The per-episode cost of the agent sandbox (env_plugin: agent, agent_sandbox): rollouts of the bundled agent
(configs/tiny_tool_agent.py on the tiny tool model's prompts), with and without the sandbox, alternated in one
process so that both see the same machine; milliseconds per episode (the rollout's wall time over its episodes).

    python tools/bench_agent_sandbox.py [--prompts 16] [--rounds 3] [--concurrency 1] [--as-nobody]
    python tools/bench_agent_sandbox.py --launch 40 [--as-nobody]

--concurrency 1 runs one program at a time (the sandbox's cost per episode, undiluted); a higher one is the
throughput of a step. --as-nobody: the same, run as uid 65534 (bubblewrap in a user namespace, the memory
watchdog instead of a cgroup; the compiled kernels off); an interpreter under /root is made reachable through
a mount namespace.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paddle_rl.models import Tokenizer, load_model  # noqa: E402
from paddle_rl.rollout import RolloutEngine, SamplingParams, sample_key  # noqa: E402
from paddle_rl.rollout.agents import AgentEnvironment, AgentSettings  # noqa: E402

TOOL = os.path.join(ROOT, "data", "tiny_tool")


def measure(prompts: int, rounds: int, concurrency: int) -> dict:
    tok = Tokenizer.from_pretrained(os.path.join(TOOL, "model"))
    model = load_model(os.path.join(TOOL, "model"))
    stops = sorted(set(tok.eos_token_ids) | set(model.config.eos_token_ids))
    engine = RolloutEngine(model, tok.pad_token_id, stops)
    records = [json.loads(line) for line in open(os.path.join(TOOL, "tool", "train.jsonl"))][:prompts]
    params = SamplingParams(max_dec_len=120, min_dec_len=1, temperature=1.0, stop_token_ids=stops)
    command = [sys.executable, os.path.join(ROOT, "configs", "tiny_tool_agent.py")]
    times = {True: [], False: []}
    failed = {True: 0, False: 0}
    for r in range(rounds + 1):   # round 0 warms up (imports, page cache) and is not counted
        for sandbox in (True, False):
            settings = AgentSettings(command, timeout=120, concurrency=concurrency, max_turns=3, max_prompt_len=48,
                                     vocab_size=tok.vocab_size, sandbox=sandbox)
            env = AgentEnvironment(settings, tok, stops, {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                          "min_dec_len": 1, "max_dec_len": 120})
            keys = [sample_key(7, r, f"b:{i}", 0) for i in range(len(records))]
            start = time.perf_counter()
            try:
                episodes = env.episodes(records, [x["src"] for x in records], [f"b:{i}" for i in range(len(records))],
                                        1)
                out = engine.generate([tok.encode(x["src"]) for x in records], 1, params, keys, episodes)
            finally:
                env.close()
            if r:
                times[sandbox].append((time.perf_counter() - start) * 1000 / len(records))
                failed[sandbox] += int(out["agent_failed"].sum())
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    sandboxed, plain = statistics.median(times[True]), statistics.median(times[False])
    return {"uid": os.geteuid(), "episodes_per_rollout": prompts, "rounds": rounds, "concurrency": concurrency,
            "ms_per_episode_sandbox": round(sandboxed, 1), "ms_per_episode_no_sandbox": round(plain, 1),
            "sandbox_cost_ms_per_episode": round(sandboxed - plain, 1),
            "all_sandbox": [round(t, 1) for t in times[True]], "all_no_sandbox": [round(t, 1) for t in times[False]],
            "failed": failed, "load_average": load, **peak_rss()}


def launch(count: int) -> dict:
    """The sandbox's own cost: `count` episodes each of a program that makes one request and ends, started through
    the agent environment with and without the sandbox (alternated), with the engine's generation left out (the
    requests are answered by a fixed empty answer: max_turns 0)."""
    tok = Tokenizer.from_pretrained(os.path.join(TOOL, "model"))
    program = os.path.join(tempfile.mkdtemp(prefix="paddle_rl_bench_agent_"), "one_request.py")
    os.chmod(os.path.dirname(program), 0o755)
    with open(program, "w") as f:
        f.write("import json, os, sys, urllib.request\njson.load(sys.stdin)\n"
                "r = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/completions', json.dumps({'prompt': 'a', "
                "'max_tokens': 1}).encode(), {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], "
                "'Content-Type': 'application/json'})\nurllib.request.urlopen(r).read()\n")
    os.chmod(program, 0o644)
    times = {True: [], False: []}
    envs = {}
    for sandbox in (True, False):
        settings = AgentSettings([sys.executable, "-S", program], timeout=60, concurrency=1, max_turns=0,
                                 max_prompt_len=48, vocab_size=tok.vocab_size, sandbox=sandbox)
        envs[sandbox] = AgentEnvironment(settings, tok, [tok.eos_token_ids[0]], {
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_dec_len": 1, "max_dec_len": 8})
    failed = 0
    try:
        for i in range(count + 2):   # the first two warm up
            for sandbox in (True, False):
                start = time.perf_counter()
                episodes = envs[sandbox].episodes([{}], ["a"], ["l:0"], 1)
                out = episodes.run(None, [[1]], 1, None, None, None, 0)
                if i >= 2:
                    times[sandbox].append((time.perf_counter() - start) * 1000)
                    failed += int(out["agent_failed"].sum())
    finally:
        for env in envs.values():
            env.close()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    sandboxed, plain = statistics.median(times[True]), statistics.median(times[False])
    return {"uid": os.geteuid(), "episodes": count, "ms_per_episode_sandbox": round(sandboxed, 1),
            "ms_per_episode_no_sandbox": round(plain, 1), "sandbox_cost_ms_per_episode": round(sandboxed - plain, 1),
            "sandbox_p10_p90": [round(statistics.quantiles(times[True], n=10)[i], 1) for i in (0, 8)],
            "no_sandbox_p10_p90": [round(statistics.quantiles(times[False], n=10)[i], 1) for i in (0, 8)],
            "failed": failed, "load_average": load, **peak_rss()}


def peak_rss() -> dict:
    """Peak resident memory of this process and of the largest program it started (MB)."""
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "largest_child_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}


def as_nobody(argv) -> int:
    """This script again, as uid 65534, with this interpreter reachable."""
    folder = tempfile.mkdtemp(prefix="paddle_rl_bench_agent_")
    os.chmod(folder, 0o755)
    os.chown(folder, 65534, 65534)
    command = ["bwrap", "--dev-bind", "/", "/"]
    prefix = os.path.realpath(sys.prefix)
    if prefix.startswith("/root/"):
        command += ["--tmpfs", "/root"]
        parts = prefix.split("/")[2:-1]
        for i in range(1, len(parts) + 1):
            command += ["--perms", "0755", "--dir", "/root/" + "/".join(parts[:i])]
        command += ["--ro-bind", prefix, prefix]
    # the compiled kernels off (built anew under this HOME they would take minutes): both sides of the comparison
    # run the same engine
    command += ["--chdir", ROOT, "--setenv", "HOME", folder, "--setenv", "PADDLE_RL_CUSTOM_OPS", "off", "--", "setpriv", "--reuid", "65534", "--regid", "65534",
                "--clear-groups", sys.executable, os.path.abspath(__file__)] + [a for a in argv if a != "--as-nobody"]
    return subprocess.call(command)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--launch", type=int, default=0, help="measure only the sandbox's own cost over this many "
                        "episodes of a one-request program, without generation")
    parser.add_argument("--as-nobody", action="store_true")
    args = parser.parse_args()
    if args.as_nobody:
        return as_nobody(sys.argv[1:])
    if args.launch:
        print(json.dumps(launch(args.launch)))
        return 0
    print(json.dumps(measure(args.prompts, args.rounds, args.concurrency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

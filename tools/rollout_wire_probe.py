"""What the rollout server's JSON answer costs against safetensors bytes, for one rollout's columns.

A batch of `--rows` responses of `--tokens` tokens each (random ids and log-probs, `--n` samples per prompt of 200
tokens) goes through the server's encoding (rollout/wire.py batch_to_rows + json.dumps) and the client's decoding
(json.loads + batch_from_rows, which pads the rows again), checked to give back the same columns bit for bit, and
the same columns through safetensors.numpy save / load. Prints sizes and the best of 5 times of each.
Usage: python tools/rollout_wire_probe.py [--rows 64] [--tokens 1024] [--n 8]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
from safetensors.numpy import load, save  # noqa: E402

from paddle_rl.batch import rollout_batch  # noqa: E402
from paddle_rl.rollout.wire import batch_from_rows, batch_to_rows  # noqa: E402


def best(fn, repeats: int = 5):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, width, n = args.rows, args.tokens, args.n
    prompts = [rng.integers(0, 50000, 200).tolist() for _ in range(rows // n)]
    batch = rollout_batch([prompts[i // n] for i in range(rows)], rng.integers(0, 50000, (rows, width)),
                          np.ones((rows, width), np.float32), -5 * rng.random((rows, width), dtype=np.float32),
                          np.full(rows, width, np.int64), np.zeros(rows, bool), 0, [i // n for i in range(rows)],
                          [i % n for i in range(rows)])
    batch["decode_steps"] = np.full(rows, width, np.int64)
    batch["policy_version"] = np.zeros(rows, np.int64)
    encode_s, text = best(lambda: json.dumps({"version": 0, "rows": batch_to_rows(batch), "stats": {}}))
    decode_s, back = best(lambda: batch_from_rows(json.loads(text)["rows"], prompts, n, 0))
    for key in ("response_ids", "rollout_logp", "response_mask", "lengths", "decode_steps"):
        assert np.array_equal(back[key], batch[key]), key
    columns = {k: np.asarray(batch[k]) for k in ("response_ids", "rollout_logp", "response_mask", "lengths", "group",
                                                  "sample", "decode_steps", "policy_version")}
    columns["truncated"] = batch["truncated"].astype(np.uint8)
    st_encode_s, blob = best(lambda: save(columns))
    st_decode_s, _ = best(lambda: load(blob))
    print(json.dumps({"rows": rows, "tokens": width, "json_mib": round(len(text) / 2 ** 20, 2),
                      "json_encode_ms": round(encode_s * 1e3, 1), "json_decode_ms": round(decode_s * 1e3, 1),
                      "safetensors_mib": round(len(blob) / 2 ** 20, 2),
                      "safetensors_encode_ms": round(st_encode_s * 1e3, 2),
                      "safetensors_decode_ms": round(st_decode_s * 1e3, 2)}))


if __name__ == "__main__":
    main()

"""What the rollout server's JSON answer costs against safetensors bytes, for one rollout's columns.

A batch of `--rows` responses of `--tokens` tokens each (random ids and log-probs, `--n` samples per prompt of 200
tokens) goes through the server's encoding (rollout/wire.py batch_to_rows + json.dumps) and the client's decoding
(json.loads + batch_from_rows, which pads the rows again), checked to give back the same columns bit for bit, and
the same columns through safetensors.numpy save / load. Prints sizes and the best of 5 times of each.

`--push`: the weight push instead: a random model of SmolLM2-135M's shape (llama, hidden 576, 30 layers, vocab
49152, tied embeddings: 513 MiB in float32) is saved to a temporary folder, a rollout server started on it on
127.0.0.1, and its weights pushed 3 times as the trainer pushes them (safetensors bytes, `RolloutServerClient`);
prints the seconds to serialise, to send and load, and the server's own load.
Usage: python tools/rollout_wire_probe.py [--rows 64] [--tokens 1024] [--n 8] | --push
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from safetensors.numpy import load, save  # noqa: E402

from paddle_rl.batch import rollout_batch  # noqa: E402
from paddle_rl.models import CausalLM, ModelConfig  # noqa: E402
from paddle_rl.models.pretrained import hf_state, save_model, write_generation_config  # noqa: E402
from paddle_rl.rollout.client import RolloutServerClient  # noqa: E402
from paddle_rl.rollout.wire import batch_from_rows, batch_to_rows  # noqa: E402


def best(fn, repeats: int = 5):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def push() -> None:
    import socket
    import subprocess
    import tempfile

    import paddle

    from make_tiny_model import build_tokenizer

    root = tempfile.mkdtemp(prefix="rollout_push_")
    model_dir = os.path.join(root, "model")
    tokenizer = build_tokenizer(["hello world " * 50], 300, model_dir)
    config = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    paddle.seed(0)
    model = CausalLM(config)
    model.init_weights()
    save_model(model, model_dir)
    write_generation_config(model_dir, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    with open(os.path.join(root, "server.yaml"), "w") as f:
        f.write(f"actor_model_name_or_path: {model_dir}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-m", "paddle_rl", "rollout-server", os.path.join(root, "server.yaml"),
                               "--port", str(port), "--log-level", "warning"], cwd=root_dir,
                              env=dict(os.environ, PYTHONPATH=root_dir))
    try:
        client = RolloutServerClient(f"http://127.0.0.1:{port}")
        for _ in range(1200):
            try:
                client.health()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        state = hf_state(model)
        for version in range(3):
            start = time.perf_counter()
            body = save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()})
            serialised = time.perf_counter()
            out = client.push_weights(body, version)
            print(json.dumps({"mib": round(len(body) / 2 ** 20), "serialise_s": round(serialised - start, 2),
                              "send_and_load_s": round(time.perf_counter() - serialised, 2),
                              "server_load_s": round(out["load_s"], 2)}))
    finally:
        server.kill()
        server.wait()
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--push", action="store_true", help="time weight pushes to a server instead")
    args = parser.parse_args()
    if args.push:
        return push()
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

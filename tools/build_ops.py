"""Build (or find in the cache) the fused kernels of csrc/ ahead of time and check them against the references.

    python tools/build_ops.py            # build once; later processes load the cached library
    python tools/build_ops.py --force    # rebuild
    python tools/build_ops.py --verbose  # show the compiler's output

The cache folder is $PADDLE_RL_OPS_CACHE (default ~/.cache/paddle_rl/ops).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

from paddle_rl import ops  # noqa: E402  (after the thread settings, as Paddle loads)
from paddle_rl.ops import build  # noqa: E402


def smoke_test() -> dict:
    """Every op once against its reference on small random inputs; returns the largest differences."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(0)

    def t(a, dtype="float32"):
        return paddle.to_tensor(np.asarray(a).astype(dtype))

    x, w = t(rng.standard_normal((4, 32))), t(rng.standard_normal(32))
    logits, u = t(rng.standard_normal((8, 100))), t(rng.random(8))
    hidden, head = t(rng.standard_normal((6, 16))), t(rng.standard_normal((16, 100)))
    labels = paddle.to_tensor(rng.integers(0, 100, 6))
    tokens, ref_tokens = ops.sample_fused(logits, u, top_p=0.9)[0], ops.sample_reference(logits, u, top_p=0.9)[0]
    return {
        "rms_norm": float((ops.rms_norm_fused(x, w, 1e-6) - ops.rms_norm_reference(x, w, 1e-6)).abs().max()),
        "sample_mismatches": int((tokens != ref_tokens).astype("int32").sum()),
        "lm_head_logprobs": float((ops.lm_head_logprobs(hidden, head, labels, 1.0, fused=True)[0]
                                   - ops.lm_head_logprobs_reference(hidden, head, labels, 1.0)[0]).abs().max()),
        "packed_linear": float((ops.packed_linear_fused(hidden, ops.pack_weight_fused(head), 100)
                                - paddle.matmul(hidden, head)).abs().max()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached library exists")
    ap.add_argument("--verbose", action="store_true", help="print the compiler's output")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    path = build.build(force=args.force, verbose=args.verbose)
    built_s = time.perf_counter() - start
    ops.configure("on")
    report = {"library": path, "seconds": round(built_s, 1), **build.status(), "check": smoke_test()}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

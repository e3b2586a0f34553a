"""Per-sample random streams keyed by (seed, step, prompt id, sample index).

The same key yields the same uniforms in any process or batch layout, which makes sampling
independent of data-parallel rank and of how prompts are grouped into generation batches.
"""
import hashlib

import numpy as np


def sample_key(seed: int, step: int, prompt_uid, sample_index: int, round_index: int = 0) -> np.ndarray:
    digest = hashlib.blake2b(f"{seed}:{step}:{round_index}:{prompt_uid}:{sample_index}".encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype=np.uint64).copy()


def call_key(key, index: int) -> np.ndarray:
    """The key of an episode's completion request number `index` (an agent program's calls, rollout/agents.py),
    derived from the episode's own key."""
    words = np.asarray(key, dtype=np.uint64)
    digest = hashlib.blake2b(f"call:{int(words[0])}:{int(words[1])}:{index}".encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype=np.uint64).copy()


def uniforms_for(keys, length: int) -> np.ndarray:
    """[len(keys), length] float32 uniforms in [0, 1)."""
    out = np.empty((len(keys), length), dtype=np.float32)
    for i, key in enumerate(keys):
        out[i] = np.random.Generator(np.random.Philox(key=key)).random(length, dtype=np.float32)
    return out

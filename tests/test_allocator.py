"""PADDLE_RL_MALLOC and env.training_heap, checked in real processes against glibc's own accounting (mallinfo2):
whether a 100 MB block is mapped on its own or served from the heap, and whether freed heap goes back."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import ctypes, json
from paddle_rl import env

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 100 << 20

def block():
    """(MB mapped on their own while a 100 MB block lives, MB the heap holds after it is freed)"""
    mapped = libc.mallinfo2().hblkhd
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    mapped = libc.mallinfo2().hblkhd - mapped
    libc.free(p)
    return mapped >> 20, libc.mallinfo2().arena >> 20

out = {"before": block()}
with env.training_heap() as applied:
    out["applied"] = applied
    out["inside"] = block()
out["heap_after"] = libc.mallinfo2().arena >> 20
out["after"] = block()
print(json.dumps(out))
'''


def run(mode):
    env = dict(os.environ)
    env.pop("PADDLE_RL_MALLOC", None)
    if mode is not None:
        env["PADDLE_RL_MALLOC"] = mode
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    return proc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_training_heap_keeps_large_blocks_in_the_heap_and_returns_them_after():
    """Default (train): outside the scope a 100 MB block is its own mapping; inside it comes from the heap, which
    keeps it when freed; leaving the scope gives it back (malloc_trim) and large blocks are mapped again."""
    proc = run(None)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["applied"] is True
    assert out["before"][0] >= 100 and out["after"][0] >= 100       # glibc maps it
    assert out["inside"][0] == 0 and out["inside"][1] >= 100        # the heap serves it and keeps it
    assert out["heap_after"] < 100                                    # trimmed when the scope ends


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_training_heap_is_off_with_system_and_refuses_an_unknown_mode():
    proc = run("system")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["applied"] is False and out["inside"][0] >= 100 and out["inside"][1] < 100
    proc = run("cached")
    assert proc.returncode != 0
    assert "PADDLE_RL_MALLOC='cached': expected one of train, heap, system" in proc.stderr

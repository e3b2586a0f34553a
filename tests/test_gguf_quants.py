"""The tensor types of the Q4_K_M files this suite fetches (Q4_K, Q5_0, Q6_K, Q8_0), written into a small GGUF file
with the `gguf` package's writer, read back by our importer and compared element for element with the `gguf`
package's own dequantizer.

Q5_0 and Q8_0 are quantized with `gguf.quants.quantize`. The package has no quantizer for Q4_K and Q6_K, so their
blocks are built here by hand from llama.cpp's block layout (ggml-common.h: `block_q4_K` = d, dmin, 12 bytes of
packed 6-bit scales and mins, 128 bytes of 4-bit quants; `block_q6_K` = 128 bytes of low 4 bits, 64 bytes of high 2
bits, 16 int8 scales, d) from chosen integers, and the values they stand for are computed from those integers
with llama.cpp's dequantization formulas: gguf's dequantizer must give exactly those, and so must our importer.
"""
import gguf
import numpy as np
import pytest

from paddle_rl.model_files.gguf_import import GGUFError, _open, read_tensors

T = gguf.GGMLQuantizationType
QK = 256  # values per K-quant block


def q4_k_blocks(rows: int, cols: int, rng):
    """(raw uint8 [rows, cols / 256 * 144], the float32 values [rows, cols] the blocks encode)."""
    n = rows * cols // QK
    d = rng.uniform(0.001, 0.01, n).astype(np.float16)
    dmin = rng.uniform(0.001, 0.01, n).astype(np.float16)
    sc = rng.integers(0, 64, (n, 8))     # 6-bit scale of each 32-value sub-block
    mn = rng.integers(0, 64, (n, 8))     # 6-bit min of each sub-block
    q = rng.integers(0, 16, (n, 8, 32))  # 4-bit quants
    scales = np.zeros((n, 12), np.uint8)
    for j in range(4):  # llama.cpp's get_scale_min_k4, inverted
        scales[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    qs = np.zeros((n, 128), np.uint8)
    for c in range(4):  # 64 values per chunk: sub-block 2c in the low nibbles, 2c + 1 in the high ones
        qs[:, c * 32:(c + 1) * 32] = q[:, 2 * c] | (q[:, 2 * c + 1] << 4)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    values = (d.astype(np.float32)[:, None, None] * sc[:, :, None] * q
              - dmin.astype(np.float32)[:, None, None] * mn[:, :, None])
    return raw.reshape(rows, -1), values.astype(np.float32).reshape(rows, cols)


def q6_k_blocks(rows: int, cols: int, rng):
    """(raw uint8 [rows, cols / 256 * 210], the float32 values [rows, cols] the blocks encode)."""
    n = rows * cols // QK
    d = rng.uniform(0.001, 0.01, n).astype(np.float16)
    sc = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    q = rng.integers(0, 64, (n, QK))  # 6-bit quants, value = d * scale * (q - 32)
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for half in range(2):  # 128 values each: ql 64 bytes, qh 32 bytes, 8 scales
        v = q[:, half * 128:(half + 1) * 128]
        a, b, c, e = v[:, 0:32], v[:, 32:64], v[:, 64:96], v[:, 96:128]
        ql[:, half * 64:half * 64 + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, half * 64 + 32:half * 64 + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, half * 32:(half + 1) * 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    scale = np.repeat(sc.astype(np.float32), 16, axis=1)  # one scale per 16 values, in order
    values = d.astype(np.float32)[:, None] * scale * (q - 32)
    return raw.reshape(rows, -1), values.astype(np.float32).reshape(rows, cols)


# GGUF tensor name -> (type, rows, cols); names the importer maps (a qwen2 layer)
TENSORS = {"blk.0.attn_q.weight": (T.Q4_K, 8, 512), "blk.0.attn_k.weight": (T.Q5_0, 6, 256),
           "blk.0.ffn_down.weight": (T.Q6_K, 4, 768), "blk.0.attn_v.weight": (T.Q8_0, 5, 320)}


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("quants") / "q.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    encoded = {}
    for name, (kind, rows, cols) in TENSORS.items():
        if kind == T.Q4_K:
            raw, values = q4_k_blocks(rows, cols, rng)
        elif kind == T.Q6_K:
            raw, values = q6_k_blocks(rows, cols, rng)
        else:
            values = rng.standard_normal((rows, cols)).astype(np.float32)
            raw = gguf.quants.quantize(values, kind)
        w.add_tensor(name, raw, raw_dtype=kind)
        encoded[name] = (raw, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, encoded


def test_importer_reads_each_quant_type_as_ggufs_dequantizer(quant_file):
    path, encoded = quant_file
    reader = _open(path)
    assert {t.name: T(t.tensor_type) for t in reader.tensors} == {n: k for n, (k, _, _) in TENSORS.items()}
    ours = read_tensors(reader, {}, "qwen2", path)
    hf = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
          "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
          "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
          "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight"}
    for name, (kind, rows, cols) in TENSORS.items():
        raw, values = encoded[name]
        theirs = gguf.quants.dequantize(raw, kind).reshape(rows, cols)
        got = ours[hf[name]]
        assert got.shape == (rows, cols) and got.dtype == np.float32
        assert np.array_equal(got, theirs), name  # element for element
        if kind in (T.Q4_K, T.Q6_K):
            # the hand-built blocks decode to the values chosen: the layout above is llama.cpp's
            assert np.array_equal(theirs, values), name
        else:
            step = np.abs(values).max() / (15 if kind == T.Q5_0 else 127)
            assert np.abs(got - values).max() <= step, name  # a real quantization of the values


def test_a_short_tensor_is_named(quant_file, tmp_path):
    path, _ = quant_file
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor loses its last bytes
    with pytest.raises(GGUFError, match="cut.gguf"):
        read_tensors(_open(str(cut)), {}, "qwen2", str(cut))

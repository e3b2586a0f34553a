"""GGUF import: tiny models transformers builds, written as llama.cpp would (every tensor type the converter
claims), converted by `paddle-rl convert gguf`, and checked against transformers reading the same file with
`gguf_file=` (its own reader, dequantization and tokenizer)."""
import json
import os

import gguf
import numpy as np
import paddle
import pytest

from extras import extra  # noqa: E402

extra("transformers")
extra("accelerate")
torch = extra("torch")

from gguf_files import CHAT_TEMPLATE, hf_model, tiny_bpe, write_gguf  # noqa: E402
from paddle_rl.cli import main as cli_main  # noqa: E402
from paddle_rl.models import Tokenizer, load_model  # noqa: E402
from paddle_rl.model_files.gguf_import import GGUFError, convert_gguf, permute_rows, unpermute_rows  # noqa: E402

T = gguf.GGMLQuantizationType
ALL_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F16, T.BF16, T.F32]
TEXTS = ["<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x * 2",
         "héllo wörld 1234567890   spaces\t\ttabs\n\n", "Knights and knaves! <|endoftext|> 42"]


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe()


def _transformers(folder, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.parametrize("kind,types", [("llama", ALL_TYPES), ("qwen2", ALL_TYPES[::-1]), ("qwen3", ALL_TYPES[2:])])
def test_converted_folder_matches_transformers_reading_the_gguf(tmp_path, bpe, kind, types):
    model = hf_model(kind, bpe.get_vocab_size())
    written = write_gguf(str(tmp_path / "m.gguf"), kind, model, bpe, types)
    assert {t.name for t in types} <= set(written.values())
    out = tmp_path / "hf"
    assert cli_main(["convert", "gguf", str(tmp_path / "m.gguf"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == kind and config["tie_word_embeddings"] is False
    assert config["attention_bias"] is (kind == "qwen2")

    theirs, their_tok = _transformers(str(tmp_path), "m.gguf")
    ours, our_tok = load_model(str(out)), Tokenizer.from_pretrained(str(out))
    ours.eval()
    for text in TEXTS:
        ids = our_tok.encode(text)
        assert ids == their_tok(text, add_special_tokens=False)["input_ids"], text
        assert our_tok.decode(ids) == text
    ids = our_tok.encode(TEXTS[0] + TEXTS[1])
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0].numpy()
    with paddle.no_grad():
        got = ours(paddle.to_tensor([ids])).numpy()[0]
    assert np.abs(got - expected).max() < 1e-4
    # the file's F32 tensors come through exactly (norms: never quantized)
    state = dict(model.state_dict())
    assert np.array_equal(ours.norm.weight.numpy(), state["model.norm.weight"].numpy())


def test_chat_template_special_tokens_and_eos(tmp_path, bpe):
    model = hf_model("qwen2", bpe.get_vocab_size())
    write_gguf(str(tmp_path / "m.gguf"), "qwen2", model, bpe, [T.F32])
    convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "hf"))
    tok = Tokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>") == [2]          # a control token stays whole
    assert tok.eos_token_ids == [2] and tok.pad_token_id == 0
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_llama_permutation_round_trip():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64 // 8, 24)
    assert np.array_equal(unpermute_rows(permute_rows(w, 4), 4), w)
    assert not np.array_equal(permute_rows(w, 4), w)


def test_bad_files_are_named(tmp_path, bpe):
    model = hf_model("llama", bpe.get_vocab_size())
    good = tmp_path / "m.gguf"
    write_gguf(str(good), "llama", model, bpe, [T.Q8_0])
    # an architecture the converter does not know
    write_gguf(str(tmp_path / "falcon.gguf"), "llama", model, bpe, [T.F32], arch="falcon")
    with pytest.raises(GGUFError, match=r"falcon\.gguf: general\.architecture 'falcon' is not supported"):
        convert_gguf(str(tmp_path / "falcon.gguf"), str(tmp_path / "x"))
    # a truncated file: cut inside the tensor data
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFError, match=r"cut\.gguf"):
        convert_gguf(str(tmp_path / "cut.gguf"), str(tmp_path / "y"))
    assert not (tmp_path / "y").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".converting")]
    # a tensor type outside the supported set
    write_gguf(str(tmp_path / "iq.gguf"), "llama", model, bpe, [T.IQ4_NL])
    with pytest.raises(GGUFError, match=r"iq\.gguf: tensor .* has type IQ4_NL, which is not supported"):
        convert_gguf(str(tmp_path / "iq.gguf"), str(tmp_path / "z"))
    # a pre-tokenizer whose splitting rule is unknown
    write_gguf(str(tmp_path / "pre.gguf"), "llama", model, bpe, [T.F32], pre="chameleon")
    with pytest.raises(GGUFError, match=r"pre\.gguf: tokenizer\.ggml\.pre 'chameleon'"):
        convert_gguf(str(tmp_path / "pre.gguf"), str(tmp_path / "w"))
    # the CLI: one line naming the file, exit 2
    assert cli_main(["convert", "gguf", str(tmp_path / "falcon.gguf"), "--out", str(tmp_path / "v")]) == 2

"""A GGUF file (llama.cpp's format) to a Hugging Face folder: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json.

The `gguf` package reads the file and dequantizes its tensors; this module knows what llama.cpp's converter
changed on the way in and undoes it:
- tensor names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`), shapes in reverse order;
- the llama architecture's q / k rows, permuted from Hugging Face's rotate-half layout to interleaved pairs;
- the tokenizer: vocabulary and merges as a `tokenizers` byte-level BPE with the pre-tokenizer llama.cpp
  names (`tokenizer.ggml.pre`), control tokens as special added tokens, the chat template and EOS ids; a
  SentencePiece vocabulary (`tokenizer.ggml.model` llama, as Gemma's) as a BPE with byte fallback whose merges are
  recovered from the vocabulary;
- Gemma 3: every RMSNorm weight stored as 1 + w (llama.cpp's converter adds the 1 that Gemma's norm applies),
  the pre-MLP norm under ffn_norm, and the settings llama.cpp fixes in code rather than in the file (every 6th
  layer global, the sliding layers' rotary base 10000, the query scale).

Anything it does not know (an architecture, a tensor type, a pre-tokenizer, a rope scaling) is an error
naming the file and the key, never a silent substitute.
"""
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Tuple

import numpy as np

from .safetensors_io import save_state

# llama.cpp architecture -> (Hugging Face model_type, architecture class, q/k rows permuted by llama.cpp)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
}
# tensor names one architecture maps differently (after `blk.N.`), and architectures whose norms are stored as 1 + w
ARCH_LAYER_TENSORS = {
    "gemma3": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
NORMS_PLUS_ONE = ("gemma3",)
# Gemma 3 settings llama.cpp (llama-model.cpp) fixes in code, not in the file
GEMMA3_SLIDING_PATTERN = 6       # every 6th layer global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # the sliding layers' rotary base

# tensor types read (the gguf package dequantizes each)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K")

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Text splitting before byte-level BPE, by `tokenizer.ggml.pre` (the regexes of the original tokenizer.json
# files; llama.cpp's llama-vocab.cpp lists the same).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    # name: (split digits one by one first, regex)
    "default": (False, GPT2_SPLIT),
    "gpt-2": (False, GPT2_SPLIT),
    "smollm": (True, GPT2_SPLIT),
    "llama-bpe": (False, LLAMA3_SPLIT),
    "llama3": (False, LLAMA3_SPLIT),
    "qwen2": (False, QWEN2_SPLIT),
}

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file this converter cannot read; the message names the file and the key."""


def _open(path: str):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is an install requirement
        raise GGUFError(f"reading {path} needs the Python package 'gguf' ({e})") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # a truncated or foreign file: the reader fails on its header or offsets
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader, path: str) -> Dict[str, object]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path}: metadata key {key} cannot be read ({e})") from None
    return out


def _require(meta: dict, key: str, path: str):
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key} is missing")
    return meta[key]


def hf_config(meta: dict, tensor_names, path: str) -> dict:
    """config.json of the model a GGUF file describes."""
    arch = _require(meta, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: general.architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    model_type, architecture, _ = ARCHITECTURES[arch]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        what = f"{arch}.rope.scaling.type {scaling!r}" if scaling not in ("none", None) else "tensor rope_freqs.weight"
        raise GGUFError(f"{path}: {what}: rotary scaling from a GGUF file is not supported")
    heads = int(_require(meta, f"{arch}.attention.head_count", path))
    hidden = int(_require(meta, f"{arch}.embedding_length", path))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count {rope_dim} differs from the head size {head_dim} "
                        "(partial rotary embeddings are not supported)")
    tokens = _require(meta, "tokenizer.ggml.tokens", path)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_require(meta, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_require(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        del config["hidden_act"]
        layers = config["num_hidden_layers"]
        config.update(
            hidden_activation="gelu_pytorch_tanh", sliding_window=int(_require(meta, f"{arch}.attention.sliding_window",
                                                                                path)),
            layer_types=["sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention"
                         for i in range(layers)],
            rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
            # llama.cpp scales the scores by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B (62 layers)
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
            final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
            attn_logit_softcapping=meta.get(f"{arch}.attn_logit_softcapping"))
    if model_type == "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    else:
        config["attention_bias"] = False
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def hf_tensor_name(name: str, path: str, arch: str = "") -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    layer = {**LAYER_TENSORS, **ARCH_LAYER_TENSORS.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    raise GGUFError(f"{path}: tensor {name!r} has no Hugging Face counterpart this converter knows")


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q / k permutation: within each head it stores the rotate-half pairs (i, i + d/2)
    as adjacent rows (2i, 2i + 1)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of `unpermute_rows`); used to write test files."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def read_tensors(reader, config: dict, arch: str, path: str) -> Dict[str, np.ndarray]:
    """All tensors, dequantized to float32, under their Hugging Face names and shapes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    permuted = ARCHITECTURES[arch][2]
    out = {}
    for tensor in reader.tensors:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        if kind not in TENSOR_TYPES:
            raise GGUFError(f"{path}: tensor {tensor.name} has type {kind}, which is not supported "
                            f"(supported: {', '.join(TENSOR_TYPES)})")
        name = hf_tensor_name(tensor.name, path, arch)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        try:
            values = np.asarray(dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32)
            values = values.reshape(shape)
        except Exception as e:  # a short data section (truncated file) or a corrupt block
            raise GGUFError(f"{path}: tensor {tensor.name} ({kind}, shape {list(shape)}) cannot be read: {e}") from None
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            values = unpermute_rows(values, heads)
        if arch in NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # stored as 1 + w: Hugging Face keeps the offset w
        out[name] = np.ascontiguousarray(values)
    return out


def sentencepiece_merges(tokens: List[str]) -> List[Tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (the file lists none): every split of a token into two
    tokens, ordered by the token's place in the vocabulary (Gemma's scores do not follow its merge order; the
    order of the list does), and within a token the longer left piece first."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, left, right))
    return [(left, right) for _, left, right in merges]


def build_sentencepiece_tokenizer(meta: dict, path: str):
    """A SentencePiece vocabulary (`tokenizer.ggml.model` llama: Gemma's) as a `tokenizers` BPE: spaces written
    as U+2581, no prefix space, byte fallback for what the vocabulary lacks, control tokens special, user-defined
    ones added whole, and the BOS token prepended where the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise GGUFError(f"{path}: tokenizer.ggml.add_space_prefix true is not supported (Gemma's SentencePiece "
                        "vocabulary only)")
    # a token of spaces only is stored with real spaces; the normalized text spells them U+2581
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
              for t in _require(meta, "tokenizer.ggml.tokens", path)]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 0))]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=sentencepiece_merges(tokens), fuse_unk=True,
                     unk_token=unk, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == TOKEN_USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        name = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{name} $A", pair=f"{name} $A {name} $B",
                                                           special_tokens=[(name, int(bos))])
    return tok, tokens


def build_tokenizer(meta: dict, path: str):
    """A `tokenizers.Tokenizer` (byte-level BPE) from the file's vocabulary, merges and pre-tokenizer name; a
    SentencePiece vocabulary by `build_sentencepiece_tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    kind = _require(meta, "tokenizer.ggml.model", path)
    if kind == "llama" and meta.get("general.architecture") == "gemma3":
        return build_sentencepiece_tokenizer(meta, path)
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (byte-level BPE 'gpt2', and "
                        "SentencePiece 'llama' for gemma3)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported "
                        f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens: List[str] = list(_require(meta, "tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges", path)]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's 256 printable byte characters
    # a control token spelled outside the byte alphabet is a llama.cpp mislabel: it is no real token
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == TOKEN_CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but the rebuilt tokenizer has "
                        f"{tok.get_vocab_size(with_added_tokens=True)} (duplicate entries?)")
    return tok, tokens


def tokenizer_files(meta: dict, tokens: List[str]) -> Tuple[dict, dict]:
    """tokenizer_config.json and generation_config.json contents."""
    def token(key):
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    config = {k: v for k, v in config.items() if v is not None}
    eos = [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else []
    if "tokenizer.ggml.eot_token_id" in meta and int(meta["tokenizer.ggml.eot_token_id"]) not in eos:
        eos.append(int(meta["tokenizer.ggml.eot_token_id"]))
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            generation[hf_key] = int(meta[f"tokenizer.ggml.{key}"])
    return config, generation


def convert_gguf(path: str, out: str, dtype: str = "float32") -> dict:
    """Write the Hugging Face folder of a GGUF file; returns its config. The folder appears complete or not
    at all (written beside it, then renamed)."""
    if dtype not in ("float32", "float16"):
        raise GGUFError(f"--dtype {dtype!r}: expected float32 or float16")
    reader = _open(path)
    meta = read_metadata(reader, path)
    names = {t.name for t in reader.tensors}
    config = hf_config(meta, names, path)
    tokenizer, tokens = build_tokenizer(meta, path)
    tensors = read_tensors(reader, config, meta["general.architecture"], path)
    embedding, shape = tensors.get("model.embed_tokens.weight"), (config["vocab_size"], config["hidden_size"])
    if embedding is None or tuple(embedding.shape) != shape:
        found = "missing" if embedding is None else f"shape {list(embedding.shape)}"
        raise GGUFError(f"{path}: token_embd.weight is {found}, the metadata says {list(shape)}")
    tok_config, generation = tokenizer_files(meta, tokens)
    if dtype != "float32":
        tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
        config["torch_dtype"] = dtype
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        save_state(staging, tensors)
        tokenizer.save(os.path.join(staging, "tokenizer.json"))
        for name, data in (("config.json", config), ("tokenizer_config.json", tok_config),
                           ("generation_config.json", generation)):
            with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, ensure_ascii=False)
        umask = os.umask(0)
        os.umask(umask)
        for entry in [staging] + [os.path.join(staging, n) for n in os.listdir(staging)]:
            os.chmod(entry, (0o777 if os.path.isdir(entry) else 0o666) & ~umask)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return config


def add_convert_subparser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a model file to a Hugging Face folder")
    sub = p.add_subparsers(dest="convert_command", required=True)
    g = sub.add_parser("gguf", help="a GGUF file (llama.cpp) -> config.json, model.safetensors, tokenizer files",
                       description="Dequantizes every tensor (F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quants) to "
                                   "float32; architectures llama, qwen2, qwen3, gemma3.")
    g.add_argument("file", help="the .gguf file")
    g.add_argument("--out", required=True, help="output folder (replaced if it exists)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                   help="dtype of model.safetensors (default float32: dequantized values are exact in it)")
    g.set_defaults(func=_convert_cli)


def _convert_cli(args) -> int:
    try:
        config = convert_gguf(args.file, args.out, args.dtype)
    except (GGUFError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {config['model_type']}, {config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, vocab {config['vocab_size']}")
    return 0

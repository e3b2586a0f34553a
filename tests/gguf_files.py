"""GGUF files for tests, written with the `gguf` package from tiny models that transformers itself builds: what
llama.cpp's converter would write (tensor names, reversed shapes, llama's q/k permutation, a byte-level BPE
vocabulary with merges, control tokens, a chat template)."""
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paddle_rl.model_files.gguf_import import GLOBAL_TENSORS, LAYER_TENSORS, permute_rows

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["What is 12 + 34? The answer is 46.", "def f(x):\n    return x * 2  # code", "Hello, world! héllo wörld",
          "Knights and knaves: Alice says Bob is a knave.", "numbers 1234567890 and   spaces\t\ttabs\n\nlines"] * 40


def tiny_bpe(vocab_size: int = 300):
    """A byte-level BPE (digits split one by one, SmolLM-style) with three control tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def hf_model(kind: str, vocab_size: int, hidden: int = 256, seed: int = 0):
    """A tiny random transformers model of `kind` (llama / qwen2 / qwen3)."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = {"llama": lambda: transformers.LlamaConfig(**common, rope_theta=10000.0),
              "qwen2": lambda: transformers.Qwen2Config(**common, rope_theta=1e6),
              "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=128, rope_theta=1e6)}[kind]()
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[kind]
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from 1 / 0, so a mix-up shows
    return model


def _random_blocks(kind, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random K-quant blocks (the gguf package cannot quantize to them): random bytes with sane f16
    scales in the places the format keeps them."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = lambda n: np.frombuffer((rng.uniform(0.001, 0.004, n)).astype(np.float16).tobytes(), np.uint8)
    count = rows * cols // block
    if kind == gguf.GGMLQuantizationType.Q4_K:     # d, dmin, scales[12], qs[128]
        raw[..., 0:2] = scale(count).reshape(rows, -1, 2)
        raw[..., 2:4] = scale(count).reshape(rows, -1, 2)
    elif kind == gguf.GGMLQuantizationType.Q6_K:   # ql[128], qh[64], scales[16] (int8), d
        raw[..., 208:210] = scale(count).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def encode_tensor(values: np.ndarray, kind, rng):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf
    from gguf import quants
    T = gguf.GGMLQuantizationType
    if kind == T.F32 or values.ndim == 1:
        return values.astype(np.float32), None
    if kind == T.F16:
        return values.astype(np.float16), None
    try:
        return quants.quantize(values.astype(np.float32), kind), kind
    except NotImplementedError:  # K-quants (and others) the package only reads
        return _random_blocks(kind, values.shape[0], values.shape[1], rng), kind


def write_gguf(path: str, kind: str, model, tokenizer, tensor_types, arch: str = None, pre: str = "smollm") -> dict:
    """A GGUF file of `model` (a transformers model); matrices cycle through `tensor_types`. Returns the
    {gguf name: type name} written."""
    import gguf
    rng = np.random.default_rng(0)
    cfg = model.config
    arch = arch or kind
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = [" ".join(m) if isinstance(m, (tuple, list)) else m
              for m in __import__("json").loads(tokenizer.to_str())["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    hf_to_gguf = {v: k for k, v in GLOBAL_TENSORS.items()}
    layer = {v: k for k, v in LAYER_TENSORS.items()}
    written, i = {}, 0
    for name, tensor in model.state_dict().items():
        values = tensor.detach().float().numpy()
        if name in hf_to_gguf:
            gname = hf_to_gguf[name]
        else:
            _, _, n, rest = name.split(".", 3)
            gname = f"blk.{n}.{layer[rest]}"
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            values = permute_rows(values, heads)
        t = tensor_types[i % len(tensor_types)] if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        i += values.ndim == 2
        data, raw = encode_tensor(values, t, rng)
        w.add_tensor(gname, data, raw_dtype=raw)
        written[gname] = t.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written

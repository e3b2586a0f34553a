"""Build the bundled tiny default: KK data (2-3 people), a byte-level BPE tokenizer, and a small
Qwen2-architecture model warm-started by a short supervised pass so it writes the
<think>...</think><answer>...</answer> format.

    python tools/make_tiny_model.py --out data/tiny --sft-steps 300

Writes OUT/model (Hugging Face layout) and OUT/kk/{sft,train,test}.jsonl.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from paddle_rl.data.kk import generate_puzzles, render_paddlenlp  # noqa: E402
from paddle_rl.models import CausalLM, ModelConfig, Tokenizer  # noqa: E402
from paddle_rl.models.pretrained import save_model, write_generation_config  # noqa: E402
from paddle_rl.rewards.kk import CORRECT_SCORE, kk_score  # noqa: E402
from paddle_rl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from paddle_rl.trainer.logprobs import token_logprobs  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)
THINK = " I check each claim against each role."


def sft_response(truth: str) -> str:
    return f"{THINK}</think>\n<answer>{truth}</answer><|im_end|>"


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def build_data(out_dir, people, seed, n_sft, n_train, n_test):
    """Disjoint SFT / RL-train / held-out test puzzles, rendered with the tiny chat template."""
    os.makedirs(out_dir, exist_ok=True)
    splits = {"sft": [], "train": [], "test": []}
    seen = set()
    for k, p in enumerate(people):
        pool = generate_puzzles(p, (n_sft + n_train + n_test) // len(people) * 2, seed + k)
        recs = []
        for puzzle in pool:
            rec = render_paddlenlp(puzzle, template="tiny", compact=True)
            if rec["src"] not in seen:
                seen.add(rec["src"])
                recs.append(rec)
        a, b, c = n_sft // len(people), n_train // len(people), n_test // len(people)
        splits["test"] += recs[:c]
        splits["train"] += recs[c:c + b]
        splits["sft"] += recs[c + b:c + b + a]
    for name, recs in splits.items():
        write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), recs)
    return splits


def build_tokenizer(corpus, vocab_size, folder):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": 1024, "tokenizer_class": "Qwen2Tokenizer",
              "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True}
                                       for t in SPECIAL_TOKENS}}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return Tokenizer.from_pretrained(folder)


def sft_batch(tokenizer, records, pad_id):
    prompts = [tokenizer.encode(r["src"]) for r in records]
    responses = [tokenizer.encode(sft_response(r["tgt"])) for r in records]
    p_width, r_width = max(map(len, prompts)), max(map(len, responses))
    ids = np.full((len(records), p_width + r_width), pad_id, np.int64)
    mask = np.zeros_like(ids)
    resp = np.full((len(records), r_width), pad_id, np.int64)
    resp_mask = np.zeros((len(records), r_width), np.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_width - len(p):p_width] = p
        mask[i, p_width - len(p):p_width] = 1
        ids[i, p_width:p_width + len(r)] = r
        mask[i, p_width:p_width + len(r)] = 1
        resp[i, :len(r)] = r
        resp_mask[i, :len(r)] = 1
    return [paddle.to_tensor(x) for x in (ids, mask, resp, resp_mask)], p_width


def greedy_accuracy(model, tokenizer, records, max_dec_len=48):
    stop = tokenizer.eos_token_ids
    engine = RolloutEngine(model, tokenizer.pad_token_id, stop)
    out = engine.generate([tokenizer.encode(r["src"]) for r in records], 1,
                          SamplingParams(max_dec_len=max_dec_len, temperature=0.0, stop_token_ids=stop))
    texts = tokenizer.decode_batch(out.responses())
    scores = np.array([kk_score(t, r["tgt"]) for t, r in zip(texts, records)])
    return float((scores >= CORRECT_SCORE).mean()), float(scores.mean()), texts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/tiny")
    ap.add_argument("--people", default="2,3")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sft-examples", type=int, default=4000)
    ap.add_argument("--train-examples", type=int, default=2000)
    ap.add_argument("--test-examples", type=int, default=200)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args(argv)

    paddle.seed(args.seed)
    np.random.seed(args.seed)
    people = [int(p) for p in args.people.split(",")]
    data_dir, model_dir = os.path.join(args.out, "kk"), os.path.join(args.out, "model")
    splits = build_data(data_dir, people, args.seed, args.sft_examples, args.train_examples, args.test_examples)
    corpus = [r["src"] + sft_response(r["tgt"]) for recs in splits.values() for r in recs]
    tokenizer = build_tokenizer(corpus, args.vocab_size, model_dir)

    config = ModelConfig(model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=int(args.hidden_size * 2.6875) // 8 * 8, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = CausalLM(config)
    model.init_weights()
    decay = [p.name for n, p in model.named_parameters() if "norm" not in n and not n.endswith("bias")]
    sched = paddle.optimizer.lr.CosineAnnealingDecay(args.lr, T_max=args.sft_steps)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), weight_decay=0.01,
                                 apply_decay_param_fun=lambda n: n in decay)
    sft = splits["sft"]
    rng = np.random.default_rng(args.seed)
    start = time.time()
    model.train()
    for step in range(1, args.sft_steps + 1):
        pick = rng.choice(len(sft), size=args.batch_size, replace=False)
        (ids, mask, resp, resp_mask), width = sft_batch(tokenizer, [sft[i] for i in pick], tokenizer.pad_token_id)
        logp, _ = token_logprobs(model, ids, mask, width, resp, temperature=1.0)
        loss = -(logp * resp_mask).sum() / resp_mask.sum()
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        if step % 50 == 0 or step == args.sft_steps:
            print(f"sft step {step}/{args.sft_steps} loss {float(loss):.4f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    acc, mean, texts = greedy_accuracy(model, tokenizer, splits["test"])
    print(f"held-out greedy accuracy {acc:.3f}, mean KK reward {mean:.3f}")
    print("sample:", repr(texts[0]))
    save_model(model, model_dir)
    write_generation_config(model_dir, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(f"Tiny KK default, built by `python tools/make_tiny_model.py {' '.join(argv or sys.argv[1:])}`.\n\n"
                f"- model/: Qwen2-architecture decoder, hidden {args.hidden_size}, {args.layers} layers, "
                f"vocab {tokenizer.vocab_size}; {sum(int(np.prod(p.shape)) for p in model.parameters())} parameters\n"
                f"- kk/: {people}-people puzzles: sft ({len(sft)}), train ({len(splits['train'])}), "
                f"test ({len(splits['test'])})\n"
                f"- after {args.sft_steps} supervised steps: held-out greedy accuracy {acc:.3f}, mean reward {mean:.3f}\n")


if __name__ == "__main__":
    main()

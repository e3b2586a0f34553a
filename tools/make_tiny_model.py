"""Build a bundled tiny default: task data, a byte-level BPE tokenizer, and a small Qwen2-architecture model
warm-started by a short supervised pass so it writes the <think>...</think><answer>...</answer> format.

    python tools/make_tiny_model.py --task arith --out data/tiny_arith    # the learning default
    python tools/make_tiny_model.py --task kk --out data/tiny              # 2-3 people Knights-and-Knaves
    python tools/make_tiny_model.py --task kk --reasoning --out data/tiny  # the same, worked out before answering
    python tools/make_tiny_model.py --task tool --out data/tiny_tool       # five-operand sums with a calculator

Writes OUT/model (Hugging Face layout), OUT/TASK/{train,test}.jsonl (OUT/TASK/sft.jsonl too with
--keep-sft) and OUT/README.md with the held-out numbers of the result.

kk: the prompts number the speakers in order ("(1) Zoey: ... (2) Oliver: ..."), so the "(k) Name" lines of the
answer can be copied from the prompt; the puzzle statements use the compact wording of paddle_rl.data.kk.
The supervised responses carry no reasoning, only the answer. The supervised pass stops at the first check (every
50 steps) where greedy accuracy on a dev split reaches 0.28; test_4p.jsonl holds 4-people puzzles, a count neither
pass trains on. With --reasoning the supervised responses work the puzzle out first (paddle_rl.data.kk.reasoning:
suppose a role for the first undecided person, follow what each claim forces, drop a supposition that meets a
contradiction) and the defaults change (TASK_DEFAULTS["kk_reasoning"]: longer decoding, its own stop accuracy).
--sft-only-people 4 --sft-only-examples N adds N 4-people puzzles (none of test_4p.jsonl's) to the supervised split
alone: RL still trains on 2-3 people, and test_4p.jsonl then measures a count only the supervised pass has seen.

arith: three-operand addition of 10..99 ("What is 51 + 29 + 60?"); the supervised responses carry the running
sums (" 51 + 29 = 80. 80 + 60 = 140."), digits are single tokens. With --stop-accuracy the supervised pass
ends at the first check where greedy accuracy on a separate dev split reaches that value: a partly trained
model that samples right answers often but not reliably, which is what RL starts from.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddle_rl.env import configure_threads  # noqa: E402

configure_threads()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from paddle_rl.data.arith import generate_problems  # noqa: E402
from paddle_rl.data.kk import generate_puzzles, render_prompt  # noqa: E402
from paddle_rl.data.kk.english import COMPACT_INTRO, COMPACT_QUESTION, sentence  # noqa: E402
from paddle_rl.config import load_config  # noqa: E402
from paddle_rl.data.kk.reasoning import reasoning_text  # noqa: E402
from paddle_rl.data.kk_cli import people_list  # noqa: E402
from paddle_rl.models import CausalLM, ModelConfig, Tokenizer  # noqa: E402
from paddle_rl.models.pretrained import save_model, write_generation_config  # noqa: E402
from paddle_rl.rewards.kk import CORRECT_SCORE, kk_score  # noqa: E402
from paddle_rl.rewards.rules import format_score, math_score  # noqa: E402
from paddle_rl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from paddle_rl.rollout.episodes import EpisodeRunner, load_environment  # noqa: E402
from paddle_rl.trainer import SFTTrainer  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)
THINK = " I check each claim."


def sft_response(truth: str, think: str = THINK) -> str:
    return f"{think}</think>\n<answer>{truth}</answer><|im_end|>"


def record_response(record: dict) -> str:
    """The supervised response of a record: its own (`response`: a tool episode), its worked steps ("think",
    arith) or the fixed KK preamble."""
    if "response" in record:
        return record["response"]
    return sft_response(record["tgt"], record.get("think", THINK))


def tool_episode(question_operands, total) -> str:
    """A whole calculator episode as the tiny chat template renders it: the call, the observation (the tool turn
    the environment feeds in), the answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": " + ".join(map(str, question_operands))}})
    return (f" I use the calculator.</think>\n<tool_call>{call}</tool_call><|im_end|>\n<|im_start|>tool\n{total}"
            f"<|im_end|>\n<|im_start|>assistant\n<think> The calculator says {total}.</think>\n<answer>{total}</answer>"
            "<|im_end|>")


def build_tool_data(out_dir, seed, n_sft, n_train, n_test, n_dev, operands=5, tool_share=0.25, write_sft=True):
    """Five-operand addition (a tiny model cannot add five numbers in its head). Supervised records: a share
    `tool_share` are whole calculator episodes, the rest answer directly (the right sum, which the model cannot
    learn to compute): the warm start has seen tool calls but mostly guesses."""
    os.makedirs(out_dir, exist_ok=True)
    problems = generate_problems(n_test + n_train + n_dev + n_sft, operands, 10, 99, seed)
    rng = np.random.default_rng(seed)
    records = []
    for i, p in enumerate(problems):
        rec = {"src": render_prompt(p.question(), "tiny"), "tgt": p.answer()}
        if i >= n_test + n_train + n_dev:  # a supervised example
            rec["response"] = (tool_episode(p.operands, p.answer()) if rng.random() < tool_share
                               else sft_response(p.answer(), " I add them."))
        records.append(rec)
    bounds = np.cumsum([0, n_test, n_train, n_dev, n_sft])
    splits = {name: records[bounds[i]:bounds[i + 1]] for i, name in enumerate(("test", "train", "dev", "sft"))}
    for name in ("test", "train") + (("sft",) if write_sft else ()):
        write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), splits[name])
    return splits


def puzzle_text(puzzle) -> str:
    """Compact wording with numbered speakers: "Knights tell ... (1) Zoey: Oliver is a knave. (2) Oliver: ..."."""
    parts = [COMPACT_INTRO]
    for k, (name, statement) in enumerate(zip(puzzle.names, puzzle.statements), start=1):
        parts.append(f"({k}) {name}: {sentence(statement, puzzle.names)}")
    parts.append(COMPACT_QUESTION)
    return " ".join(parts)


def render(puzzle, reasoning=False) -> dict:
    """PaddleNLP record in the tiny chat layout: {"src": prompt ending in "<think>", "tgt": ground truth}; with
    `reasoning`, "think" too: the case split of paddle_rl.data.kk.reasoning that reaches the answer."""
    record = {"src": render_prompt(puzzle_text(puzzle), "tiny"), "tgt": puzzle.ground_truth()}
    if reasoning:
        record["think"] = " " + reasoning_text(puzzle)
    return record


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")


def build_data(out_dir, people, seed, n_sft, n_train, n_test, n_dev=0, unseen=(), write_sft=True, reasoning=False,
               sft_only=(), n_sft_only=0, rl_extra=(), n_rl_extra=0):
    """Disjoint SFT / RL-train / held-out test / dev puzzles, rendered with the tiny chat template.

    Each split holds an equal share of every inhabitant count in `people`. The dev split (not written) decides
    when the supervised pass stops. Each count in `unseen` gets a held-out file of its own, test_<p>p.jsonl
    (n_test puzzles), for accuracy on a people count that RL does not train on. Each count in `sft_only` adds
    `n_sft_only` puzzles to the supervised split alone (none of them in its held-out file); with none, the unseen
    counts are counts that neither pass sees. Each count in `rl_extra` gets an RL file of its own, train_<p>p.jsonl
    (`n_rl_extra` puzzles, none in any other split). With `reasoning` the supervised records carry the worked case
    split ("think"); the written RL and test files never do."""
    os.makedirs(out_dir, exist_ok=True)
    splits = {"sft": [], "train": [], "test": [], "dev": []}
    seen = set()
    for k, p in enumerate(people):
        pool = generate_puzzles(p, (n_sft + n_train + n_test) // len(people) * 2, seed + k)
        recs = []
        for puzzle in pool:
            rec = render(puzzle, reasoning)
            if rec["src"] not in seen:
                seen.add(rec["src"])
                recs.append(rec)
        a, b, c, d = (n // len(people) for n in (n_sft, n_train, n_test, n_dev))
        if len(recs) < a + b + c + d:
            raise SystemExit(f"kk: only {len(recs)} distinct {p}-people puzzles for the splits")
        splits["test"] += recs[:c]
        splits["train"] += recs[c:c + b]
        splits["sft"] += recs[c + b:c + b + a]
        splits["dev"] += recs[c + b + a:c + b + a + d]
    for name, recs in splits.items():
        if name == "test" or name == "train" or (name == "sft" and write_sft):
            write_jsonl(os.path.join(out_dir, f"{name}.jsonl"),
                        recs if name == "sft" else [{"src": r["src"], "tgt": r["tgt"]} for r in recs])
    for k, p in enumerate(unseen):
        recs = [render(puzzle) for puzzle in generate_puzzles(p, n_test, seed + 100 + k)]
        splits[f"test_{p}p"] = recs
        write_jsonl(os.path.join(out_dir, f"test_{p}p.jsonl"), recs)
        seen.update(r["src"] for r in recs)

    def fresh(p, n, pool_seed, with_reasoning, flag):
        """n puzzles of p people that no split holds yet (they join `seen`)."""
        recs = []
        for puzzle in generate_puzzles(p, n * 2, pool_seed):
            rec = render(puzzle, with_reasoning)
            if rec["src"] not in seen and len(recs) < n:
                seen.add(rec["src"])
                recs.append(rec)
        if len(recs) < n:
            raise SystemExit(f"kk: only {len(recs)} distinct {p}-people puzzles for {flag}")
        return recs

    for k, p in enumerate(sft_only):
        splits["sft"] += fresh(p, n_sft_only, seed + 200 + k, reasoning, "--sft-only-people")
    if sft_only and write_sft:
        write_jsonl(os.path.join(out_dir, "sft.jsonl"), splits["sft"])
    for k, p in enumerate(rl_extra):
        splits[f"train_{p}p"] = recs = fresh(p, n_rl_extra, seed + 300 + k, False, "--rl-extra-people")
        write_jsonl(os.path.join(out_dir, f"train_{p}p.jsonl"), [{"src": r["src"], "tgt": r["tgt"]} for r in recs])
    return splits


def build_arith_data(out_dir, seed, n_sft, n_train, n_test, n_dev, operands=3, low=10, high=99, write_sft=True):
    """Disjoint SFT / RL-train / held-out test / dev addition problems; SFT records carry their worked steps."""
    os.makedirs(out_dir, exist_ok=True)
    problems = generate_problems(n_test + n_train + n_dev + n_sft, operands, low, high, seed)
    records = [{"src": render_prompt(p.question(), "tiny"), "tgt": p.answer(), "think": " " + p.worked_steps()}
               for p in problems]
    bounds = np.cumsum([0, n_test, n_train, n_dev, n_sft])
    splits = {name: records[bounds[i]:bounds[i + 1]] for i, name in enumerate(("test", "train", "dev", "sft"))}
    for name in ("test", "train") + (("sft",) if write_sft else ()):
        write_jsonl(os.path.join(out_dir, f"{name}.jsonl"),
                    [r if name == "sft" else {"src": r["src"], "tgt": r["tgt"]} for r in splits[name]])
    return splits


def build_tokenizer(corpus, vocab_size, folder, single_digits=False):
    tok = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if single_digits else byte_level)
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


def build_model(tokenizer, hidden_size, layers, seed):
    config = ModelConfig(model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=hidden_size,
                         intermediate_size=int(hidden_size * 2.6875) // 8 * 8, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    paddle.seed(seed)
    model = CausalLM(config)
    model.init_weights()
    return model


def supervised(model_dir, records, work_dir, steps, batch_size, lr, seed, warmup=20, log_every=50, on_log=None,
               schedule="constant", max_dec_len=64):
    """`paddle-rl sft` (paddle_rl.trainer.SFTTrainer) on `records` from the model in `model_dir`: AdamW on the
    response tokens, linear warm-up then a constant rate or cosine decay. `on_log(model, step)` runs every
    `log_every` steps; when it returns True the pass stops there. Returns (the trained model, steps taken)."""
    data = os.path.join(work_dir, "sft.jsonl")
    write_jsonl(data, [{"src": r["src"], "tgt": record_response(r)} for r in records])
    overrides = {"actor_model_name_or_path": model_dir, "train_datasets": data, "output_dir": os.path.join(work_dir, "run"),
                 "max_steps": steps, "global_batch_size": batch_size, "global_mini_batch_size": batch_size,
                 "per_device_train_batch_size": batch_size, "learning_rate": lr, "warmup_steps": warmup,
                 "lr_scheduler_type": "cosine" if schedule == "cosine" else "constant_with_warmup",
                 "weight_decay": 0.01, "max_grad_norm": 0, "seed": seed, "max_dec_len": max_dec_len,
                 "max_prompt_len": 512, "do_eval": False, "save_strategy": "no", "report_to": "none",
                 "disable_tqdm": True}
    trainer = SFTTrainer(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    start = time.time()
    while trainer.step < trainer.total_steps:
        metrics = trainer.train_step()
        step = trainer.step
        if step % log_every == 0 or step == steps:
            print(f"sft step {step}/{steps} loss {metrics['actor/sft_loss']:.4f} ({time.time() - start:.0f}s)",
                  flush=True)
            if on_log is not None and on_log(trainer.actor, step):
                break
    trainer.actor.eval()
    return trainer.actor, trainer.step


def score_arith(text, truth):
    """(math rule score, whether the response has the <think>...</think><answer>...</answer> layout)."""
    return math_score(text, truth), format_score(text) > 0


def greedy_eval(model, tokenizer, records, max_dec_len=40, task="kk"):
    """Greedy decoding on `records`: accuracy, mean reward, share with a parseable answer, (KK) accuracy per
    inhabitant count, (tool) the share of episodes that called the calculator, and the texts."""
    stop = tokenizer.eos_token_ids
    engine = RolloutEngine(model, tokenizer.pad_token_id, stop)
    was_training = model.training
    model.eval()
    episodes = None
    if task == "tool":
        episodes = EpisodeRunner(load_environment("tools", ("calculator",)), records, 1, tokenizer, stop, 3)
    out = engine.generate([tokenizer.encode(r["src"]) for r in records], 1,
                          SamplingParams(max_dec_len=max_dec_len, temperature=0.0, stop_token_ids=stop), None, episodes)
    if was_training:
        model.train()
    texts = tokenizer.decode_batch(out.responses())
    if task == "tool":
        scored = [score_arith(t, r["tgt"]) for t, r in zip(texts, records)]
        return {"accuracy": float(np.mean([s for s, _ in scored])),
                "tool_use": float((out["tool_calls"] > 0).mean()),
                "tool_errors": float(out["tool_errors"].sum())}, texts
    if task == "arith":
        scored = [score_arith(t, r["tgt"]) for t, r in zip(texts, records)]
        return {"accuracy": float(np.mean([s for s, _ in scored])),
                "parseable": float(np.mean([f for _, f in scored]))}, texts
    scores = np.array([kk_score(t, r["tgt"]) for t, r in zip(texts, records)])
    people = np.array([r["tgt"].count("\n") + 1 for r in records])
    result = {"accuracy": float((scores >= CORRECT_SCORE).mean()), "reward_mean": float(scores.mean()),
              "parseable": float((scores >= -0.5).mean())}
    for p in sorted(set(people.tolist())):
        result[f"accuracy_{p}p"] = float((scores[people == p] >= CORRECT_SCORE).mean())
    return result, texts


def fmt(result) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in result.items())


TASK_DEFAULTS = {
    "kk": dict(out="data/tiny", test_examples=200, vocab_size=1024, sft_steps=2000, lr=2e-3, max_dec_len=48,
               stop_accuracy=0.28, eval_every=50),
    "arith": dict(out="data/tiny_arith", test_examples=400, vocab_size=512, sft_steps=4000, lr=2e-3,
                  max_dec_len=48, stop_accuracy=0.3, eval_every=25),
    # kk with --reasoning: the responses are the case split then the answer (up to ~150 tokens for 3 people)
    "kk_reasoning": dict(out="data/tiny", test_examples=200, vocab_size=1024, sft_steps=3000, lr=2e-3,
                         max_dec_len=192, stop_accuracy=0.3, eval_every=50),
    "tool": dict(out="data/tiny_tool", test_examples=200, vocab_size=512, sft_steps=3000, lr=2e-3,
                 max_dec_len=120, eval_every=500),
}


def people_counts(text: str) -> tuple:
    """A --people style list ("2,3"), checked as `paddle-rl data kk` checks it; empty: none."""
    return people_list(text) if text.strip() else ()


def write_readme(args, argv, tokenizer, model, splits, steps, result):
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    command = " ".join(["python tools/make_tiny_model.py"] + list(argv))
    if args.task == "kk":
        def held_out(name, records):
            p = int(name[5:-1])
            seen_by = ([f"the supervised pass sees {args.sft_only_examples} other {p}-people puzzles"]
                       * (p in args.sft_only_people)
                       + [f"RL trains on {args.rl_extra_examples} others, train_{p}p.jsonl"]
                       * (p in args.rl_extra_people))
            return (f"{name} ({len(records)}, {p} people, held out; "
                    + ("; ".join(seen_by) if seen_by else "a count neither pass trains on") + ")")
        unseen = ", ".join(held_out(k, v) for k, v in splits.items() if k.startswith("test_"))
        content = (f"- {args.task}/: {'-'.join(map(str, args.people))} people puzzles: train ({len(splits['train'])}, "
                   f"for RL), test ({len(splits['test'])}, held out){', ' + unseen if unseen else ''}; a separate "
                   f"dev split ({len(splits['dev'])}, not written) decides when the supervised pass stops; the "
                   + ("supervised responses work the puzzle out (paddle_rl.data.kk.reasoning: a case split that "
                      "reaches the answer) before answering" if args.reasoning else
                      "supervised responses carry no reasoning, only the answer"))
    elif args.task == "tool":
        content = (f"- {args.task}/: five-operand addition of 10..99, answered with the calculator tool "
                   f"(env_plugin: tools): train ({len(splits['train'])}, for RL), test ({len(splits['test'])}, held "
                   f"out); {args.tool_share:.0%} of the supervised examples are calculator episodes, the rest answer "
                   "directly")
    else:
        content = (f"- {args.task}/: three-operand addition of 10..99: train ({len(splits['train'])}, for RL), "
                   f"test ({len(splits['test'])}, held out); a separate dev split ({len(splits['dev'])}) decides "
                   f"when the supervised pass stops")
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(f"Tiny {args.task} default, built by `{command}` (see docs/learning.md).\n\n"
                f"- model/: Qwen2-architecture decoder, hidden {args.hidden_size}, {args.layers} layers, "
                f"vocab {tokenizer.vocab_size}; {n_params} parameters (float32)\n"
                f"{content}; the {len(splits['sft'])} supervised examples are regenerated by the builder "
                f"(--keep-sft writes them)\n"
                f"- after {steps} supervised steps (batch {args.batch_size}, lr {args.lr}): held-out greedy "
                f"{fmt(result)}\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(k for k in TASK_DEFAULTS if k != "kk_reasoning"), default="arith")
    ap.add_argument("--out", help="output folder (kk: data/tiny, arith: data/tiny_arith)")
    ap.add_argument("--people", type=people_list, default="2,3", help="kk: inhabitant counts")
    ap.add_argument("--unseen-people", type=people_counts, default="4",
                    help="kk: counts that get a held-out file of their own (test_<p>p.jsonl), trained on by neither "
                         "pass")
    ap.add_argument("--sft-only-people", type=people_counts, default="",
                    help="kk: counts outside --people whose puzzles the supervised pass sees (RL too if "
                         "--rl-extra-people names them)")
    ap.add_argument("--sft-only-examples", type=int, default=0, help="kk: supervised puzzles per --sft-only-people "
                                                                     "count, beside --sft-examples")
    ap.add_argument("--rl-extra-people", type=people_counts, default="",
                    help="kk: counts RL trains on as well, from a file of their own (train_<p>p.jsonl; their "
                         "held-out test_<p>p.jsonl stays)")
    ap.add_argument("--rl-extra-examples", type=int, default=0, help="kk: RL puzzles per --rl-extra-people count")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--sft-examples", type=int, default=4000)
    ap.add_argument("--train-examples", type=int, default=2000)
    ap.add_argument("--test-examples", type=int, help="kk: 200, arith: 400")
    ap.add_argument("--dev-examples", type=int, default=200, help="the split --stop-accuracy is checked on")
    ap.add_argument("--vocab-size", type=int, help="kk: 1024, arith: 512")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, help="supervised steps at most (kk: 2000, arith: 4000)")
    ap.add_argument("--stop-accuracy", type=float, help="stop the supervised pass once dev greedy accuracy reaches "
                                                        "this (kk: 0.28, arith: 0.3)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant", help="SFT learning-rate schedule")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, help="supervised learning rate (2e-3)")
    ap.add_argument("--eval-every", type=int, help="greedy dev eval every N SFT steps (kk: 50, arith: 25)")
    ap.add_argument("--keep-sft", action="store_true", help="also write OUT/TASK/sft.jsonl")
    ap.add_argument("--reasoning", action="store_true", help="kk: the supervised responses work the puzzle out (a "
                                                             "case split that reaches the answer) before answering")
    ap.add_argument("--tool-share", type=float, default=0.25, help="tool: the share of supervised examples that are "
                                                                   "calculator episodes")
    args = ap.parse_args(argv)
    if args.reasoning and args.task != "kk":
        ap.error(f"--reasoning is for --task kk, not {args.task}")
    for key, value in TASK_DEFAULTS["kk_reasoning" if args.reasoning else args.task].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.eval_every = args.eval_every or 0

    np.random.seed(args.seed)
    data_dir, model_dir = os.path.join(args.out, args.task), os.path.join(args.out, "model")
    if args.task == "kk":
        splits = build_data(data_dir, args.people, args.seed, args.sft_examples, args.train_examples,
                            args.test_examples, args.dev_examples, args.unseen_people, write_sft=args.keep_sft,
                            reasoning=args.reasoning, sft_only=args.sft_only_people,
                            n_sft_only=args.sft_only_examples, rl_extra=args.rl_extra_people,
                            n_rl_extra=args.rl_extra_examples)
    elif args.task == "tool":
        splits = build_tool_data(data_dir, args.seed, args.sft_examples, args.train_examples, args.test_examples,
                                 args.dev_examples, tool_share=args.tool_share, write_sft=args.keep_sft)
    else:
        splits = build_arith_data(data_dir, args.seed, args.sft_examples, args.train_examples, args.test_examples,
                                  args.dev_examples, write_sft=args.keep_sft)
    # the tokenizer learns from the splits of the trained people counts only (not from dev or an unseen count)
    corpus = [r["src"] + record_response(r) for name in ("sft", "train", "test") for r in splits[name]]
    tokenizer = build_tokenizer(corpus, args.vocab_size, model_dir, single_digits=args.task in ("arith", "tool"))
    save_model(build_model(tokenizer, args.hidden_size, args.layers, args.seed), model_dir)  # the random init
    write_generation_config(model_dir, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    test, dev = splits["test"], splits["dev"]

    def on_log(model, step):
        if args.eval_every and step % args.eval_every == 0:
            result = greedy_eval(model, tokenizer, dev, args.max_dec_len, args.task)[0]
            print(f"  dev greedy at step {step}: {fmt(result)}", flush=True)
            return args.stop_accuracy is not None and result["accuracy"] >= args.stop_accuracy
        return False

    start = time.time()
    with tempfile.TemporaryDirectory() as work:
        model, steps = supervised(model_dir, splits["sft"], work, args.sft_steps, args.batch_size, args.lr,
                                  args.seed, log_every=args.eval_every or 50, on_log=on_log, schedule=args.schedule,
                                  max_dec_len=args.max_dec_len * 2)
    result, texts = greedy_eval(model, tokenizer, test, args.max_dec_len, args.task)
    for name in sorted(k for k in splits if k.startswith("test_")):  # kk: the people counts not trained on
        result.update({f"{name}_{k}": v for k, v in greedy_eval(model, tokenizer, splits[name], args.max_dec_len,
                                                                args.task)[0].items() if k == "accuracy"})
    print(f"held-out greedy after {steps} SFT steps ({time.time() - start:.0f}s): {fmt(result)}")
    print("sample:", repr(texts[0]))
    save_model(model, model_dir)
    write_generation_config(model_dir, tokenizer.eos_token_ids, tokenizer.pad_token_id)
    write_readme(args, sys.argv[1:] if argv is None else argv, tokenizer, model, splits, steps, result)


if __name__ == "__main__":
    main()

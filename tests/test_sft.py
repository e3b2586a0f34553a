"""`paddle-rl sft`: the loss is the cross-entropy of the response tokens only, it learns, it resumes exactly, and the
command runs on ms-swift `messages` records."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import paddle
import pytest

from make_tiny_model import sft_response
from micro_model import micro_overrides
from paddle_rl.config import ConfigError, load_config
from paddle_rl.model_files.safetensors_io import load_state
from paddle_rl.monitor import read_metrics


def _records(micro, path, count=16, messages=False):
    """PaddleNLP src / tgt records whose tgt is the whole response (or ms-swift messages with an assistant turn)."""
    rows = [json.loads(line) for line in open(micro["train"])][:count]
    with open(path, "w") as f:
        for r in rows:
            response = sft_response(r["tgt"])
            if messages:  # the micro tokenizer's template renders the user turn like src does
                user = r["src"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
                f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                 {"role": "assistant", "content": response}]}) + "\n")
            else:
                f.write(json.dumps({"src": r["src"], "tgt": response}) + "\n")
    return str(path)


def _overrides(micro, out, data, **extra):
    values = dict(train_datasets=data, max_dec_len=64, global_batch_size=8, global_mini_batch_size=8,
                  per_device_train_batch_size=4, learning_rate=3e-3, max_steps=4, save_steps=2, do_eval=False,
                  warmup_steps=0)
    values.update(extra)
    return micro_overrides(micro, str(out), **values)


def _sft(overrides):
    from paddle_rl.trainer import SFTTrainer
    trainer = SFTTrainer(load_config(None, overrides))
    trainer.train()
    return trainer


def test_loss_is_the_response_cross_entropy(micro, tmp_path):
    """Step 1's loss (before its update) equals -mean log p(response token) of a full forward over the 8 records:
    prompt tokens carry no loss."""
    from paddle_rl.models import load_model
    from paddle_rl.models.logprobs import token_logprobs
    data = _records(micro, tmp_path / "sft.jsonl", count=8)
    # the sampling temperature (0.7) must not reach the loss: log-probs of the model's own distribution
    trainer = _sft(_overrides(micro, tmp_path / "out", data, max_steps=1, save_steps=10, temperature=0.7))
    # a supervised run shares the RL trainer's loop, not its parts: nothing of RL is built, and without held-out
    # data no engine or reward either
    assert trainer.engine is None and trainer.reward_fn is None
    assert not any(hasattr(trainer, name) for name in ("objective", "reference", "rollout", "critic"))
    row = read_metrics(str(tmp_path / "out" / "metrics.jsonl"))[0]
    logged = row["actor/sft_loss"]
    model = load_model(micro["model"])
    model.eval()
    tok = micro["tokenizer"]
    total, tokens = 0.0, sum(len(item["response_ids"]) for item in trainer.train_data.items)
    for item in trainer.train_data.items:
        prompt, response = item["prompt_ids"], item["response_ids"]
        ids = paddle.to_tensor([prompt + response])
        logp, _ = token_logprobs(model, ids, paddle.ones_like(ids), len(prompt), paddle.to_tensor([response]),
                                 temperature=1.0)
        (-logp.sum() / tokens).backward()  # the gradient of the batch's mean NLL, record by record
        total -= float(logp.sum())
        assert response[-1] in tok.eos_token_ids  # the response ends in a stop token
    assert logged == pytest.approx(total / tokens, rel=1e-5)
    # the update's gradient is that of the mean over all 8 records (two micro-batches of 4 sum to it)
    norm = float(np.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters() if p.grad is not None)))
    assert row["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    # with the prompt's tokens in the loss the number would differ
    whole = 0.0
    for item in trainer.train_data.items:
        seq = item["prompt_ids"] + item["response_ids"]
        ids = paddle.to_tensor([seq])
        logp, _ = token_logprobs(model, ids, paddle.ones_like(ids), 1, paddle.to_tensor([seq[1:]]), temperature=1.0)
        whole -= float(logp.sum())
    assert abs(whole / sum(len(i["prompt_ids"]) + len(i["response_ids"]) - 1 for i in trainer.train_data.items)
               - logged) > 1e-3


def _command(micro, tmp_path, out, data, **extra):
    """`paddle-rl sft` in a process of its own (parameter and optimizer-state names as a real run has them)."""
    args = [f for f in _overrides(micro, out, data, **extra) if not f.startswith("report_to")]
    config = tmp_path / "sft.yaml"
    config.write_text("report_to: none\n")
    proc = subprocess.run([sys.executable, "-m", "paddle_rl", "sft", str(config), *args], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(str(out / "metrics.jsonl"))


def test_sft_learns_and_resumes_exactly(micro, tmp_path):
    data = _records(micro, tmp_path / "sft.jsonl", count=16)
    # a constant learning rate: a run told max_steps=12 takes the same 12 steps as the first half of one told 24
    full = tmp_path / "full"
    rows = _command(micro, tmp_path, full, data, max_steps=24, save_steps=12, lr_scheduler_type="constant")
    first, last = rows[0]["actor/sft_loss"], rows[-1]["actor/sft_loss"]
    assert last < 0.7 * first, (first, last)
    # a run that stops after step 12 (its end-of-run checkpoint-12), then a fresh folder holding only that
    # checkpoint resumed to step 24: together they reproduce the uninterrupted run's steps and final weights
    stopped = tmp_path / "stopped"
    head = _command(micro, tmp_path, stopped, data, max_steps=12, save_steps=12, lr_scheduler_type="constant")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(stopped / "checkpoint-12", resumed / "checkpoint-12")
    tail = _command(micro, tmp_path, resumed, data, max_steps=24, save_steps=12, lr_scheduler_type="constant",
                    resume_from_checkpoint="auto")
    assert [r["step"] for r in head] == list(range(1, 13)) and [r["step"] for r in tail] == list(range(13, 25))
    assert [r["step"] for r in rows] == list(range(1, 25))
    for a, b in zip(rows, head + tail):
        assert a["actor/sft_loss"] == b["actor/sft_loss"] and a["actor/grad_norm"] == b["actor/grad_norm"], a["step"]
    w1, w2 = (load_state(str(d / "checkpoint-24")) for d in (full, resumed))
    assert w1.keys() == w2.keys() and all(np.array_equal(w1[k], w2[k]) for k in w1)


def test_keys_sft_does_not_use_are_refused(micro, tmp_path):
    from paddle_rl.trainer import SFTTrainer
    data = _records(micro, tmp_path / "sft.jsonl", count=8)
    with pytest.raises(ConfigError, match="kl_loss_coeff"):
        SFTTrainer(load_config(None, _overrides(micro, tmp_path / "o", data, kl_loss_coeff=0.1)))
    with pytest.raises(ConfigError, match="async_rollout: not used by supervised"):
        SFTTrainer(load_config(None, _overrides(micro, tmp_path / "o", data, async_rollout=True)))


def test_a_record_without_a_response_names_its_line(micro, tmp_path):
    from paddle_rl.data.loader import DatasetError
    from paddle_rl.trainer import SFTTrainer
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DatasetError, match="bad.jsonl:1: no response to learn"):
        SFTTrainer(load_config(None, _overrides(micro, tmp_path / "o", str(path))))


def test_command_on_messages_records(micro, tmp_path):
    data = _records(micro, tmp_path / "msgs.jsonl", count=8, messages=True)
    out = tmp_path / "cli"
    rows = _command(micro, tmp_path, out, data, max_steps=2, save_steps=2)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["actor/sft_loss"]) for r in rows)
    assert (out / "checkpoint-2" / "model.safetensors").exists()


def test_data_parallel_equals_one_process(micro, tmp_path):
    """DP=2 through run_rl.py --sft: the same losses and weights as one process (each rank half of every batch)."""
    from test_parallel import ROOT, launch, rel_err
    data = _records(micro, tmp_path / "sft.jsonl", count=16)
    one = _command(micro, tmp_path, tmp_path / "one", data, max_steps=3, save_steps=3)
    args = [f for f in _overrides(micro, tmp_path / "dp", data, max_steps=3, save_steps=3)
            if not f.startswith("report_to")] + ["report_to=none"]
    launch([os.path.join(ROOT, "paddle_rl", "run_rl.py"), str(tmp_path / "sft.yaml"), *args, "--sft"],
           str(tmp_path / "log"))
    two = read_metrics(str(tmp_path / "dp" / "metrics.jsonl"))
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["actor/sft_loss"] == pytest.approx(a["actor/sft_loss"], rel=1e-5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    w1, w2 = (load_state(str(tmp_path / d / "checkpoint-3")) for d in ("one", "dp"))
    assert max(rel_err(w1[k], w2[k]) for k in w1) < 1e-5


def test_packed_micro_batches_equal_padded(micro, tmp_path):
    """use_remove_padding with a token budget (several packed micro-batches) gives the padded run's loss and
    gradient norm: SFT runs through the same micro-batching as RL."""
    data = _records(micro, tmp_path / "sft.jsonl", count=8)
    padded = _command(micro, tmp_path, tmp_path / "padded", data, max_steps=2, save_steps=10)
    packed = _command(micro, tmp_path, tmp_path / "packed", data, max_steps=2, save_steps=10,
                      use_remove_padding=True, max_tokens_per_micro_batch=200)
    for a, b in zip(padded, packed):
        assert b["actor/sft_loss"] == pytest.approx(a["actor/sft_loss"], rel=1e-5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)


def _conversations(micro, path, count=8):
    """ms-swift multi-turn records: a calculator call, the tool's answer, the final answer (the micro template's
    generation prompt opens `<think>`, so each assistant turn starts with it)."""
    rows = [json.loads(line) for line in open(micro["train"])][:count]
    with open(path, "w") as f:
        for r in rows:
            user = r["src"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            call = '<think> I check.</think>\n<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}' \
                   '</tool_call>'
            f.write(json.dumps({"messages": [
                {"role": "user", "content": user}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "3 knights"},
                {"role": "assistant", "content": "<think>" + sft_response(r["tgt"]).removesuffix("<|im_end|>")}]})
                    + "\n")
    return str(path)


def test_multi_turn_records_learn_their_assistant_turns_only(micro, tmp_path):
    """A conversation with several assistant turns: the prompt is the conversation up to the first, every assistant
    turn (through its stop token) is in the loss, the tool's turn and the turn headers are context; step 1's loss
    equals the mean NLL of exactly those tokens in a full forward."""
    from paddle_rl.models import load_model
    from paddle_rl.models.logprobs import token_logprobs
    tok = micro["tokenizer"]
    data = _conversations(micro, tmp_path / "conv.jsonl")
    trainer = _sft(_overrides(micro, tmp_path / "out", data, max_steps=1, save_steps=10, max_dec_len=200))
    row = read_metrics(str(tmp_path / "out" / "metrics.jsonl"))[0]
    logged = row["actor/sft_loss"]
    items = trainer.train_data.items
    item = items[0]
    text = tok.decode(item["response_ids"])
    learned = tok.decode([t for t, m in zip(item["response_ids"], item["loss_mask"]) if m])
    context = tok.decode([t for t, m in zip(item["response_ids"], item["loss_mask"]) if not m])
    assert tok.decode(item["prompt_ids"]).endswith("<|im_start|>assistant\n<think>") and "tool_call" not in \
        tok.decode(item["prompt_ids"])
    assert "3 knights" in context and "3 knights" not in learned and "<|im_start|>tool" in context
    assert "calculator" in learned and "<answer>" in learned and learned.count("<|im_end|>") == 2
    assert text.endswith("<|im_end|>") and item["response_ids"][-1] in tok.eos_token_ids
    model = load_model(micro["model"])
    model.eval()
    total, tokens = 0.0, 0.0
    for item in items:
        prompt, response = item["prompt_ids"], item["response_ids"]
        ids = paddle.to_tensor([prompt + response])
        logp, _ = token_logprobs(model, ids, paddle.ones_like(ids), len(prompt), paddle.to_tensor([response]),
                                 temperature=1.0)
        mask = np.array(item["loss_mask"], dtype=np.float32)
        total -= float((logp.numpy()[0] * mask).sum())
        tokens += mask.sum()
    assert logged == pytest.approx(total / tokens, rel=1e-5)
    # the tool's turn and the headers are attended to but not trained (the random model's NLL is about the same on
    # every token, so the count is what tells them apart)
    assert row["perf/trained_tokens"] == tokens < sum(len(i["response_ids"]) for i in items)


def test_a_conversation_the_template_cannot_split_names_the_turn(micro, tmp_path):
    """The micro template's generation prompt opens `<think>`; an assistant turn that does not start with it
    cannot be located in the rendering: the error names the record and the turn."""
    from paddle_rl.data.loader import DatasetError
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                             {"role": "user", "content": "again"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: messages\[1\] \(assistant\) cannot be located"):
        _sft(_overrides(micro, tmp_path / "out", str(path), global_batch_size=1, global_mini_batch_size=1,
                        per_device_train_batch_size=1))

"""Prompt datasets: every bad record named by file:line, prompt overflow counted, the three record formats,
and a sampler that resumes the exact sequence of batches."""
import json
import logging
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paddle_rl.data.loader import DatasetError, PromptSampler, load_prompt_dataset, read_records
from paddle_rl.data.templates import QWEN25_CHAT_TEMPLATE, render_qwen25
from paddle_rl.models.tokenizer import Tokenizer
from paddle_rl.rewards.base import RewardSample
from paddle_rl.rewards.plugins import PluginFunction

WORDS = ("what is one plus two three four five six seven eight nine ten the answer a b c d e f g h "
         "system user assistant solve think").split()


def make_tokenizer(folder, chat_template=QWEN25_CHAT_TEMPLATE):
    """A word-level tokenizer (one token per word or punctuation run) with the Qwen2.5 special tokens."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------------------------- errors

def test_malformed_line_names_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"src": "a", "tgt": "1"}, "", '{"src": "b", "tgt": '])
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: invalid JSON"):
        load_prompt_dataset(path, tok)
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: invalid JSON"):
        read_records(path)


@pytest.mark.parametrize("record, reason", [
    ({"text": "a b", "tgt": "1"}, r"no prompt: expected key 'src'.*record keys: text, tgt"),
    ({"src": "a b"}, r"no ground truth: expected key 'tgt'"),
    ({"src": 12, "tgt": "1"}, r"'src' must be a string.*got int"),
    ({"src": "   ", "tgt": "1"}, r"'src' is an empty prompt"),
    ({"src": "a", "tgt": ""}, r"'tgt' is an empty ground truth"),
    ({"messages": [{"role": "user", "content": ["x"]}], "solution": "1"}, r"messages\[0\]\.content must be a string"),
    ({"messages": [{"role": "robot", "content": "x"}], "solution": "1"}, r"messages\[0\]\.role must be one of"),
    ({"messages": "hello", "solution": "1"}, r"'messages' must be a list"),
    ({"messages": [{"role": "system", "content": "s"}], "solution": "1"}, r"'messages' has no user turn"),
    ({"prompt": [{"role": "user", "content": "a"}], "reward_model": "1"}, r"'reward_model' must be an object"),
    ([1, 2], r"expected a JSON object, got list"),
])
def test_bad_record_names_file_line_and_reason(tmp_path, tok, record, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"src": "a b", "tgt": "1"}, record])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: " + reason):
        load_prompt_dataset(path, tok)


def test_ground_truth_optional_when_asked(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"src": "a b"}])
    data = load_prompt_dataset(path, tok, require_ground_truth=False)
    assert data[0]["ground_truth"] is None


def test_chat_record_needs_a_chat_template(tmp_path):
    plain = make_tokenizer(tmp_path / "plain", chat_template=None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}], "solution": "1"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: chat-form prompt but the tokenizer has no chat_template"):
        load_prompt_dataset(path, plain)


def test_missing_file_and_bad_overflow(tmp_path, tok):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"), tok)
    path = write_jsonl(tmp_path / "d.jsonl", [{"src": "a", "tgt": "1"}])
    with pytest.raises(DatasetError, match="prompt_overflow"):
        load_prompt_dataset(path, tok, overflow="cut")


# ----------------------------------------------------------------------------------------------- overflow

def _overflow_file(tmp_path):
    """Prompts counted in tokens as written (loaded with apply_chat_template false: no template around them)."""
    return write_jsonl(tmp_path / "o.jsonl", [
        {"src": "a b c", "tgt": "1"},
        {"src": "a b c d e f g", "tgt": "2"},       # 7 tokens
        {"src": "one two", "tgt": "3"},
        {"src": "a b c d e f", "tgt": "4"},         # 6 tokens
    ])


def test_truncate_keeps_the_end_and_counts(tmp_path, tok, caplog):
    path = _overflow_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="paddle_rl"):
        data = load_prompt_dataset(path, tok, max_prompt_len=4, overflow="truncate", apply_chat_template="false")
    assert len(data) == 4
    assert data.stats["truncated"] == 2 and data.stats["dropped"] == 0
    assert data.stats["records"] == 4 and data.stats["kept"] == 4 and data.stats["longest_prompt"] == 7
    assert data[1]["prompt_ids"] == tok.encode("d e f g")
    assert all(len(it["prompt_ids"]) <= 4 for it in data.items)
    text = caplog.text
    assert "4 prompts from 4 records" in text and "2 truncated" in text
    assert any(r.levelno == logging.WARNING and "2 prompts over max_prompt_len=4 truncated" in r.getMessage()
               for r in caplog.records)


def test_drop_removes_and_counts(tmp_path, tok, caplog):
    path = _overflow_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="paddle_rl"):
        data = load_prompt_dataset(path, tok, max_prompt_len=4, overflow="drop", apply_chat_template="false")
    assert [it["ground_truth"] for it in data.items] == ["1", "3"]
    assert data.stats["dropped"] == 2 and data.stats["truncated"] == 0 and data.stats["kept"] == 2
    assert "2 prompts over max_prompt_len=4 dropped" in caplog.text
    with pytest.raises(DatasetError, match="no usable prompts"):
        load_prompt_dataset(path, tok, max_prompt_len=1, overflow="drop", apply_chat_template="false")


def test_limit_and_uids(tmp_path, tok):
    path = _overflow_file(tmp_path)
    data = load_prompt_dataset(path, tok, max_prompt_len=4, overflow="drop", limit=2, apply_chat_template="false")
    assert [it["uid"] for it in data.items] == ["o.jsonl:1", "o.jsonl:3"]


# ----------------------------------------------------------------------------------------------- formats

def test_paddlenlp_record(tmp_path, tok):
    src = render_qwen25([{"role": "user", "content": "what is one plus two"}]) + "<think>"
    path = write_jsonl(tmp_path / "p.jsonl", [{"src": src, "tgt": 3}, {"src": ["one plus two", "three", "solve"],
                                                                      "tgt": "x"}])
    data = load_prompt_dataset(path, tok)
    assert data[0]["prompt"] == src and data[0]["ground_truth"] == "3"
    assert data[0]["prompt_ids"] == tok.encode(src)
    assert data[1]["prompt"] == tok.apply_chat_template([
        {"role": "user", "content": "one plus two"}, {"role": "assistant", "content": "three"},
        {"role": "user", "content": "solve"}])


def test_ms_swift_record_extra_fields_reach_rewards(tmp_path, tok):
    record = {"messages": [{"role": "system", "content": "think"},
                           {"role": "user", "content": "what is one plus two"},
                           {"role": "assistant", "content": "three"}],
              "solution": "3", "difficulty": "easy", "tags": ["add"], "data_source": "arith"}
    path = write_jsonl(tmp_path / "s.jsonl", [record])
    item = load_prompt_dataset(path, tok)[0]
    assert item["prompt"] == render_qwen25(record["messages"][:2])
    assert item["ground_truth"] == "3" and item["data_source"] == "arith"
    assert item["record"]["difficulty"] == "easy"

    seen = {}

    def swift_reward(completions, solution, difficulty, tags, **kwargs):
        seen.update(solution=solution, difficulty=difficulty, tags=tags)
        return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]

    sample = RewardSample(item["prompt"], "3<|im_end|>", dict(item["record"]))
    scores, _ = PluginFunction("swift_reward", swift_reward, "test")([sample])
    assert scores.tolist() == [1.0]
    assert seen == {"solution": ["3"], "difficulty": ["easy"], "tags": [["add"]]}


def test_verl_record(tmp_path, tok):
    record = {"data_source": "openai/gsm8k",
              "prompt": [{"role": "user", "content": "what is one plus two"}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"},
              "extra_info": {"split": "train", "index": 7}}
    path = write_jsonl(tmp_path / "v.jsonl", [record])
    item = load_prompt_dataset(path, tok)[0]
    assert item["prompt"] == render_qwen25(record["prompt"])
    assert item["ground_truth"] == "3" and item["data_source"] == "openai/gsm8k"

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.strip() == ground_truth and extra_info["index"] == 7),
                "acc": data_source == "openai/gsm8k"}

    sample = RewardSample(item["prompt"], "3", dict(item["record"]))
    scores, correct = PluginFunction("compute_score", compute_score, "test")([sample])
    assert scores.tolist() == [1.0] and correct.tolist() == [True]


def test_verl_parquet(tmp_path, tok):
    rows = [{"data_source": "d", "prompt": [{"role": "user", "content": f"what is {w}"}],
             "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": i}}
            for i, w in enumerate(["one", "two"])]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "v.parquet"))
    data = load_prompt_dataset(str(tmp_path / "v.parquet"), tok)
    assert [it["ground_truth"] for it in data.items] == ["one", "two"]
    assert data[1]["record"]["extra_info"] == {"index": 1}
    assert isinstance(data[1]["record"]["prompt"], list)
    assert data[1]["uid"] == "v.parquet:2"
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet: cannot read parquet"):
        load_prompt_dataset(str(tmp_path / "bad.parquet"), tok)


def test_parquet_without_pyarrow_says_so(tmp_path, tok, monkeypatch):
    (tmp_path / "v.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"v\.parquet: reading parquet files needs the pyarrow package"):
        load_prompt_dataset(str(tmp_path / "v.parquet"), tok)


def test_json_list_and_several_files(tmp_path, tok):
    (tmp_path / "a.json").write_text(json.dumps([{"src": "a", "tgt": "1"}, {"src": "b", "tgt": "2"}]))
    path_b = write_jsonl(tmp_path / "b.jsonl", [{"src": "c", "tgt": "3"}])
    data = load_prompt_dataset(f"{tmp_path / 'a.json'}, {path_b}", tok)
    assert [it["ground_truth"] for it in data.items] == ["1", "2", "3"]
    assert data.stats["files"] == 2
    (tmp_path / "c.json").write_text(json.dumps([{"src": "a", "tgt": "1"}, {"src": 5, "tgt": "2"}]))
    with pytest.raises(DatasetError, match=r"c\.json: record 2: 'src' must be"):
        load_prompt_dataset(str(tmp_path / "c.json"), tok)


# ----------------------------------------------------------------------------------------------- sampler

def test_seeded_shuffle():
    a = PromptSampler(10, 5, seed=3)
    b = PromptSampler(10, 5, seed=3)
    c = PromptSampler(10, 5, seed=4)
    seq_a = [a.next_batch() for _ in range(4)]
    assert seq_a == [b.next_batch() for _ in range(4)]
    assert seq_a != [c.next_batch() for _ in range(4)]
    assert sorted(seq_a[0] + seq_a[1]) == list(range(10)) == sorted(seq_a[2] + seq_a[3])
    assert seq_a[:2] != seq_a[2:]                      # a new order each epoch
    plain = PromptSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert [plain.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert plain.batches_per_epoch == 3


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_resumes_exactly_across_epochs(drop_last):
    ref = PromptSampler(7, 3, seed=11, drop_last=drop_last)
    expected = [ref.next_batch() for _ in range(8)]    # crosses several epoch boundaries
    for cut in range(1, 8):
        first = PromptSampler(7, 3, seed=11, drop_last=drop_last)
        got = [first.next_batch() for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))   # as a checkpoint stores it
        resumed = PromptSampler(7, 3, seed=11, drop_last=drop_last)
        resumed.set_state_dict(state)
        assert resumed.epoch == first.epoch
        got += [resumed.next_batch() for _ in range(8 - cut)]
        assert got == expected, f"resume after {cut} batches"
    per_epoch = 2 if drop_last else 3
    assert ref.batches_per_epoch == per_epoch
    assert ref.epoch == (8 - 1) // per_epoch


def test_sampler_warns_when_resumed_with_other_settings(caplog):
    state = PromptSampler(8, 2, seed=1).state_dict()
    other = PromptSampler(9, 2, seed=1)
    with caplog.at_level(logging.WARNING, logger="paddle_rl"):
        other.set_state_dict(state)
    assert "size 8 -> 9" in caplog.text
    old_style = PromptSampler(8, 2, seed=1)
    old_style.set_state_dict({"epoch": 2, "position": 4})
    assert (old_style.epoch, old_style.position) == (2, 4)
    with pytest.raises(DatasetError, match="exceeds the 3 training prompts"):
        PromptSampler(3, 4, seed=0)

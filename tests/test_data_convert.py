"""`paddle-rl data convert`: GSM8K / MATH / NuminaMath files -> paddlenlp, chat and verl layouts, read back by
the prompt loader with the right prompt and ground truth."""
import json
import sys

import pytest

from paddle_rl.cli import main as cli_main
from paddle_rl.data.convert import (
    ConvertError,
    convert_files,
    gsm8k_final_answer,
    last_boxed_content,
    write_records,
)
from paddle_rl.data.loader import load_prompt_dataset, read_records
from paddle_rl.data.templates import QWEN25_CHAT_TEMPLATE, render_qwen25, system_prompt
from paddle_rl.models.tokenizer import Tokenizer

# a template unlike Qwen2.5's, to see that --tokenizer uses the folder's own
OTHER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs at $2 each. Revenue?", "answer": "1000 * 2 = 2000\n#### $2,000"},
    {"question": "No final marker here.", "answer": "It is 5."},
]
MATH = [
    {"problem": "What is $\\frac{2}{4}$ in lowest terms?", "level": "Level 1", "type": "Prealgebra",
     "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Compute $3^2$.", "level": "Level 1", "type": "Algebra",
     "solution": "First $\\boxed{6}$ is wrong; $3^2 = \\boxed{9}$."},
]
NUMINA = [
    {"source": "olympiads", "problem": "Find x if 2x = 10.",
     "solution": "x = 5, so the answer is $\\boxed{5}$.",
     "messages": [{"role": "user", "content": "Find x if 2x = 10."},
                  {"role": "assistant", "content": "x = 5, so the answer is $\\boxed{5}$."}]},
    {"source": "olympiads", "problem": "Prove that 1 < 2.", "solution": "Obvious.",
     "messages": [{"role": "user", "content": "Prove that 1 < 2."}, {"role": "assistant", "content": "Obvious."}]},
    {"source": "amc_aime", "problem": "", "solution": "",
     "messages": [{"role": "user", "content": "What is 6 * 7?"},
                  {"role": "assistant", "content": "It is \\boxed{42}."}]},
]


def make_tokenizer(folder, chat_template):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "what": 1, "is": 2, "the": 3, "answer": 4}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return Tokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("qwen_tok"), QWEN25_CHAT_TEMPLATE)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def messages(question, task):
    return [{"role": "system", "content": system_prompt(task)}, {"role": "user", "content": question}]


# ----------------------------------------------------------------------------------------------- answers

@pytest.mark.parametrize("text, value", [
    ("so 7\n#### 7", "7"), ("#### 1,000", "1000"), ("#### $2,000.", "2000"), ("#### -3.5", "-3.5"),
    ("#### 1\nmore\n#### 2", "2"), ("no marker 5", None), ("####   ", None),
])
def test_gsm8k_final_answer(text, value):
    assert gsm8k_final_answer(text) == value


@pytest.mark.parametrize("text, value", [
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"), ("\\boxed{1} then \\boxed{ {2}+3 }", "{2}+3"),
    ("\\fbox{x^{2}}", "x^{2}"), ("\\boxed 5$", "5"), ("\\boxed{unclosed", None), ("none", None),
])
def test_last_boxed_content(text, value):
    assert last_boxed_content(text) == value


# ----------------------------------------------------------------------------------------------- round trips

def test_gsm8k_to_paddlenlp_round_trip(tmp_path, qwen_tok):
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    out = str(tmp_path / "out" / "train.jsonl")
    result = convert_files([src], out)
    assert result.source == "gsm8k" and result.written == 2
    assert result.skipped == [f"{src}:3"]
    raw = read_records(out)
    assert set(raw[0]) == {"src", "tgt", "data_source"} and raw[0]["data_source"] == "gsm8k"

    data = load_prompt_dataset(out, qwen_tok, "src", "tgt", max_prompt_len=4096)
    for item, record, truth in zip(data.items, GSM8K, ["7", "2000"]):
        assert item["prompt"] == render_qwen25(messages(record["question"], "gsm8k")) + "<think>"
        assert item["prompt"].endswith("<|im_start|>assistant\n<think>")
        assert "####" in item["prompt"] and "<answer>" in item["prompt"]
        assert item["ground_truth"] == truth and item["data_source"] == "gsm8k"
    from paddle_rl.rewards.rules import gsm8k_score
    assert gsm8k_score("3 + 4 = 7 </think> <answer> #### 7 </answer><|im_end|>", data[0]["ground_truth"]) == 1.0
    assert gsm8k_score("</think> <answer> #### 2,000 </answer>", data[1]["ground_truth"]) == 1.0


def test_math_to_chat_round_trip(tmp_path, qwen_tok):
    src = write_jsonl(tmp_path / "math.jsonl", MATH)
    out = str(tmp_path / "math.chat.jsonl")
    result = convert_files([src], out, layout="chat")
    assert result.source == "math" and result.written == 2 and not result.skipped
    raw = read_records(out)
    assert raw[0]["messages"] == messages(MATH[0]["problem"], "math")
    assert raw[0]["level"] == "Level 1" and raw[0]["type"] == "Prealgebra"

    data = load_prompt_dataset(out, qwen_tok, "src", "tgt", max_prompt_len=4096)
    assert [it["ground_truth"] for it in data.items] == ["\\frac{1}{2}", "9"]
    assert data[0]["prompt"] == render_qwen25(messages(MATH[0]["problem"], "math"))
    assert data[0]["prompt"] == qwen_tok.apply_chat_template(raw[0]["messages"])
    assert data[1]["record"]["type"] == "Algebra"          # extra fields travel with the record
    assert data[0]["data_source"] == "math"


def test_math_explicit_answer_field(tmp_path, qwen_tok):
    src = write_jsonl(tmp_path / "math500.jsonl", [{"problem": "p?", "solution": "\\boxed{2}", "answer": "3"}])
    out = str(tmp_path / "m.jsonl")
    convert_files([src], out, source="math")
    assert load_prompt_dataset(out, qwen_tok, max_prompt_len=4096)[0]["ground_truth"] == "3"


def test_numina_parquet_to_verl_round_trip(tmp_path, qwen_tok):
    src = str(tmp_path / "numina.parquet")
    write_records(src, NUMINA)
    out = str(tmp_path / "numina.verl.parquet")
    result = convert_files([src], out, layout="verl")
    assert result.source == "numina" and result.written == 2
    assert result.skipped == [f"{src}: row 2"]

    data = load_prompt_dataset(out, qwen_tok, max_prompt_len=4096)
    assert [it["ground_truth"] for it in data.items] == ["5", "42"]
    assert data[1]["prompt"] == render_qwen25(messages("What is 6 * 7?", "math"))
    assert data[0]["data_source"] == "numina_math"
    assert data[0]["record"]["extra_info"]["source"] == "olympiads"
    assert data[1]["record"]["reward_model"] == {"style": "rule", "ground_truth": "42"}


def test_tokenizer_folder_template(tmp_path):
    folder = tmp_path / "tok"
    tok = make_tokenizer(folder, OTHER_TEMPLATE)
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K[:1])
    out = str(tmp_path / "t.jsonl")
    convert_files([src], out, tokenizer=str(folder), system="Be brief.")
    item = load_prompt_dataset(out, tok, max_prompt_len=4096)[0]
    assert item["prompt"] == f"[system] Be brief.\n[user] {GSM8K[0]['question']}\n[assistant] <think>"
    convert_files([src], out, tokenizer=str(folder), system="", think=False)
    item = load_prompt_dataset(out, tok, max_prompt_len=4096)[0]
    assert item["prompt"] == f"[user] {GSM8K[0]['question']}\n[assistant] "


def test_plain_template(tmp_path, qwen_tok):
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K[:1])
    out = str(tmp_path / "plain.jsonl")
    convert_files([src], out, template="plain", system="S.")
    assert read_records(out)[0]["src"] == f"S.\nUser: {GSM8K[0]['question']}\nAssistant: <think>"


# ----------------------------------------------------------------------------------------------- CLI and errors

def test_cli(tmp_path, qwen_tok, capsys):
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    out = str(tmp_path / "cli" / "train.jsonl")
    assert cli_main(["data", "convert", src, "--out", out, "--layout", "chat", "--data-source", "openai/gsm8k",
                     "--limit", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    raw = read_records(out)
    assert len(raw) == 1 and raw[0]["data_source"] == "openai/gsm8k" and raw[0]["solution"] == "7"

    assert cli_main(["data", "convert", src, "--out", out, "--strict"]) == 1
    assert f"{src}:3: no final answer found (no ####)" in capsys.readouterr().err


def test_errors_name_the_record(tmp_path):
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "x"}])
    with pytest.raises(ConvertError, match=r"odd\.jsonl:1: cannot tell the dataset format.*keys \(text\)"):
        convert_files([odd], str(tmp_path / "o.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [GSM8K[0], {"question": 5, "answer": "#### 1"}])
    with pytest.raises(ConvertError, match=r"bad\.jsonl:2: gsm8k: expected a non-empty string under 'question'"):
        convert_files([bad], str(tmp_path / "o.jsonl"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GSM8K[0]) + "\n{oops\n")
    with pytest.raises(ConvertError, match=r"broken\.jsonl:2: invalid JSON"):
        convert_files([str(broken)], str(tmp_path / "o.jsonl"))
    none = write_jsonl(tmp_path / "none.jsonl", GSM8K[2:])
    with pytest.raises(ConvertError, match="no record with a final answer"):
        convert_files([none], str(tmp_path / "o.jsonl"))
    with pytest.raises(ConvertError, match="is also an input"):
        convert_files([none], none)
    with pytest.raises(ConvertError, match="tokenizer file not found"):
        convert_files([bad], str(tmp_path / "o.jsonl"), tokenizer=str(tmp_path / "missing"))


def test_parquet_output_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConvertError, match="writing parquet files needs the pyarrow package"):
        write_records(str(tmp_path / "x.parquet"), [{"a": 1}])

"""Records written by others, read as their own frameworks read them: PaddleNLP's GRPO guide (its KK record: `src` /
`tgt` as one-item lists, the prompt already in Qwen2.5's chat form), PaddleNLP's multi-round lists, Logic-RL's verl
rows (one templated user message, a mapping as ground truth), ms-swift messages and plain-question arrays; one
templating rule for all of them (records.ChatForm, `apply_chat_template`), never a prompt templated twice."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from paddle_rl.cli import main as cli_main
from paddle_rl.config import ConfigError, load_config
from paddle_rl.data.kk.render import GUIDE_SYSTEM_PROMPT, render_prompt
from paddle_rl.data.kk_cli import main as kk_main
from paddle_rl.data.loader import DatasetError, load_prompt_dataset, load_sft_dataset
from paddle_rl.data.templates import QWEN25_CHAT_TEMPLATE
from paddle_rl.models import Tokenizer
from paddle_rl.monitor import read_metrics
from paddle_rl.rewards.kk import kk_score
from paddle_rl.trainer.preflight import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GUIDE = os.path.join(FIXTURES, "paddlenlp_kk_guide.jsonl")          # PaddleNLP's GRPO guide, its KK example
MULTI = os.path.join(FIXTURES, "paddlenlp_multiturn.jsonl")         # src[i] / tgt[i] rounds; odd turns
VERL_KK = os.path.join(FIXTURES, "verl_kk_logic_rl.jsonl")          # Logic-RL's verl row
KK_MODEL = os.path.join(ROOT, "data", "tiny", "model")              # Qwen2 layout, ChatML markers

RIGHT = " Michael and Zoey agree. </think> <answer> (1) Michael is a knight\n(2) Zoey is a knight\n" \
        "(3) Ethan is a knight </answer><|im_end|>"
WRONG = " Ethan lies. </think> <answer> (1) Michael is a knight\n(2) Zoey is a knight\n" \
        "(3) Ethan is a knave </answer><|im_end|>"


def guide_record() -> dict:
    with open(GUIDE, encoding="utf-8") as f:
        return json.loads(f.readline())


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(KK_MODEL)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ---- PaddleNLP's guide: its KK record as written, its label as the kk rule reads it

def test_guide_kk_record_is_used_as_written_and_its_label_is_the_tgt_item(tok):
    record = guide_record()
    assert isinstance(record["src"], list) and isinstance(record["tgt"], list)
    item = load_prompt_dataset(GUIDE, tok, max_prompt_len=2048)[0]
    assert item["prompt"] == record["src"][0] and item["prompt_form"] == "as_is"
    assert item["prompt_ids"] == tok.encode(record["src"][0])
    assert item["prompt"].count("<|im_start|>") == 3  # system, user, assistant: not wrapped in a fourth turn
    assert item["ground_truth"] == record["tgt"][0]
    assert kk_score(RIGHT, item["ground_truth"], item["prompt"]) == 3.0
    assert kk_score(WRONG, item["ground_truth"], item["prompt"]) == -0.5
    # the label as the list it is in the file scores the right answer as wrong: what reading it as-is did
    assert kk_score(RIGHT, str(record["tgt"]), item["prompt"]) < 3.0
    # templating the templated prompt once more is refused, naming the file and line
    with pytest.raises(DatasetError, match=r"paddlenlp_kk_guide\.jsonl:1: src\[0\] is already in the tokenizer's chat "
                                           r"form \(it holds '<\|im_start\|>'\): apply_chat_template: true would "
                                           r"template it twice"):
        load_prompt_dataset(GUIDE, tok, max_prompt_len=2048, apply_chat_template="true")


def test_paddle_rl_score_gives_the_guides_right_answer_the_top_kk_score(tmp_path):
    """`paddle-rl score` (the trainer's record reader and reward) on the guide's record with a right and a wrong
    response: 3 and -0.5 (format +1, answer +2 / -1.5)."""
    record = guide_record()
    with open(MULTI, encoding="utf-8") as f:
        rounds = json.loads(f.readline())   # src[i] / tgt[i] rounds: the label is the last tgt
    right = " x </think> <answer> (1) Isabella is a knight\n(2) Isaiah is a knave </answer>"
    responses = write_jsonl(tmp_path / "r.jsonl", [dict(record, response=RIGHT), dict(record, response=WRONG),
                                                   dict(rounds, response=right)])
    config = tmp_path / "c.yaml"
    config.write_text(f"actor_model_name_or_path: {KK_MODEL}\nreward_funcs: kk\n")
    result = subprocess.run([sys.executable, "-m", "paddle_rl", "score", str(config), "--responses", responses],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["score"] for line in lines] == [3.0, -0.5, 3.0]
    assert [line["correct"] for line in lines] == [True, False, True]


def test_generator_writes_the_guides_layout_byte_for_byte(tmp_path, tok):
    src = guide_record()["src"][0]
    head = "<|im_start|>system\n" + GUIDE_SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n"
    tail = "\n<|im_end|>\n<|im_start|>assistant\n<think>"
    assert src.startswith(head) and src.endswith(tail)
    puzzle = src[len(head):-len(tail)]
    assert render_prompt(puzzle, "paddlenlp") == src
    assert kk_main(["--people", "3", "--num", "2", "--format", "paddlenlp", "--out", str(tmp_path / "kk")]) == 0
    with open(tmp_path / "kk" / "train.jsonl", encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    for record in written:
        assert list(record) == ["src", "tgt"] and len(record["src"]) == 1 and len(record["tgt"]) == 1
        assert record["src"][0].startswith(head) and record["src"][0].endswith(tail)
    data = load_prompt_dataset(str(tmp_path / "kk" / "train.jsonl"), tok, max_prompt_len=2048)
    assert [it["prompt"] for it in data.items] == [r["src"][0] for r in written]
    assert [it["ground_truth"] for it in data.items] == [r["tgt"][0] for r in written]
    with pytest.raises(SystemExit):
        kk_main(["--format", "paddlenlp", "--template", "tiny", "--out", str(tmp_path / "x")])


# ---- PaddleNLP's multi-turn lists

def test_multi_turn_lists_are_a_conversation_ending_in_the_prompt(tmp_path, tok):
    with open(MULTI, encoding="utf-8") as f:
        rounds, turns = [json.loads(line) for line in f]
    data = load_prompt_dataset(MULTI, tok, max_prompt_len=2048)
    # src[i] / tgt[i] rounds: the history of round 1, the prompt of round 2, the label tgt[-1]
    assert data[0]["prompt"] == tok.apply_chat_template([
        {"role": "user", "content": rounds["src"][0]}, {"role": "assistant", "content": rounds["tgt"][0]},
        {"role": "user", "content": rounds["src"][1]}])
    assert data[0]["ground_truth"] == rounds["tgt"][1] and data[0]["prompt_form"] == "templated"
    # an odd src list (PaddleNLP's RL reader): user, assistant, user; the one-item tgt list is the label
    assert data[1]["prompt"] == tok.apply_chat_template([
        {"role": "user", "content": turns["src"][0]}, {"role": "assistant", "content": turns["src"][1]},
        {"role": "user", "content": turns["src"][2]}])
    assert data[1]["ground_truth"] == turns["tgt"][0]
    right = " x </think> <answer> (1) Isabella is a knight\n(2) Isaiah is a knave </answer>"
    assert [kk_score(right, it["ground_truth"]) for it in data.items] == [3.0, 3.0]
    # apply_chat_template false: joined as PaddleNLP's reader joins them, each assistant turn followed by eos
    joined = load_prompt_dataset(MULTI, tok, max_prompt_len=2048, apply_chat_template="false")
    assert joined[0]["prompt"] == rounds["src"][0] + rounds["tgt"][0] + "<|im_end|>" + rounds["src"][1]
    assert joined[1]["prompt"] == turns["src"][0] + turns["src"][1] + "<|im_end|>" + turns["src"][2]
    assert {it["prompt_form"] for it in joined.items} == {"joined"}
    # turns already in chat form are joined as written, never templated again
    piece = "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    path = write_jsonl(tmp_path / "pieces.jsonl", [{"src": [piece, "A1", "<|im_start|>user\nQ2<|im_end|>\n"
                                                                         "<|im_start|>assistant\n<think>"],
                                                    "tgt": ["(1) A is a knight"]}])
    assert load_prompt_dataset(path, tok)[0]["prompt"] == (piece + "A1<|im_end|><|im_start|>user\nQ2<|im_end|>\n"
                                                           "<|im_start|>assistant\n<think>")
    # an even src list with a one-item tgt is neither form: named with the file and line
    bad = write_jsonl(tmp_path / "even.jsonl", [{"src": ["a", "b"], "tgt": ["c"]}])
    with pytest.raises(DatasetError, match=r"even\.jsonl:1: 'src' has 2 items and 'tgt' has 1 items: PaddleNLP "
                                           r"reads a list as src\[i\] / tgt\[i\] rounds"):
        load_prompt_dataset(bad, tok)


def test_multi_round_supervised_record_learns_every_answer(tmp_path):
    """PaddleNLP's SFT reader learns each tgt of src[i] / tgt[i] rounds: so does `paddle-rl sft` (with Qwen2.5's
    template, whose generation prompt each assistant turn starts with)."""
    folder = tmp_path / "tok"
    shutil.copytree(KK_MODEL, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = QWEN25_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tok = Tokenizer.from_pretrained(str(folder))
    data = load_sft_dataset(MULTI, tok, max_prompt_len=2048, max_response_len=2048,
                            stop_ids=[tok.token_to_id("<|im_end|>")])
    with open(MULTI, encoding="utf-8") as f:
        rounds = json.loads(f.readline())
    item = data[0]
    assert item["prompt_ids"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": rounds["src"][0]}]))
    learned = [t for t, m in zip(item["response_ids"], item["loss_mask"]) if m]
    text = tok.decode(learned)
    assert rounds["tgt"][0] in text and rounds["tgt"][1] in text and rounds["src"][1] not in text


# ---- one rule for every framework's records

def test_one_templating_rule_for_every_framework(tmp_path, tok):
    question = "Knights tell the truth, knaves lie. (1) Ann: Ann is a knight. Who is a knight and who is a knave?"
    templated = tok.apply_chat_template([{"role": "user", "content": question}])
    records = [
        {"src": templated, "tgt": "(1) Ann is a knight"},                                     # PaddleNLP string
        {"messages": [{"role": "user", "content": question}], "solution": "(1) Ann is a knight"},   # ms-swift
        {"prompt": [{"role": "user", "content": question}],                                  # verl, a chat list
         "reward_model": {"ground_truth": "(1) Ann is a knight"}, "data_source": "kk"},
        {"prompt": question, "ground_truth": "(1) Ann is a knight", "data_source": "kk"},    # a plain question
    ]
    path = write_jsonl(tmp_path / "all.jsonl", records)
    data = load_prompt_dataset(path, tok)
    assert [it["prompt"] for it in data.items] == [templated] * 4
    assert [it["prompt_form"] for it in data.items] == ["as_is", "templated", "templated", "templated"]
    # seed-003's layout: a JSON array of {prompt, ground_truth, data_source} with plain-string prompts
    array = tmp_path / "seed003.json"
    array.write_text(json.dumps([records[3], dict(records[3], prompt="What is 2 + 2?", ground_truth="4")]))
    assert load_prompt_dataset(str(array), tok)[1]["prompt"] == tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}])
    # apply_chat_template false: the plain question goes as it is; messages cannot
    plain = load_prompt_dataset(str(array), tok, apply_chat_template="false")
    assert plain[0]["prompt"] == question and plain[0]["prompt_form"] == "as_is"
    with pytest.raises(DatasetError, match=r"all\.jsonl:2: 'messages' is a list of messages, which needs the chat "
                                           r"template, and apply_chat_template is false"):
        load_prompt_dataset(path, tok, apply_chat_template="false")
    # a prompt templated for another model's chat format is refused, unless false sends it as it is
    gemma = write_jsonl(tmp_path / "gemma.jsonl", [{"src": "<start_of_turn>user\nhi<end_of_turn>\n", "tgt": "x"}])
    with pytest.raises(DatasetError, match=r"gemma\.jsonl:1: 'src' holds '<start_of_turn>', a turn marker of "
                                           r"another chat format"):
        load_prompt_dataset(gemma, tok)
    assert load_prompt_dataset(gemma, tok, apply_chat_template="false")[0]["prompt"].startswith("<start_of_turn>")
    # templated text inside a conversation's messages would be templated twice
    twice = write_jsonl(tmp_path / "twice.jsonl", [{"messages": [{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": templated}],
                                                    "solution": "x"}])
    with pytest.raises(DatasetError, match=r"twice\.jsonl:1: messages\[1\]\.content is already in the tokenizer's "
                                           r"chat form"):
        load_prompt_dataset(twice, tok)


def test_logic_rl_verl_row_one_templated_message_and_a_mapping_label(tok):
    """Logic-RL's verl rows hold the whole templated prompt as one user message, and the label as a mapping
    (solution_text_format, statements): the message is used as it is, the kk rule reads solution_text_format."""
    with open(VERL_KK, encoding="utf-8") as f:
        row = json.loads(f.readline())
    item = load_prompt_dataset(VERL_KK, tok, max_prompt_len=2048)[0]
    assert item["prompt"] == row["prompt"][0]["content"] and item["prompt_form"] == "as_is"
    assert item["data_source"] == "kk_logic"
    from paddle_rl.rewards import RewardSample, build_local_reward
    config = load_config(overrides={"reward_funcs": ["kk"], "actor_model_name_or_path": KK_MODEL}, warn_unused=False)
    truth = row["reward_model"]["ground_truth"]["solution_text_format"]
    right = f" x </think> <answer> {truth} </answer>"
    wrong = right.replace("(5) Amelia is a knave", "(5) Amelia is a knight")
    result = build_local_reward(config)([RewardSample(item["prompt"], r, item["record"], 12, False)
                                         for r in (right, wrong)])
    assert [float(s) for s in result.scores] == [3.0, -0.5]
    # through a reward server's PaddleNLP protocol (text tgt): the mapping travels as JSON, which the kk rule reads
    from paddle_rl.rewards.client import _label_text
    from paddle_rl.rewards.rules import kk_label
    sent = _label_text(row["reward_model"]["ground_truth"])
    assert json.loads(sent) == row["reward_model"]["ground_truth"] and kk_label(sent) == truth
    assert _label_text(["(1) Ann is a knight"]) == "(1) Ann is a knight"
    with pytest.raises(ValueError, match="the kk rule reads its label as text"):
        kk_label(["(1) Ann is a knight", "(2) Bob is a knave"])


# ---- one training step on the guide's record; its prompt is what the model reads

def test_one_grpo_step_on_the_guides_record(tmp_path, tok):
    """The guide's record trains: max_prompt_len is its prompt's exact token count with prompt_overflow drop, so a
    prompt templated a second time (longer) would leave no prompt to train on."""
    length = len(tok.encode(guide_record()["src"][0]))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "paddle_rl", "train", os.path.join(ROOT, "configs", "tiny_kk_grpo.yaml"),
         f"train_datasets={GUIDE}", "eval_datasets=", "do_eval=false", f"output_dir={out}", f"logging_dir={out}/logs",
         f"max_prompt_len={length}", "prompt_overflow=drop", "max_dec_len=8", "min_dec_len=1", "rollout_n=2",
         "global_batch_size=1", "global_mini_batch_size=1", "dynamic_sampling=false", "max_steps=1",
         "save_strategy=no", "report_to=none", "disable_tqdm=true"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]
    assert f"1 prompts from 1 records (longest {length} tokens; 0 truncated, 0 dropped" in result.stderr


def test_data_show_prints_the_prompt_as_the_model_sees_it(tmp_path, capsys):
    record = guide_record()
    config = tmp_path / "c.yaml"
    config.write_text(f"actor_model_name_or_path: {KK_MODEL}\ntrain_datasets: {GUIDE}\nmax_prompt_len: 2048\n")
    assert cli_main(["data", "show", str(config), "-n", "1"]) == 0
    out = capsys.readouterr().out
    tokens = len(Tokenizer.from_pretrained(KK_MODEL).encode(record["src"][0]))
    assert f"prompt: {tokens} tokens, used as it is" in out
    assert "----- as the model sees it -----\n" + record["src"][0] + "\n----- end of prompt -----" in out
    assert "label (as the rules read it): " + record["tgt"][0] in out
    # the same file forced through the template: the record is refused, with the reason, and the status says so
    assert cli_main(["data", "show", str(config), "apply_chat_template=true"]) == 1
    assert "refused: src[0] is already in the tokenizer's chat form" in capsys.readouterr().out


def test_preflight_names_a_first_record_the_run_would_refuse(tmp_path):
    config = load_config(overrides={"actor_model_name_or_path": KK_MODEL, "train_datasets": GUIDE,
                                    "apply_chat_template": True, "reward_funcs": ["kk"]}, warn_unused=False)
    with pytest.raises(ConfigError) as err:
        preflight(config)
    assert f"train_datasets: {GUIDE}:1: src[0] is already in the tokenizer's chat form" in str(err.value)
    config.apply_chat_template = "auto"
    preflight(config)


# ---- defaults that differ from PaddleNLP's are named; evaluation_strategy epoch acts

def test_defaults_that_differ_from_paddlenlp_are_named_when_left_out(tmp_path, caplog):
    path = tmp_path / "c.yaml"
    path.write_text(f"actor_model_name_or_path: {KK_MODEL}\nrl_algorithm: grpo\nlearning_rate: 1.0e-6\n")
    with caplog.at_level("WARNING", logger="paddle_rl"):
        config = load_config(str(path))
    assert "lr_scheduler_type constant (PaddleNLP: linear)" in config.paddlenlp_differences
    assert not any(d.startswith(("rl_algorithm", "learning_rate")) for d in config.paddlenlp_differences)
    assert "lr_scheduler_type constant (PaddleNLP: linear)" in caplog.text
    # PaddleNLP's own argument file gives every such key: nothing to name
    assert load_config(os.path.join(FIXTURES, "paddlenlp_grpo_argument.yaml"),
                       warn_unused=False).paddlenlp_differences == []
    with pytest.raises(ConfigError, match="evaluation_strategy: must be steps, epoch or no, got 'epochs'"):
        load_config(overrides={"evaluation_strategy": "epochs"})


def test_evaluation_strategy_epoch_evaluates_at_each_pass_over_the_data(micro, tmp_path):
    """64 training prompts, 32 a step: an epoch is 2 steps. `epoch` evaluates at step 0, at the end of each pass
    (step 2) and at the end (step 3), whatever eval_steps says; `steps` follows eval_steps."""
    from micro_model import micro_overrides
    from paddle_rl.trainer import RLTrainer

    def eval_steps_of(strategy, out):
        overrides = micro_overrides(micro, str(out), max_steps=3, global_batch_size=32, global_mini_batch_size=32,
                                    rollout_n=2, per_device_train_batch_size=64, eval_steps=1, save_strategy="no",
                                    evaluation_strategy=strategy, max_eval_samples=4, report_to="none")
        RLTrainer(load_config(None, overrides)).train()
        return [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if "eval/accuracy" in r]
    assert eval_steps_of("epoch", tmp_path / "epoch") == [0, 2, 3]
    assert eval_steps_of("steps", tmp_path / "steps") == [0, 1, 2, 3]


def test_paddlenlp_grpo_argument_file_runs_as_written(tmp_path):
    """PaddleNLP's grpo_argument.yaml, as written, on the bundled KK model: its data paths hold records in the guide's
    layout (`paddle-rl data kk --format paddlenlp`), its reward server is a real one, its tensor_parallel_degree 2
    runs on two processes, bf16 included. Overridden: the model (a 7B one is not here), the lengths and step count a
    CPU test affords, the reward server's port (a free one), report_to (wandb is not installed here)."""
    import shutil
    import socket
    import time
    import httpx
    shutil.copy(os.path.join(FIXTURES, "paddlenlp_grpo_argument.yaml"), tmp_path / "grpo_argument.yaml")
    assert kk_main(["--people", "3,4", "--num", "2", "--format", "paddlenlp",
                    "--out", str(tmp_path / "ppo-kk" / "34567ppl")]) == 0
    assert kk_main(["--people", "5", "--num", "2", "--split", "test", "--format", "paddlenlp",
                    "--out", str(tmp_path / "ppo-kk" / "5ppl")]) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT)
    server = subprocess.Popen([sys.executable, "-m", "reward_server", "--port", str(port), "--reward", "kk"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None, "the reward server did not come up"
                time.sleep(0.2)
        result = subprocess.run(
            [sys.executable, "-m", "paddle_rl", "train", "grpo_argument.yaml", "--nproc_per_node", "2",
             f"actor_model_name_or_path={KK_MODEL}", f"reward_server=http://127.0.0.1:{port}", "max_dec_len=40",
             "max_steps=1", "report_to=visualdl"],
            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.terminate()
        server.wait(30)
    logs = (tmp_path / "log" / "workerlog.0").read_text() if (tmp_path / "log" / "workerlog.0").exists() else ""
    assert result.returncode == 0, result.stderr[-2000:] + logs[-3000:]
    out = tmp_path / "qwen2.5-7b-kk-dataset-grpo" / "checkpoints"   # the file's output_dir
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[0] and "reward/mean" in rows[1]
    assert (out / "checkpoint-1").is_dir() and (tmp_path / "grpo-logs").is_dir()   # the file's logging_dir
    assert "tensor 2" in logs and "compute precision: bfloat16" in logs


def test_preflight_names_a_missing_sandbox_for_each_runner_of_programs(tmp_path):
    """Without bubblewrap on the PATH, the code rule and the tool environment's python tool are both named in the
    one error (each runs untrusted programs), with what to do."""
    code = ("from paddle_rl.trainer import RLTrainer\n"
            "from paddle_rl.config import load_config, ConfigError\n"
            "from paddle_rl.trainer.preflight import preflight\n"
            f"config = load_config(None, {{'actor_model_name_or_path': {KK_MODEL!r}, 'train_datasets': {GUIDE!r},\n"
            "    'reward_funcs': ['code'], 'env_plugin': 'tools', 'max_prompt_len': 2048}, warn_unused=False)\n"
            "try:\n    preflight(config)\nexcept ConfigError as e:\n    print(e)\n")
    bindir = os.path.dirname(sys.executable)   # python, without /usr/bin (where bwrap lives)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT, PATH=bindir))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reward_funcs: the code rule runs untrusted programs in a sandbox, and here bubblewrap (bwrap) is not " \
           "installed: install bubblewrap" in result.stdout
    assert "env_tools: the python tool runs untrusted programs in a sandbox" in result.stdout

"""Folders as transformers 5 writes them (config `rope_parameters` and `dtype`, `chat_template.jinja`,
"TokenizersBackend") and as the Hub's older ones are laid out (`rope_theta`, `torch_dtype`, the chat template
inside tokenizer_config.json) load to the same model and tokenizer; what cannot be honoured is an error naming
the file and the key before anything loads."""
import json
import os

import numpy as np
import paddle
import pytest

from extras import extra  # noqa: E402

torch = extra("torch")
transformers = extra("transformers")

from gguf_files import CHAT_TEMPLATE, hf_model, tiny_bpe  # noqa: E402
from paddle_rl.config import ConfigError, load_config  # noqa: E402
from paddle_rl.trainer.preflight import check_paths
from paddle_rl.models import Tokenizer, load_model, save_model  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 34?"}]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A llama folder written by transformers 5's save_pretrained (model and fast tokenizer)."""
    folder = tmp_path_factory.mktemp("hf5")
    bpe = tiny_bpe()
    model = hf_model("llama", bpe.get_vocab_size(), hidden=64)
    model.save_pretrained(folder)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               bos_token="<|im_start|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return str(folder), model, tok


def _logits(model_dir, ids):
    ours = load_model(model_dir)
    ours.eval()
    with paddle.no_grad():
        return ours(paddle.to_tensor([ids])).numpy()[0]


def test_transformers_5_folder(written):
    folder, model, tok = written
    config = json.load(open(os.path.join(folder, "config.json")))
    tok_config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    # what this test is about: the layout transformers 5 writes
    assert "rope_parameters" in config and "rope_theta" not in config and "dtype" in config
    assert os.path.isfile(os.path.join(folder, "chat_template.jinja")) and "chat_template" not in tok_config
    assert tok_config["tokenizer_class"] == "TokenizersBackend"

    ours = Tokenizer.from_pretrained(folder)
    text = ours.apply_chat_template(MESSAGES)
    assert text == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(text)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(_logits(folder, ids) - expected).max() < 1e-4


def test_older_hub_layout_loads_the_same(written, tmp_path):
    folder, model, tok = written
    old = tmp_path / "old"
    old.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        os.link(os.path.join(folder, name), old / name)
    config = json.load(open(os.path.join(folder, "config.json")))
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], torch_dtype=config.pop("dtype"))
    (old / "config.json").write_text(json.dumps(config))
    tok_config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
    tok_config.update(chat_template=open(os.path.join(folder, "chat_template.jinja")).read(),
                      tokenizer_class="PreTrainedTokenizerFast")
    (old / "tokenizer_config.json").write_text(json.dumps(tok_config))
    ids = Tokenizer.from_pretrained(folder).encode("What is 12 + 34?")
    assert Tokenizer.from_pretrained(str(old)).apply_chat_template(MESSAGES) == \
        Tokenizer.from_pretrained(folder).apply_chat_template(MESSAGES)
    np.testing.assert_array_equal(_logits(str(old), ids), _logits(folder, ids))


def test_saved_config_states_what_was_written(written, tmp_path):
    """A bf16 checkpoint is loaded and saved in float32: the saved config says float32 in both spellings."""
    folder, _, _ = written
    source = tmp_path / "src"
    source.mkdir()
    os.link(os.path.join(folder, "model.safetensors"), source / "model.safetensors")
    config = json.load(open(os.path.join(folder, "config.json")))
    config["dtype"] = "bfloat16"
    (source / "config.json").write_text(json.dumps(config))
    save_model(load_model(str(source)), str(tmp_path / "out"))
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["dtype"] == saved["torch_dtype"] == "float32"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert reloaded.dtype == torch.float32


def _config(folder, data_file):
    return load_config(None, [f"actor_model_name_or_path={folder}", f"train_datasets={data_file}"])


def test_unusable_folders_fail_before_loading(written, tmp_path):
    folder, _, _ = written
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"src": "q", "tgt": "1"}\n')
    # a rope type the decoder does not implement: the file and the key are named
    bad = tmp_path / "yarn"
    bad.mkdir()
    config = json.load(open(os.path.join(folder, "config.json")))
    config["rope_parameters"] = dict(config["rope_parameters"], rope_type="yarn", factor=4.0)
    (bad / "config.json").write_text(json.dumps(config))
    os.link(os.path.join(folder, "tokenizer.json"), bad / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"yarn/config\.json: rope_parameters\.rope_type 'yarn' is not supported"):
        check_paths(_config(str(bad), data_file))
    # a folder without tokenizer.json
    bare = tmp_path / "bare"
    bare.mkdir()
    os.link(os.path.join(folder, "config.json"), bare / "config.json")
    with pytest.raises(ConfigError, match=r"bare/tokenizer\.json not found"):
        check_paths(_config(str(bare), data_file))

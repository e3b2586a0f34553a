"""`paddle-rl score`: the configured rewards on records that carry a response, one JSON line per sample, run as a
real command."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n<think>"
PLUGIN = '''
def fragile(completions, **kwargs):
    for c in completions:
        if "boom" in c:
            raise ValueError("cannot parse " + repr(c[:12]))
    return [0.5] * len(completions)
'''


def _score(tmp_path, rows, *overrides):
    data = tmp_path / "responses.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "paddle_rl", "score", os.path.join(ROOT, "configs", "tiny_arith_grpo.yaml"),
                           "--responses", str(data), *overrides], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_scores_functions_and_reasons(tmp_path):
    plugin = tmp_path / "fragile.py"
    plugin.write_text(PLUGIN)
    rows = [{"src": PROMPT, "tgt": "3", "response": " 1 + 2 = 3.</think>\n<answer>3</answer><|im_end|>"},
            {"src": PROMPT, "tgt": "3", "response": " 1 + 2 = 4.</think>\n<answer>4</answer><|im_end|>"},
            {"src": PROMPT, "tgt": "3", "response": "boom", "data_source": "plugin_only"},
            {"src": PROMPT, "tgt": "3", "response": "<answer>3</answer>", "data_source": "plugin_only"}]
    proc, lines = _score(tmp_path, rows, f"reward_plugins=[{plugin}]", "reward_funcs=[math,format,fragile]",
                         "reward_weights=[1.0,0.5,2.0]", "reward_routes={plugin_only: [fragile]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [ln["line"].rsplit(":", 1)[1] for ln in lines] == ["1", "2", "3", "4"]
    right, wrong, broken, routed = lines
    assert right["functions"] == {"math": 1.0, "format": 1.0, "fragile": 0.5}
    assert right["score"] == 1.0 + 0.5 * 1.0 + 2.0 * 0.5 and right["correct"] is True
    assert wrong["functions"]["math"] == 0.0 and wrong["score"] == 0.5 * 1.0 + 2.0 * 0.5 and wrong["correct"] is False
    # the plugin raised on this sample only: its error is the reason, the others are still scored
    assert broken["score"] is None and "cannot parse 'boom'" in broken["reason"] and "fragile" in broken["reason"]
    assert routed["score"] == 2.0 * 0.5 and routed["functions"]["fragile"] == 0.5
    assert routed["functions"]["math"] is None and "not applied: " in routed["reason"] and "math" in routed["reason"]
    assert "4 samples, 3 scored" in proc.stderr


def test_a_record_without_a_response_is_named(tmp_path):
    proc, _ = _score(tmp_path, [{"src": PROMPT, "tgt": "3"}])
    assert proc.returncode == 2 and "responses.jsonl:1: no `response` string" in proc.stderr

"""Rule rewards, plugins, routing and results, in process, against hand-computed numbers."""
import contextlib
import http.server
import math
import os
import socket
import textwrap
import threading

import numpy as np
import pytest

from paddle_rl.algorithms.dapo import soft_overlong_penalty
from paddle_rl.config import ConfigError, RLConfig, config_from_values, load_config
from paddle_rl.rewards import (RewardError, RewardResult, RewardSample, RuleReward, build_reward,
                               check_reward_config, concat_results, load_plugins)
from paddle_rl.rewards.kk import kk_score
from paddle_rl.rewards.rules import (cosine_value, gsm8k_score, math_answer, math_score, repetition_penalty,
                                     strip_special_tail)

KK_TRUTH = "(1) Zoey is a knight\n(2) Oliver is a knave"


def sample(response, length=0, **record):
    return RewardSample(prompt="p", response=response, record=record, response_length=length)


def score(names, samples, **config):
    # config_from_values: the rules' declared keys (cosine_max_len, ...) are no fields of RLConfig's groups
    return build_reward(config_from_values(dict(reward_funcs=list(names), **config)))(samples)


# ---------------------------------------------------------------------------------------------------- kk

KK_CASES = [
    # correct: format +1, answer +2
    ("Zoey tells the truth.</think>\n<answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer><|im_end|>", 3.0),
    # well-formed, parsed, wrong roles: +1 - 1.5
    ("hmm</think><answer>(1) Zoey is a knave\n(2) Oliver is a knave</answer>", -0.5),
    # well-formed, unparseable (one role word for two people): +1 - 2
    ("hmm</think><answer>Zoey is a knight</answer>", -1.0),
    # bad format: the prompt already opened <think>, so a second one breaks it
    ("<think>hmm</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>", -3.0),
    # bad format: no </answer>
    ("hmm</think><answer>(1) Zoey is a knight (2) Oliver is a knave", -3.0),
    # full transcript: only the text after the last <|im_start|>assistant counts, which carries its own <think>
    ("<|im_start|>user\nwho?<|im_end|>\n<|im_start|>assistant\n<think>ok</think><answer>(1) Zoey is a knight\n"
     "(2) Oliver is a knave</answer><|im_end|>", 3.0),
    # ... and without the <think> there, the format fails
    ("<|im_start|>assistant\nok</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>", -3.0),
]


@pytest.mark.parametrize("response,expected", KK_CASES)
def test_kk_every_branch(response, expected):
    assert kk_score(response, KK_TRUTH) == expected
    result = score(["kk"], [sample(response, tgt=KK_TRUTH)])
    assert result.scores[0] == expected
    assert result.correct[0] == (expected == 3.0)


# ---------------------------------------------------------------------------------------------------- gsm8k

def test_gsm8k_strict_and_flexible():
    assert gsm8k_score("so 1000 + 234 = 1234\n#### 1,234", "1234") == 1.0
    assert gsm8k_score("#### $5", "5") == 1.0
    assert gsm8k_score("#### 5.00", "5") == 1.0
    assert gsm8k_score("#### 3\nno wait\n#### 4<|im_end|>", "4") == 1.0
    assert gsm8k_score("#### 3\nno wait\n#### 4", "3") == 0.0
    assert gsm8k_score("the answer is 72.", "72") == 0.0          # strict needs ####
    assert gsm8k_score("the answer is 72.", "72", flexible=True) == 1.0
    assert gsm8k_score("first 10, then $1,072.", "1072", flexible=True) == 1.0
    assert gsm8k_score("no number here", "3", flexible=True) == 0.0
    # a full gsm8k solution as ground truth: its #### number counts
    assert gsm8k_score("#### 72", "48 + 24 = <<48+24=72>>72\n#### 72") == 1.0
    result = score(["gsm8k", "gsm8k_flexible"], [sample("x = 7", solution="7"), sample("#### 7", solution="7")])
    np.testing.assert_array_equal(result.per_function["gsm8k"], [0.0, 1.0])
    np.testing.assert_array_equal(result.per_function["gsm8k_flexible"], [1.0, 1.0])
    np.testing.assert_array_equal(result.scores, [1.0, 2.0])
    np.testing.assert_array_equal(result.correct, [False, True])


# ---------------------------------------------------------------------------------------------------- math

def test_math_accuracy():
    assert math_answer("so \\boxed{2} and then \\boxed{\\frac{1}{2}}<|im_end|>") == "\\boxed{\\frac{1}{2}}"
    assert math_answer("\\boxed{2} <answer>3</answer>") == "3"
    assert math_score("thus \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_score("thus \\boxed{\\frac12}", "$\\frac{1}{2}$") == 1.0
    assert math_score("x</think><answer>3\\pi</answer>", "3\\pi") == 1.0
    assert math_score("\\boxed{2} <answer>3</answer>", "3") == 1.0            # <answer> wins over \boxed
    assert math_score("\\boxed{2} <answer>3</answer>", "2") == 0.0
    assert math_score("thus \\boxed{0.4}", "\\frac{1}{2}") == 0.0
    assert math_score("the answer is 5", "5") == 0.0                           # neither <answer> nor \boxed
    assert math_score("The solution is \\boxed{42}.", "solution text ... \\boxed{42}") == 1.0
    result = score(["accuracy"], [sample("\\boxed{4}", solution="4"), sample("\\boxed{5}", solution="4")])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0])
    with pytest.raises(RewardError, match=r"'math' failed on sample 1: .*ground truth"):
        score(["math"], [sample("\\boxed{4}", solution="4"), sample("\\boxed{4}", solution="")])


# ---------------------------------------------------------------------------------------------------- format

@pytest.mark.parametrize("response,expected", [
    ("plan</think>\n<answer>42</answer>", 1.0),
    ("plan</think>\n<answer>42</answer><|im_end|>", 1.0),
    ("plan</think><answer>42</answer>\n<|im_end|><|endoftext|>", 1.0),
    ("plan</think>\n<answer>42</answer> and more", 0.0),
    ("plan</think>\nno answer tags", 0.0),
    ("<answer>42</answer>", 0.0),
    ("<|im_start|>assistant\n<think>plan</think><answer>42</answer><|im_end|>", 1.0),
    ("<|im_start|>assistant\nplan</think><answer>42</answer>", 0.0),
])
def test_format(response, expected):
    assert score(["format"], [sample(response)]).scores[0] == expected


def test_strip_special_tail():
    assert strip_special_tail("x</answer><|im_end|>\n<|endoftext|>  ") == "x</answer>"
    assert strip_special_tail("x</s>") == "x"
    assert strip_special_tail("<|im_end|> inside") == "<|im_end|> inside"


# ---------------------------------------------------------------------------------------------------- cosine

def test_cosine_hand_numbers():
    # swift defaults: correct 1.0 (t=0) -> 0.5 (t=T), wrong -0.5 -> 0.0; T=100
    assert cosine_value(0, 100, 1.0, 0.5) == pytest.approx(1.0)
    assert cosine_value(50, 100, 1.0, 0.5) == pytest.approx(0.75)
    assert cosine_value(100, 100, 1.0, 0.5) == pytest.approx(0.5)
    assert cosine_value(25, 100, 1.0, 0.5) == pytest.approx(1.0 - 0.5 * (1 - math.cos(math.pi / 4)) / 2)
    samples = [sample("\\boxed{7}", 0, solution="7"), sample("\\boxed{7}", 50, solution="7"),
               sample("\\boxed{7}", 100, solution="7"), sample("\\boxed{7}", 400, solution="7"),
               sample("\\boxed{8}", 1, solution="7"), sample("\\boxed{8}", 50, solution="7"),
               sample("\\boxed{8}", 100, solution="7")]
    samples[0].response = ""
    result = score(["cosine"], samples, cosine_max_len=100)
    np.testing.assert_allclose(result.scores, [-0.5, 0.75, 0.5, 0.5, -0.5 + 0.5 * (1 - math.cos(math.pi / 100)) / 2,
                                               -0.25, 0.0], atol=1e-6)
    # T defaults to max_dec_len; correctness can come from gsm8k
    result = score(["cosine"], [sample("#### 7", 50, solution="7")], max_dec_len=50, cosine_accuracy="gsm8k")
    assert result.scores[0] == pytest.approx(0.5)
    with pytest.raises(RewardError, match="cosine.*sample 0.*response_length"):
        score(["cosine"], [sample("\\boxed{7}", 0, solution="7")])


def test_cosine_accuracy_is_any_rule_with_the_correctness_trait():
    """The rules that judge right or wrong say so where they are registered (`correctness=`); cosine_accuracy's
    choices are those rules, a rule added in its own file included, and anything else is refused by name."""
    from paddle_rl.rewards.rules import RULE_REWARDS, correctness_rules, register_rule
    assert set(correctness_rules()) == {"math", "accuracy", "gsm8k", "gsm8k_flexible", "kk", "qa", "trivia",
                                        "classification"}
    with pytest.raises(ConfigError, match="cosine_accuracy: 'format' is not one of kk, gsm8k, gsm8k_flexible, math, accuracy"):
        check_reward_config(RLConfig(reward_funcs=["cosine"], cosine_accuracy="format"))

    @register_rule("exact_match_test", correctness=lambda response, truth: float(response.strip() == str(truth)))
    def exact(samples):
        return np.zeros(len(samples), np.float32), None
    try:
        check_reward_config(RLConfig(reward_funcs=["cosine"], cosine_accuracy="exact_match_test"))
        result = score(["cosine"], [sample("7", 50, solution="7"), sample("8", 50, solution="7")], max_dec_len=50,
                       cosine_accuracy="exact_match_test")
        np.testing.assert_allclose(result.scores, [0.5, 0.0])
    finally:
        RULE_REWARDS.pop("exact_match_test")


# ---------------------------------------------------------------------------------------------------- repetition

def test_repetition_hand_numbers():
    # 6 words -> 4 trigrams, 3 distinct: -(1 - 3/4)
    assert repetition_penalty("a b c a b c") == pytest.approx(-0.25)
    assert repetition_penalty("A b C a B c", 3, 2.0) == pytest.approx(-0.5)
    assert repetition_penalty("A b C a B c", 3, -2.0) == pytest.approx(-0.5)   # ms-swift writes it negative
    assert repetition_penalty("one two three four") == 0.0
    assert repetition_penalty("too short") == 0.0
    # 5 identical words -> 3 bigrams... with n=2: 4 bigrams, 1 distinct
    assert repetition_penalty("go go go go go", 2) == pytest.approx(-0.75)
    result = score(["repetition"], [sample("a b c a b c<|im_end|>")], repetition_max_penalty=1.0)
    assert result.scores[0] == pytest.approx(-0.25)


# ---------------------------------------------------------------------------------------------------- soft overlong

def test_soft_overlong_hand_numbers():
    # L_max 100, buffer 20 -> L_exp 80
    assert soft_overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert soft_overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert soft_overlong_penalty(100, 100, 20, 1.0) == pytest.approx(-1.0)
    assert soft_overlong_penalty(101, 100, 20, 1.0) == -1.0
    assert soft_overlong_penalty(95, 100, 20, 2.0) == pytest.approx(-1.5)
    samples = [sample("x", n) for n in (10, 85, 100)]
    result = score(["soft_overlong"], samples, max_dec_len=100, overlong_reward_buffer=20, overlong_penalty_factor=2.0)
    np.testing.assert_allclose(result.scores, [0.0, -0.5, -2.0])


def test_soft_overlong_rule_uses_the_one_implementation(monkeypatch):
    """The reward function and the objective (enable_overlong_reward_buffer) share algorithms.dapo's math."""
    import paddle_rl.algorithms.dapo as dapo
    calls = []

    def spy(lengths, max_len, buffer, factor=1.0):
        calls.append((list(np.asarray(lengths)), max_len, buffer, factor))
        return np.full(len(lengths), -0.125)

    monkeypatch.setattr(dapo, "soft_overlong_penalty", spy)
    result = score(["soft_overlong"], [sample("x", 90), sample("y", 7)], max_dec_len=100, overlong_reward_buffer=20,
                   overlong_penalty_factor=2.0)
    np.testing.assert_allclose(result.scores, [-0.125, -0.125])
    assert calls == [([90, 7], 100, 20, 2.0)]


def test_soft_overlong_switched_on_twice_is_an_error(tmp_path):
    both = dict(reward_funcs=["kk", "soft_overlong"], enable_overlong_reward_buffer=True, overlong_reward_buffer=20)
    with pytest.raises(ConfigError) as e:
        check_reward_config(RLConfig(**both))
    message = str(e.value)
    assert "reward_funcs" in message and "'soft_overlong'" in message and "enable_overlong_reward_buffer" in message
    assert "count twice" in message
    with pytest.raises(ConfigError, match="enable_overlong_reward_buffer"):
        build_reward(RLConfig(**both))
    with pytest.raises(ConfigError, match=r"reward_routes\['long'\] names 'soft_overlong'.*enable_overlong"):
        check_reward_config(RLConfig(reward_funcs=["kk"], reward_routes={"long": ["soft_overlong"]},
                                     enable_overlong_reward_buffer=True))
    # either switch alone is fine; so is a plugin of that name (not the built-in penalty)
    check_reward_config(RLConfig(reward_funcs=["kk", "soft_overlong"]))
    check_reward_config(RLConfig(reward_funcs=["kk"], enable_overlong_reward_buffer=True))
    own = tmp_path / "own_overlong.py"
    own.write_text("def soft_overlong(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    check_reward_config(RLConfig(**both, reward_plugins=[str(own)]))


# ---------------------------------------------------------------------------------------------------- weights / metrics

def test_weights_and_per_function_metrics():
    samples = [sample("ok</think><answer>\\boxed{3}</answer>", solution="3"),
               sample("ok</think>\n\\boxed{4}", solution="3")]
    result = score(["math", "format"], samples, reward_weights=[2.0, 0.5])
    np.testing.assert_allclose(result.scores, [2.5, 0.0])
    m = result.metrics()
    assert m["reward/mean"] == pytest.approx(1.25)
    assert m["reward/math_mean"] == pytest.approx(0.5)
    assert m["reward/format_mean"] == pytest.approx(0.5)
    assert m["reward/accuracy"] == pytest.approx(0.5)
    assert "reward/skipped" not in m


def test_skipped_results_and_concat():
    a = RewardResult(np.array([1.0, 2.0], dtype=np.float32), {"kk": np.array([1.0, 2.0])}, np.array([True, False]))
    b = RewardResult(np.array([np.nan, 4.0], dtype=np.float32), {}, None, np.array([True, False]))
    both = concat_results([a, b])
    np.testing.assert_array_equal(both.skipped, [False, False, True, False])
    m = both.metrics()
    assert m["reward/skipped"] == 1.0
    assert m["reward/mean"] == pytest.approx(7.0 / 3)
    assert m["reward/kk_mean"] == pytest.approx(1.5)
    np.testing.assert_array_equal(both.kept, [True, True, False, True])


def test_config_keys_and_validation():
    with pytest.raises(ConfigError, match="reward_server_on_failure"):
        load_config(overrides={"actor_model_name_or_path": "m", "reward_server_on_failure": "ignore"})
    with pytest.raises(ConfigError, match="reward_plugins: file not found"):
        load_config(overrides={"actor_model_name_or_path": "m", "reward_plugins": ["nope/missing.py"]})
    config = load_config(overrides={"actor_model_name_or_path": "m", "reward_funcs": "math,format",
                                    "reward_weights": [1, 0.5]})
    assert config.reward_funcs == ["math", "format"] and config.cosine_max_len == -1
    assert config.reward_server_retries == 3 and config.reward_server_on_failure == "error"
    with pytest.raises(ValueError, match="unknown"):
        RuleReward(["nonsense"])

    # the built-in rules' keys are declared beside the rules; the loader checks them with the same messages
    for key, bad, message in (("cosine_max_len", 0, "cosine_max_len: must be > 0 or -1, got 0"),
                              ("cosine_max_len", -2, "cosine_max_len: must be > 0 or -1, got -2"),
                              ("repetition_n_grams", 0, "repetition_n_grams: must be >= 1, got 0")):
        with pytest.raises(ConfigError) as error:
            load_config(overrides={"actor_model_name_or_path": "m", key: bad})
        assert message in str(error.value)


RULE_PLUGIN = """
import numpy as np
from paddle_rl.config.fields import above
from paddle_rl.config.options import option
from paddle_rl.rewards.rules import register_rule


@register_rule("plugin_length_test", needs_config=True, options=(
        option("plugin_length_scale", float, 1.0, "Divides the response length.", check=above(0)),))
def plugin_length(config):
    scale = config.plugin_length_scale
    return lambda samples: (np.array([len(s.response) / scale for s in samples], np.float32), None)


def plain(completions, **kwargs):
    return [1.0 for _ in completions]
"""


def test_a_plugin_file_registers_a_rule_with_a_key(tmp_path):
    """A reward plugin file registers a rule with its own key: a YAML file naming the plugin reads and checks the
    key (the loader imports the plugin for it) and the rule gets its value; its other functions stay plugin
    functions; an unknown key is still an error."""
    from paddle_rl.config.options import PIECE_OPTIONS
    from paddle_rl.rewards.plugins import load_plugins_cached
    from paddle_rl.rewards.rules import RULE_REWARDS, remove_rule
    plugin = tmp_path / "length_plugin.py"
    plugin.write_text(RULE_PLUGIN)
    run = tmp_path / "run.yaml"
    run.write_text(f"actor_model_name_or_path: m\nreward_plugins: [{plugin}]\n"
                   f"reward_funcs: [plugin_length_test, plain]\nplugin_length_scale: 4\n")
    try:
        config = load_config(str(run))
        assert config.plugin_length_scale == 4.0
        assert sorted(load_plugins_cached([str(plugin)])) == ["plain"]
        np.testing.assert_allclose(build_reward(config)([sample("abcdefgh"), sample("ab")]).scores, [3.0, 1.5])
        with pytest.raises(ConfigError, match="plugin_length_scale: must be > 0, got -1.0"):
            load_config(str(run), ["plugin_length_scale=-1"])
        with pytest.raises(ConfigError, match="unknown key 'plugin_length_scael'"):
            load_config(str(run), ["plugin_length_scael=2"])
    finally:
        if "plugin_length_test" in RULE_REWARDS:
            remove_rule("plugin_length_test")
    assert "plugin_length_scale" not in PIECE_OPTIONS


def test_a_rule_with_a_new_key_is_one_registration(tmp_path):
    """A rule declares the key it reads where it registers (here, after RLConfig and the loader were imported): the
    key loads from YAML, is checked and dumped, and reaches the rule's factory; it leaves with the rule."""
    from paddle_rl.config import config_to_dict
    from paddle_rl.config.fields import above
    from paddle_rl.config.options import PIECE_OPTIONS, option
    from paddle_rl.rewards.rules import RULE_REWARDS, register_rule, remove_rule, rule_option_errors
    before = RLConfig()
    seen = []

    @register_rule("length_bonus_test", needs_config=True, options=(
            option("length_bonus_scale", float, 1.0, "Divides the response length.", check=above(0)),))
    def length_bonus(config):
        scale = config.length_bonus_scale
        seen.append(scale)
        return lambda samples: (np.array([len(s.response) / scale for s in samples], np.float32), None)
    try:
        assert before.length_bonus_scale == 1.0          # a config made before the rule registered: the default
        path = tmp_path / "run.yaml"
        path.write_text("actor_model_name_or_path: m\nreward_funcs: [length_bonus_test]\nlength_bonus_scale: 4\n")
        config = load_config(str(path))
        assert config.length_bonus_scale == 4.0 and config_to_dict(config)["length_bonus_scale"] == 4.0
        result = build_reward(config)([sample("abcdefgh"), sample("ab")])
        assert seen == [4.0]
        np.testing.assert_allclose(result.scores, [2.0, 0.5])
        for bad, message in (("-1", "length_bonus_scale: must be > 0, got -1.0"),
                             ("big", "length_bonus_scale: expected a number, got 'big'")):
            with pytest.raises(ConfigError) as error:
                load_config(str(path), [f"length_bonus_scale={bad}"])
            assert message in str(error.value)
        config.length_bonus_scale = -3.0                 # the reward server checks the rules' keys on their own
        assert rule_option_errors(config) == ["length_bonus_scale: must be > 0, got -3.0"]
        build_reward(load_config(None, {"actor_model_name_or_path": "m", "reward_funcs": ["length_bonus_test"]}))
        assert seen == [4.0, 1.0]                        # unset: the declared default
        with pytest.raises(TypeError, match="'length_bonus_scale' is already declared by reward rule"):
            register_rule("length_bonus_twice", needs_config=True,
                          options=(option("length_bonus_scale", float, 2.0),))(lambda config: None)
        with pytest.raises(TypeError, match="'kl_coeff' is a key of a config group"):
            register_rule("kl_again", needs_config=True, options=(option("kl_coeff", float, 0.0),))(
                lambda config: None)
    finally:
        remove_rule("length_bonus_test")
    assert "length_bonus_test" not in RULE_REWARDS and "length_bonus_scale" not in PIECE_OPTIONS
    assert "length_bonus_twice" not in RULE_REWARDS and "kl_again" not in RULE_REWARDS
    assert "cosine_max_len" in PIECE_OPTIONS
    with pytest.raises(ConfigError, match="unknown key 'length_bonus_scale'"):
        load_config(None, {"actor_model_name_or_path": "m", "length_bonus_scale": 4})


def test_reward_names_are_checked_by_the_rewards_package(plugin_file):
    """The config package does not know the rule registry: load_config accepts any name, and
    check_reward_config / build_reward name the key, the bad name and the closest known one."""
    config = load_config(overrides={"actor_model_name_or_path": "m", "reward_funcs": ["kk", "acuracy"],
                                    "reward_routes": {"openai/gsm8k": ["gsm8kk"], "x": {"zzzz": 1.0}}})
    with pytest.raises(ConfigError) as e:
        check_reward_config(config)
    message = str(e.value)
    assert "reward_funcs: unknown reward function 'acuracy' (did you mean 'accuracy'?)" in message
    assert "reward_routes['openai/gsm8k']: unknown reward function 'gsm8kk' (did you mean 'gsm8k'?)" in message
    assert "reward_routes['x']: unknown reward function 'zzzz'\n" in message      # nothing close: no suggestion
    assert "available: accuracy, classification, code, cosine," in message
    with pytest.raises(ConfigError, match="did you mean 'accuracy'"):
        build_reward(config)
    # plugin functions count as known, and a near miss of one is suggested
    check_reward_config(RLConfig(reward_funcs=["contains", "kk"], reward_plugins=[plugin_file]))
    with pytest.raises(ConfigError, match="unknown reward function 'contain' \\(did you mean 'contains'\\?\\)"):
        check_reward_config(RLConfig(reward_funcs=["contain"], reward_plugins=[plugin_file]))
    # with a reward server, the server checks its own functions (one that answers HTTP at all is enough here)
    with http_server() as url:
        check_reward_config(RLConfig(reward_funcs=["nonsense"], use_rm_server=True, reward_server=url))


@contextlib.contextmanager
def http_server():
    """A real HTTP server on 127.0.0.1 that answers every GET with 501 (it implements no method)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *args: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_reward_server_is_a_config_error_naming_its_url():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    config = RLConfig(use_rm_server=True, reward_server=url, reward_server_retries=1, reward_server_backoff=0.01)
    with pytest.raises(ConfigError, match=f"reward_server: no server answers at {url} \\(ConnectError: .*2 attempt"):
        check_reward_config(config)
    with http_server() as up:  # the same check passes once a server answers
        check_reward_config(RLConfig(use_rm_server=True, reward_server=up, reward_server_retries=0))


def test_check_reward_config_loads_a_plugin_file_once(tmp_path):
    counter = tmp_path / "loads.txt"
    plugin = tmp_path / "counted.py"
    plugin.write_text(f"with open({str(counter)!r}, 'a') as f:\n    f.write('x')\n\n"
                      "def counted(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    config = RLConfig(reward_funcs=["counted"], reward_plugins=[str(plugin)])
    check_reward_config(config)
    assert build_reward(config)([sample("a")]).scores.tolist() == [1.0]
    assert counter.read_text() == "x"
    plugin.write_text(plugin.read_text() + "\n# edited\n")     # an edited file is loaded again
    build_reward(config)
    assert counter.read_text() == "xx"


def test_trainer_checks_reward_names_before_loading_models(monkeypatch):
    from paddle_rl import models
    from paddle_rl.trainer import RLTrainer
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def loaded(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the reward configuration was checked")

    monkeypatch.setattr(models.Tokenizer, "from_pretrained", loaded)     # the first thing the trainer loads
    config = RLConfig(actor_model_name_or_path=os.path.join(root, "data", "tiny_arith", "model"),
                      train_datasets=os.path.join(root, "data", "tiny_arith", "arith", "train.jsonl"),
                      reward_funcs=["gsm8k_flexibel"])
    with pytest.raises(ConfigError, match="reward_funcs: unknown reward function 'gsm8k_flexibel' "
                                          "\\(did you mean 'gsm8k_flexible'\\?\\)"):
        RLTrainer(config)


# ---------------------------------------------------------------------------------------------------- plugins

PLUGIN = textwrap.dedent('''
    import math

    def contains(completions, solution=None, **kwargs):
        bonus = kwargs.get("bonus") or [0] * len(completions)
        return [float(str(s) in c) + b for c, s, b in zip(completions, solution, bonus)]

    def declared_only(completions, level):
        return [float(l) for l in level]

    def maybe(completions, **kwargs):
        return [None if "skip" in c else 0.25 for c in completions]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        scale = (extra_info or {}).get("scale", 1.0)
        if data_source == "upper":
            return {"score": scale * float(solution_str.upper() == solution_str), "acc": True}
        return scale * float(solution_str.strip() == str(ground_truth))

    def explode(completions, **kwargs):
        for c in completions:
            if "BOOM" in c:
                raise ZeroDivisionError("boom")
        return [1.0] * len(completions)

    def short(completions, **kwargs):
        return [1.0]

    def nan(completions, **kwargs):
        return [math.nan] * len(completions)

    def format(completions, **kwargs):
        return [7.0] * len(completions)

    def inf_third(completions, **kwargs):
        return [math.inf if i == 2 else 1.0 for i in range(len(completions))]

    def text_score(completions, **kwargs):
        return ["1.0"] * len(completions)

    def _private(completions, **kwargs):
        raise AssertionError("never registered")
''')


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def test_plugin_signatures_and_fields(plugin_file):
    plugins = load_plugins([plugin_file])
    assert "_private" not in plugins and plugins["compute_score"].style == "verl"
    assert plugins["contains"].style == "swift"
    samples = [sample("it is 42<|im_end|>", solution="42", bonus=1, level=3, data_source="x",
                      extra_info={"scale": 2.0}),
               sample("it is 41", solution="42", bonus=0, level=1, data_source="x")]
    config = RLConfig(reward_funcs=["contains", "declared_only", "compute_score"], reward_plugins=[plugin_file])
    result = build_reward(config)(samples)
    np.testing.assert_allclose(result.per_function["contains"], [2.0, 0.0])
    np.testing.assert_allclose(result.per_function["declared_only"], [3.0, 1.0])
    # verl: special tokens stripped from solution_str, extra_info passed through
    np.testing.assert_allclose(result.per_function["compute_score"], [0.0, 0.0])
    np.testing.assert_allclose(result.scores, [5.0, 1.0])
    verl = build_reward(RLConfig(reward_funcs=["compute_score"], reward_plugins=[plugin_file]))
    np.testing.assert_allclose(verl([sample("42", solution="42", extra_info={"scale": 3.0})]).scores, [3.0])


def test_plugin_none_means_not_applicable(plugin_file):
    config = RLConfig(reward_funcs=["maybe", "format"], reward_plugins=[plugin_file])
    result = build_reward(config)([sample("a"), sample("skip me")])
    assert np.isnan(result.per_function["maybe"][1])
    np.testing.assert_allclose(result.scores, [7.25, 7.0])        # the plugin's `format` replaces the rule
    only = RLConfig(reward_funcs=["maybe"], reward_plugins=[plugin_file])
    with pytest.raises(RewardError, match="sample 1: none of"):
        build_reward(only)([sample("a"), sample("skip me")])


def test_routing_by_data_source(plugin_file):
    config = RLConfig(reward_funcs=["kk"], reward_plugins=[plugin_file],
                      reward_routes={"upper": ["compute_score"], "gsm": {"gsm8k": 2.0, "contains": 1.0}})
    samples = [sample("hmm</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>", tgt=KK_TRUTH),
               sample("SHOUT", data_source="upper", solution="x"),
               sample("#### 12", data_source="gsm", solution="12"),
               sample("hmm</think><answer>(1) Zoey is a knave\n(2) Oliver is a knave</answer>", tgt=KK_TRUTH,
                      data_source="not-routed")]
    result = build_reward(config)(samples)
    np.testing.assert_allclose(result.scores, [3.0, 1.0, 3.0, -0.5])
    assert np.isnan(result.per_function["kk"][1]) and result.per_function["kk"][3] == -0.5
    np.testing.assert_array_equal(result.correct, [True, True, True, False])
    assert result.metrics()["reward/kk_mean"] == pytest.approx(1.25)


def test_plugin_failures_name_plugin_and_sample(plugin_file):
    samples = [sample("fine"), sample("fine"), sample("BOOM"), sample("fine")]
    config = RLConfig(reward_funcs=["explode"], reward_plugins=[plugin_file])
    with pytest.raises(RewardError) as e:
        build_reward(config)(samples)
    assert "'explode'" in str(e.value) and "my_rewards.py" in str(e.value) and "sample 2" in str(e.value)
    assert "ZeroDivisionError" in str(e.value)
    with pytest.raises(RewardError, match=r"'short'.*my_rewards\.py.*returned 1 scores for 4 samples.*samples 0\.\.3"):
        build_reward(RLConfig(reward_funcs=["short"], reward_plugins=[plugin_file]))(samples)
    with pytest.raises(RewardError, match=r"'nan'.*sample 0.*returned nan"):
        build_reward(RLConfig(reward_funcs=["nan"], reward_plugins=[plugin_file]))(samples)
    with pytest.raises(RewardError, match=r"'inf_third'.*my_rewards\.py.*returned inf for sample 2: a reward must be "
                                          r"finite"):
        build_reward(RLConfig(reward_funcs=["inf_third"], reward_plugins=[plugin_file]))(samples)
    with pytest.raises(RewardError, match=r"'text_score'.*sample 0.*returned '1\.0', not a number"):
        build_reward(RLConfig(reward_funcs=["text_score"], reward_plugins=[plugin_file]))(samples)
    # routed subsets report indices of the whole batch
    routed = RLConfig(reward_funcs=["kk"], reward_plugins=[plugin_file], reward_routes={"b": ["explode"]})
    batch = [sample("x", tgt=KK_TRUTH), sample("fine", data_source="b"), sample("BOOM", data_source="b")]
    with pytest.raises(RewardError, match="'explode'.*sample 2"):
        build_reward(routed)(batch)


def test_plugin_load_errors(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"broken\.py: import failed: ModuleNotFoundError"):
        load_plugins([str(bad)])
    with pytest.raises(ValueError, match="file not found"):
        load_plugins([str(tmp_path / "absent.py")])
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ValueError, match="defines no reward functions"):
        load_plugins([str(empty)])


def test_swift_orms_registry(tmp_path):
    path = tmp_path / "swift_plugin.py"
    path.write_text(textwrap.dedent('''
        class LengthORM:
            def __call__(self, completions, **kwargs):
                return [float(len(c)) for c in completions]

        orms = {"length_orm": LengthORM}
    '''))
    reward = build_reward(RLConfig(reward_funcs=["length_orm"], reward_plugins=[str(path)]))
    np.testing.assert_allclose(reward([sample("abc"), sample("abcde<|im_end|>")]).scores, [3.0, 5.0])


def test_kk_prompt_without_think_tag_scores_the_response_as_is():
    from paddle_rl.rewards.kk import kk_score
    truth = "(1) Zoey is a knight\n(2) Oliver is a knave"
    response = "<think>ok</think><answer>(1) Zoey is a knight\n(2) Oliver is a knave</answer>"
    assert kk_score(response, truth, prompt="<|im_start|>assistant\n") == 3.0
    assert kk_score(response, truth) == -3.0  # PaddleNLP's rule: the prompt opened <think> already
    assert kk_score(response[len("<think>"):], truth, prompt="...<|im_start|>assistant\n<think>") == 3.0


@pytest.mark.parametrize("returned, message", [
    ([1, 2.0, "x", "0"], r"reward function 'bad_for_test' returned 'x' for sample 2, not a number"),
    ([1.0, 2.0, 3.0, -math.inf], r"reward function 'bad_for_test' returned -inf for sample 3: a reward must be finite"),
    ([1.0, 2.0, 3.0], r"reward function 'bad_for_test' returned 3 scores for 4 samples \[samples 0\.\.3\]"),
    ([None, None, None, None], r"sample 0: none of \['bad_for_test'\] produced a score"),
    ([1.0, [2.0, 3.0], 0.0, 0.0], r"'bad_for_test' returned \[2\.0, 3\.0\] for sample 1, not a number"),
])
def test_rule_returning_bad_scores_names_function_and_sample(monkeypatch, returned, message):
    """A rule (or plugin) returning a string, an infinite score, None for every function of a sample or the wrong
    count is an error naming the function and the first bad sample (None / NaN alone mean "does not apply")."""
    from paddle_rl.rewards import register_rule
    from paddle_rl.rewards.rules import RULE_REWARDS
    monkeypatch.setitem(RULE_REWARDS, "bad_for_test", None)  # the test's rule leaves with the test

    @register_rule("bad_for_test")
    def bad(samples):
        return returned, None

    with pytest.raises(RewardError, match=message):
        score(["bad_for_test"], [sample(str(i)) for i in range(4)])

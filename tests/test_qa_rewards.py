"""The short-answer rules qa, trivia and classification: their normalization, ground truths as records carry them,
the <answer> span, refusals by name and routing by data_source, against hand-written strings and numbers."""
import json

import numpy as np
import pytest

from paddle_rl.config import RLConfig, config_from_values, load_config
from paddle_rl.rewards import RewardError, RewardSample, build_local_reward, build_reward, check_reward_config
from paddle_rl.rewards.rules import (classification_score, correctness_rules, label_normalize, qa_normalize,
                                     qa_score, trivia_normalize, trivia_score)


def sample(response, length=0, **record):
    return RewardSample(prompt="p", response=response, record=record, response_length=length)


def score(names, samples, **config):
    return build_reward(config_from_values(dict(reward_funcs=list(names), **config)))(samples)


# ---------------------------------------------------------------------------------------------------- qa

@pytest.mark.parametrize("text,normalized", [
    ("The Beatles", "beatles"),                          # article and case
    ("an Apple a day", "apple day"),                     # every a / an / the, as whole words only
    ("Theatre and Anatomy", "theatre and anatomy"),      # ... not inside words
    ("U.S.A.!", "usa"),                                  # punctuation removed, not spaced
    ("  New \t York\n City  ", "new york city"),         # whitespace collapsed
    ("Jay-Z", "jayz"),
])
def test_qa_normalization(text, normalized):
    assert qa_normalize(text) == normalized


def test_qa_exact_match_after_normalization():
    assert qa_score("The Beatles!", "beatles") == 1.0
    assert qa_score("  THE   beatles ", "Beatles") == 1.0
    assert qa_score("U.S.A.", "USA") == 1.0
    assert qa_score("The Beatles and Elvis", "Beatles") == 0.0        # exact match, not containment
    result = score(["qa"], [sample("The Beatles!", ground_truth="beatles"), sample("Elvis", ground_truth="beatles")])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0])
    np.testing.assert_array_equal(result.correct, [True, False])


def test_qa_list_ground_truths_any_one_matches():
    truths = ["Nile", "the Nile River"]
    assert qa_score("NILE RIVER.", truths) == 1.0
    assert qa_score("the nile", truths) == 1.0
    assert qa_score("Amazon", truths) == 0.0
    # a list as the reward server's PaddleNLP protocol sends it (JSON text), and verl's Search-R1 {"target": [...]}
    assert qa_score("Nile river", json.dumps(truths)) == 1.0
    assert qa_score("Nile river", {"target": truths}) == 1.0
    assert qa_score("[citation needed]", "[Citation needed]") == 1.0      # text that is no JSON stays text
    result = score(["qa"], [sample("an Amazon", solution=["Amazon", "Nile"]),
                            sample("Danube", reward_model={"ground_truth": {"target": ["Nile"]}})])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0])


def test_qa_reads_the_last_answer_span():
    response = "<think>Maybe the Thames? No.</think> <answer>The Thames</answer> <answer> the Seine. </answer><|im_end|>"
    assert qa_score(response, "Seine") == 1.0
    assert qa_score(response, "Thames") == 0.0
    # no <answer>: the whole response, special tokens and outer whitespace removed
    assert qa_score("  The Seine.\n<|im_end|><|endoftext|>", "seine") == 1.0
    assert qa_score("I think it is the Seine", "seine") == 0.0


# ---------------------------------------------------------------------------------------------------- trivia

HF_ANSWER = {  # the `answer` of an HF trivia_qa row
    "aliases": ["Jay-Z", "Shawn Carter", "Jigga"], "normalized_aliases": ["jay z", "shawn carter", "jigga"],
    "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "jay z",
    "type": "WikipediaEntity", "value": "Jay-Z"}


@pytest.mark.parametrize("text,normalized", [
    ("Jay-Z", "jay z"),                                  # punctuation becomes a space (TriviaQA, not SQuAD)
    ("The_Who", "who"),                                  # underscore a space, then the article goes
    ("Rock \u2018n\u2019 Roll", "rock n roll"),          # the quotes TriviaQA adds to ASCII punctuation
    ("  A  TALE\tof Two Cities ", "tale of two cities"),
])
def test_trivia_normalization(text, normalized):
    assert trivia_normalize(text) == normalized


def test_trivia_aliases_from_a_mapping():
    assert trivia_score("<answer>JAY-Z</answer>", HF_ANSWER) == 1.0
    assert trivia_score("Shawn  Carter.", HF_ANSWER) == 1.0
    assert trivia_score("jigga", HF_ANSWER) == 1.0
    assert trivia_score("Beyonce", HF_ANSWER) == 0.0
    assert trivia_score("Jay-Z and Beyonce", HF_ANSWER) == 0.0              # exact match over aliases only
    assert trivia_score("Jay Z", {"normalized_aliases": ["jay z"]}) == 1.0   # one key is enough
    assert trivia_score("Jay Z", {"value": "Jay-Z"}) == 1.0
    assert trivia_score("Jay Z", {"NormalizedAliases": ["jay z"]}) == 1.0    # TriviaQA's own JSON
    # a list of aliases, and a mapping as JSON text (reward server)
    assert trivia_score("the Shawn Carter", ["Jay-Z", "Shawn Carter"]) == 1.0
    assert trivia_score("Jigga!", json.dumps(HF_ANSWER)) == 1.0
    result = score(["trivia"], [sample("Jay-Z", reward_model={"ground_truth": HF_ANSWER}),
                                sample("Kanye", reward_model={"ground_truth": HF_ANSWER})])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0])
    np.testing.assert_array_equal(result.correct, [True, False])


# ---------------------------------------------------------------------------------------------------- classification

def test_classification_labels():
    assert label_normalize("  Positive\n") == "positive"
    assert classification_score("The review is glowing.\nPOSITIVE  \n\n<|im_end|>", "positive") == 1.0
    assert classification_score("<answer> Negative </answer>\nso positive?", "negative") == 1.0   # <answer> first
    assert classification_score("positive\nwait, negative", "positive") == 0.0   # the last non-empty line
    assert classification_score("Pos.", "pos") == 0.0                          # labels keep their punctuation
    labels = ["entailment", "Entails"]
    assert classification_score("ENTAILS", labels) == 1.0
    assert classification_score("<answer>Entailment</answer>", labels) == 1.0
    assert classification_score("neutral", labels) == 0.0
    result = score(["classification"], [sample("Neutral", tgt=["neutral", "unknown"]), sample("yes", tgt="No")])
    np.testing.assert_array_equal(result.scores, [1.0, 0.0])


# ---------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("rule,truth,message", [
    ("qa", 42, "the qa rule reads its ground truth as a string or a list of strings, or a mapping with target, "
               "got a int: 42"),
    ("qa", {"answer": "x"}, "the qa rule found none of target in the ground truth mapping (keys: answer)"),
    ("qa", ["Nile", 3], "got a list holding a int: 3"),
    ("qa", [], "got a list with nothing in it"),
    ("qa", "The", "the qa rule's ground truth has no answer left after normalization: 'The'"),
    ("trivia", {"type": "FreeForm"}, "the trivia rule found none of normalized_aliases"),
    ("trivia", {"aliases": [1, 2]}, "the trivia rule reads the ground truth's 'aliases' as a string or a list"),
    ("classification", {"label": "positive"}, "the classification rule reads its ground truth as a string or a "
                                              "list of strings, got a dict"),
    ("classification", 1, "got a int: 1"),
])
def test_a_bad_ground_truth_is_refused_by_name(rule, truth, message):
    samples = [sample(" FINE\n", ground_truth="fine"), sample("x", ground_truth=truth)]
    assert score([rule], samples[:1]).scores[0] == 1.0      # the batch's other sample is fine alone
    with pytest.raises(RewardError) as error:
        score([rule], samples)
    assert f"reward function '{rule}' failed on sample 1: " in str(error.value)
    assert message in str(error.value)
    assert error.value.index == 1
    with pytest.raises(RewardError, match=f"'{rule}' failed on sample 0: no ground truth"):
        score([rule], [sample("x")])


# ---------------------------------------------------------------------------------------------------- registry

def test_the_rules_are_registered_routable_and_judge_correctness():
    for name in ("qa", "trivia", "classification"):
        assert name in correctness_rules()
        check_reward_config(RLConfig(reward_funcs=["kk"], reward_routes={"x": [name]}))
    # the correctness trait: cosine_accuracy may name them
    result = score(["cosine"], [sample("The Nile", 50, solution="nile"), sample("Amazon", 50, solution="nile")],
                   cosine_max_len=100, cosine_accuracy="qa")
    np.testing.assert_allclose(result.scores, [0.75, -0.25], atol=1e-6)


def test_data_source_routing_picks_each_rule():
    config = load_config(overrides={
        "actor_model_name_or_path": "m", "reward_funcs": ["gsm8k"],
        "reward_routes": {"nq": ["qa"], "trivia_qa": ["trivia"], "sst2": {"classification": 2.0}}})
    samples = [sample("#### 12", solution="12"),
               sample("<answer>The Nile.</answer>", data_source="nq", ground_truth=["nile", "Nile River"]),
               sample("Shawn Carter.", data_source="trivia_qa", reward_model={"ground_truth": HF_ANSWER}),
               sample("Sentiment:\n POSITIVE ", data_source="sst2", tgt="positive"),
               sample("Amazon", data_source="nq", ground_truth="Nile")]
    result = build_local_reward(config)(samples)
    np.testing.assert_allclose(result.scores, [1.0, 1.0, 1.0, 2.0, 0.0])
    nan = np.nan
    np.testing.assert_array_equal(result.per_function["gsm8k"], [1.0, nan, nan, nan, nan])
    np.testing.assert_array_equal(result.per_function["qa"], [nan, 1.0, nan, nan, 0.0])
    np.testing.assert_array_equal(result.per_function["trivia"], [nan, nan, 1.0, nan, nan])
    np.testing.assert_array_equal(result.per_function["classification"], [nan, nan, nan, 1.0, nan])
    np.testing.assert_array_equal(result.correct, [True, True, True, True, False])

"""Knights-and-Knaves generator: uniqueness checked independently, determinism, layouts, CLI."""

import argparse
import dataclasses
import itertools
import json
import re

import numpy as np
import pytest

from paddle_rl.data.kk import (
    NAMES,
    SYSTEM_PROMPT,
    Is,
    generate_puzzles,
    render_chat,
    render_paddlenlp,
    render_prompt,
    solve,
    think_text,
    write_dataset,
)
from paddle_rl.data.kk.reasoning import deduce, reasoning_text
from paddle_rl.data.kk_cli import add_kk_subparser, run_kk
from paddle_rl.data.kk.english import read_numbered_puzzle
from paddle_rl.rewards import RewardSample, build_reward
from paddle_rl.config import config_from_values
from paddle_rl.rewards.kk import kk_score, reasoning_score
from make_tiny_model import build_data, puzzle_text, record_response

# ---------------------------------------------------------------------------
# An independent reader: parse the English wording back into a formula and
# brute-force it, without touching the generator's statement objects.
# ---------------------------------------------------------------------------

ATOM = re.compile(r"([A-Z][a-z]+) is (not )?a (knight|knave)")


def _top_level(text, token):
    """Start offsets of `token` in `text` outside parentheses."""
    hits, depth = [], 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0 and text.startswith(token, i):
            hits.append(i)
    return hits


def _split(text, token):
    cuts = _top_level(text, token)
    parts, start = [], 0
    for cut in cuts:
        parts.append(text[start:cut])
        start = cut + len(token)
    parts.append(text[start:])
    return parts


def _wrapped(text):
    if not text.startswith("("):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i == len(text) - 1
    return False


def parse_formula(text):
    text = text.strip()
    if _wrapped(text):
        return parse_formula(text[1:-1])
    if _top_level(text, " if and only if "):
        left, right = _split(text, " if and only if ")
        return ("iff", parse_formula(left), parse_formula(right))
    if text[:3] in ("If ", "if ") and _top_level(text, " then "):
        cond, then = _split(text[3:], " then ")
        return ("implies", parse_formula(cond), parse_formula(then))
    if _top_level(text, " and "):
        return ("and",) + tuple(parse_formula(p) for p in _split(text, " and "))
    if _top_level(text, " or "):
        return ("or",) + tuple(parse_formula(p) for p in _split(text, " or "))
    for prefix in ("It is not the case that ", "it is not the case that "):
        if text.startswith(prefix):
            return ("not", parse_formula(text[len(prefix):]))
    m = ATOM.fullmatch(text)
    assert m, f"cannot read {text!r}"
    atom = ("is", m.group(1), m.group(3) == "knight")
    return ("not", atom) if m.group(2) else atom


def holds(formula, roles):
    op = formula[0]
    if op == "is":
        return roles[formula[1]] == formula[2]
    if op == "not":
        return not holds(formula[1], roles)
    if op == "and":
        return all(holds(f, roles) for f in formula[1:])
    if op == "or":
        return any(holds(f, roles) for f in formula[1:])
    if op == "implies":
        return (not holds(formula[1], roles)) or holds(formula[2], roles)
    if op == "iff":
        return holds(formula[1], roles) == holds(formula[2], roles)
    raise AssertionError(op)


def read_full_text(text):
    m = re.search(r"You meet (\d+) inhabitants: (.*?)\. ", text)
    names = re.split(r", and |, | and ", m.group(2))
    assert len(names) == int(m.group(1))
    claims = re.findall(r'([A-Z][a-z]+) [a-z ]+, "([^"]*)\."', text)
    assert [speaker for speaker, _ in claims] == names
    assert text.endswith("So who is a knight and who is a knave?")
    return names, [parse_formula(claim) for _, claim in claims]


def read_compact_text(text):
    assert text.startswith("Knights tell the truth, knaves lie. ")
    claims = re.findall(r"([A-Z][a-z]+): ([^:]*?)\.(?= [A-Z][a-z]+:| Who is)", text)
    return [s for s, _ in claims], [parse_formula(c) for _, c in claims]


def brute_force(names, formulas):
    found = []
    for roles in itertools.product([True, False], repeat=len(names)):
        world = dict(zip(names, roles))
        if all(holds(f, world) == world[name] for name, f in zip(names, formulas)):
            found.append(roles)
    return found


@pytest.fixture(scope="module")
def puzzles_by_people():
    return {people: generate_puzzles(people, 40, seed=7) for people in range(2, 9)}


# ---------------------------------------------------------------------------


def test_names_do_not_contain_each_other():
    assert len(NAMES) >= 100 and len(set(NAMES)) == len(NAMES)
    lowered = [n.lower() for n in NAMES]
    assert not [(a, b) for a in lowered for b in lowered if a != b and a in b]
    assert all(ATOM.fullmatch(f"{n} is a knight") for n in NAMES)


def test_every_puzzle_has_exactly_one_solution_by_independent_check(puzzles_by_people):
    for people, puzzles in puzzles_by_people.items():
        assert len(puzzles) == 40
        for puzzle in puzzles:
            assert len(puzzle.names) == people == len(set(puzzle.names))
            names, formulas = read_full_text(puzzle.text())
            assert tuple(names) == puzzle.names
            assert brute_force(names, formulas) == [puzzle.solution]
            short_names, short_formulas = read_compact_text(puzzle.text(compact=True))
            assert short_names == names and short_formulas == formulas
            assert solve(puzzle) == [puzzle.solution]
            assert solve(puzzle.statements, people) == [puzzle.solution]


def test_deeper_statements_read_unambiguously():
    for people in (3, 5):
        for puzzle in generate_puzzles(people, 30, seed=3, max_depth=3):
            names, formulas = read_full_text(puzzle.text())
            assert brute_force(names, formulas) == [puzzle.solution]


def test_solve_reports_every_consistent_assignment():
    puzzle = generate_puzzles(2, 1, seed=0)[0]
    # Two speakers who each only vouch for themselves: all four roles fit.
    assert len(solve([Is(0, True), Is(1, True)])) == 4
    assert solve([Is(0, False), Is(1, True)]) == []
    assert len(solve(puzzle)) == 1


def test_ground_truth_lines(puzzles_by_people):
    for puzzles in puzzles_by_people.values():
        for puzzle in puzzles[:5]:
            lines = puzzle.ground_truth().split("\n")
            assert len(lines) == len(puzzle.names)
            for i, (line, name, knight) in enumerate(zip(lines, puzzle.names, puzzle.solution), 1):
                assert line == f"({i}) {name} is a {'knight' if knight else 'knave'}"
            # the reward rule: one "NAME is a role" per name, and as many role words as people
            tgt = puzzle.ground_truth()
            for name, knight in zip(puzzle.names, puzzle.solution):
                m = re.search(rf"\b{name} is a (knight|knave)\b", tgt)
                assert m.group(1) == ("knight" if knight else "knave")
            assert len(re.findall(r"\b(knight|knave)\b", tgt)) == len(puzzle.names)


def test_generation_is_seeded_and_extends():
    a = generate_puzzles(4, 12, seed=11)
    assert a == generate_puzzles(4, 12, seed=11)
    assert generate_puzzles(4, 5, seed=11) == a[:5]
    assert a != generate_puzzles(4, 12, seed=12)
    assert len({(p.names, p.statements) for p in a}) == len(a)
    with pytest.raises(ValueError):
        generate_puzzles(9, 1, seed=0)
    with pytest.raises(ValueError):
        generate_puzzles(3, 1, seed=0, max_depth=1)


def test_templates_and_records():
    puzzle = generate_puzzles(3, 1, seed=5)[0]
    qwen = render_paddlenlp(puzzle)
    assert qwen["tgt"] == puzzle.ground_truth()
    assert qwen["src"].startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    assert qwen["src"].endswith(f"{puzzle.text()}<|im_end|>\n<|im_start|>assistant\n<think>")
    tiny = render_paddlenlp(puzzle, template="tiny", compact=True)["src"]
    assert tiny == (f"<|im_start|>user\n{puzzle.text(compact=True)}<|im_end|>\n"
                    "<|im_start|>assistant\n<think>")
    assert render_prompt(puzzle.text(), "plain") == puzzle.text()
    with pytest.raises(ValueError):
        render_prompt("x", "chatml")
    chat = render_chat(puzzle)
    assert list(chat) == ["messages", "solution", "data_source"]
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert chat["messages"][1]["content"] == puzzle.text()
    assert chat["solution"] == puzzle.ground_truth() and chat["data_source"] == "kk"
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in SYSTEM_PROMPT


def test_think_text_is_short_and_agrees(puzzles_by_people):
    for people in (2, 3):
        for puzzle in puzzles_by_people[people]:
            text = think_text(puzzle)
            assert len(text.split()) <= 40
            for name, knight in zip(puzzle.names, puzzle.solution):
                assert f"{name} is a {'knight' if knight else 'knave'}" in text
                assert f"{name}'s" in text
            assert f"{puzzle.names[0]}'s statement is {'true' if puzzle.solution[0] else 'false'}" in text


def _read_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    args = dict(people_counts=[2, 5], num=15, template="qwen2.5", compact=False, split_name="train")
    first = write_dataset(str(tmp_path / "a"), seed=1, **args)
    write_dataset(str(tmp_path / "b"), seed=1, **args)
    write_dataset(str(tmp_path / "c"), seed=2, **args)
    assert [p.rsplit("/", 1)[1] for p in first] == ["train.jsonl", "train.chat.jsonl"]
    a, b, c = (_read_bytes(tmp_path / d) for d in "abc")
    assert a == b
    assert a["train.jsonl"] != c["train.jsonl"]
    rows = [json.loads(line) for line in a["train.jsonl"].decode("utf-8").splitlines()]
    assert len(rows) == 30 and all(list(r) == ["src", "tgt"] for r in rows)
    chats = [json.loads(line) for line in a["train.chat.jsonl"].decode("utf-8").splitlines()]
    assert [c["solution"] for c in chats] == [r["tgt"] for r in rows]


def _data_parser():
    parser = argparse.ArgumentParser(prog="paddle-rl data")
    add_kk_subparser(parser.add_subparsers(dest="data_command"))
    return parser


def test_cli_writes_split_and_test_fraction(tmp_path, capsys):
    parser = _data_parser()
    out = tmp_path / "kk"
    args = parser.parse_args(["kk", "--people", "2,3", "--num", "10", "--seed", "4",
                              "--template", "tiny", "--compact", "--test-fraction", "0.2",
                              "--out", str(out)])
    paths = args.func(args)
    assert sorted(p.name for p in out.iterdir()) == [
        "test.chat.jsonl", "test.jsonl", "train.chat.jsonl", "train.jsonl"]
    assert len(paths) == 4
    train = (out / "train.jsonl").read_text(encoding="utf-8").splitlines()
    test = (out / "test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(train) == 16 and len(test) == 4 and not set(train) & set(test)
    assert json.loads(train[0])["src"].startswith("<|im_start|>user\nKnights tell the truth")
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["kk", "--people", "1,3"])


def test_cli_preset_layout_is_disjoint_and_reproducible(tmp_path):
    parser = _data_parser()
    outputs = []
    for name in ("p1", "p2"):
        args = parser.parse_args(["kk", "--preset", "logic-rl", "--num", "8",
                                  "--out", str(tmp_path / name)])
        run_kk(args)
        outputs.append(_read_bytes(tmp_path / name))
    assert outputs[0] == outputs[1]
    files = outputs[0]
    train = [json.loads(l) for l in files["train.jsonl"].decode("utf-8").splitlines()]
    test = [json.loads(l) for l in files["test.jsonl"].decode("utf-8").splitlines()]
    assert len(train) == 8 * 5 and len(test) == 100
    assert {r["tgt"].count("\n") + 1 for r in train} == {3, 4, 5, 6, 7}
    assert {r["tgt"].count("\n") + 1 for r in test} == {5}
    assert not {r["src"] for r in train} & {r["src"] for r in test}
    with pytest.raises(ValueError):
        run_kk(argparse.Namespace(preset="logic-rl", people=(3,), out=str(tmp_path / "x")))


def test_ground_truth_scores_full_marks_with_kk_reward():
    for people in (2, 5, 8):
        tgt = generate_puzzles(people, 1, seed=9)[0].ground_truth()
        assert kk_score("reasoning</think>\n<answer>" + tgt + "</answer>", tgt) == 3.0


# ---------------------------------------------------------------------------
# Reasoning that reaches the answer, checked sentence by sentence by an independent reader.
# ---------------------------------------------------------------------------

SENTENCE = re.compile(r"(Suppose|So) ([A-Z][a-z]+) is a (knight|knave)\.|([A-Z][a-z]+)'s claim is (true|false)"
                      r"(?:, so (.*?)|: (fits|contradiction))\.(?= |$)")


def _decided(formula, names, known):
    """The claim's truth values over every completion of the partial assignment `known`."""
    rest = [n for n in names if n not in known]
    return {holds(formula, {**known, **dict(zip(rest, values))})
            for values in itertools.product([True, False], repeat=len(rest))}


def check_reasoning(text, names, formulas):
    """Replays `text` against the formulas read back from the puzzle's wording: every supposition names one undecided
    person, every "so" follows from the claim it cites (in every assignment that extends what is known), a
    contradiction ends the innermost supposition and the next sentence takes its opposite, "fits" is a decided claim
    that agrees with its speaker. Returns the roles known at the end, which must decide every claim."""
    claims = dict(zip(names, formulas))
    frames = [{}]  # the known roles, one frame per open supposition
    pos, refuted = 0, None
    while pos < len(text):
        m = SENTENCE.match(text, pos)
        assert m, f"cannot read the reasoning at {text[pos:pos + 60]!r}"
        pos = m.end() + 1
        known = frames[-1]
        if refuted is not None:  # a contradiction must be followed by the opposite of the refuted supposition
            assert m.group(1) == "So" and (m.group(2), m.group(3) == "knight") == (refuted[0], not refuted[1]), m[0]
            refuted = None
            frames[-1][m.group(2)] = m.group(3) == "knight"
            continue
        if m.group(1):
            assert m.group(1) == "Suppose", f"'So' without a refuted supposition: {m[0]}"
            assert m.group(2) not in known, m[0]
            frames.append({**known, m.group(2): m.group(3) == "knight"})
            continue
        speaker, value = m.group(4), m.group(5) == "true"
        if m.group(7):  # fits / contradiction: the claim is decided
            assert speaker in known and _decided(claims[speaker], names, known) == {value}, m[0]
            if m.group(7) == "fits":
                assert value == known[speaker], m[0]
            else:
                assert value != known[speaker], m[0]
                assert len(frames) > 1, "a contradiction outside any supposition"
                frames.pop()
                refuted = _supposition_of(text, m.start())
            continue
        # "X's claim is V, so Y is a R and Z is a R"
        forced = {n: r == "knight" for n, r in re.findall(r"([A-Z][a-z]+) is a (knight|knave)", m.group(6))}
        if speaker in known:
            assert value == known[speaker], m[0]
        else:
            assert _decided(claims[speaker], names, known) == {value} and forced.get(speaker) == value, m[0]
        assert not forced.keys() & (known.keys() - {speaker}), m[0]
        rest = [n for n in names if n not in known]
        worlds = [w for w in ({**known, **dict(zip(rest, values))}
                              for values in itertools.product([True, False], repeat=len(rest)))
                  if holds(claims[speaker], w) == value and w[speaker] == value]
        assert worlds and all(all(w[n] == r for n, r in forced.items()) for w in worlds), m[0]
        known.update(forced)
    assert refuted is None, "the reasoning ends on a contradiction"
    final = frames[-1]
    assert set(final) == set(names), f"undecided at the end: {set(names) - set(final)}"
    assert all(holds(claims[n], final) == final[n] for n in names)
    return final


def _supposition_of(text, end):
    """The (name, role) of the innermost supposition still open before offset `end`."""
    open_ = []
    for m in SENTENCE.finditer(text[:end]):
        if m.group(1) == "Suppose":
            open_.append((m.group(2), m.group(3) == "knight"))
        elif m.group(1) == "So":
            open_.pop()
    return open_[-1]


def test_reasoning_reaches_the_solvers_solution_step_by_step():
    """For 600 random 2-4 people puzzles the reasoning replays step by step under an independent reader of the puzzle
    text, ends with every person decided, and what it reaches is the brute-force solution."""
    splits = 0
    for people in (2, 3, 4):
        for puzzle in generate_puzzles(people, 200, seed=11):
            names, formulas = read_compact_text(puzzle.text(compact=True))
            steps, reached = deduce(puzzle)
            text = reasoning_text(puzzle)
            final = check_reasoning(text, names, formulas)
            assert tuple(final[n] for n in names) == reached == puzzle.solution == solve(puzzle)[0]
            assert [tuple(final[n] for n in names)] == brute_force(names, formulas)
            # the last role each name gets in the text is its answer (what the answer lines copy)
            for name, knight in zip(names, puzzle.solution):
                last = re.findall(rf"\b{name} is a (knight|knave)", text)[-1]
                assert last == ("knight" if knight else "knave"), (name, text)
            splits += "contradiction" in text
    assert splits > 200, "most puzzles should need a refuted supposition"


def test_reasoning_is_worked_out_not_told(puzzles_by_people):
    """The reasoning reads the statements only: the same text with the puzzle's solution field replaced by any other
    assignment (think_text, which states the solution first, changes), and a puzzle whose first person is a knave
    begins by supposing a knight and refuting it, unless a claim decides it first."""
    knave_first = 0
    for people in (2, 3):
        for puzzle in puzzles_by_people[people]:
            text = reasoning_text(puzzle)
            for other in itertools.product([True, False], repeat=people):
                assert reasoning_text(dataclasses.replace(puzzle, solution=other)) == text
            first = puzzle.names[0]
            if not puzzle.solution[0] and text.startswith(f"Suppose {first} is a knight."):
                knave_first += 1
                refuted = text.index(f"So {first} is a knave.")
                assert "contradiction" in text[:refuted]
    assert knave_first >= 10


def test_reasoning_records_in_the_tiny_builder(tmp_path):
    """make_tiny_model --reasoning: the supervised records think through the puzzle before the answer; the RL and
    test files the configs read hold prompts and answers only."""
    splits = build_data(str(tmp_path / "kk"), [2, 3], 5, n_sft=20, n_train=10, n_test=10, write_sft=True,
                        reasoning=True)
    for record in splits["sft"]:
        response = record_response(record)
        assert response.startswith(" Suppose ") or "'s claim is " in response.split(".")[0]
        assert response.endswith(f"</think>\n<answer>{record['tgt']}</answer><|im_end|>")
        assert kk_score(response, record["tgt"]) == 3.0
    for name in ("train", "test"):
        rows = [json.loads(line) for line in open(tmp_path / "kk" / f"{name}.jsonl")]
        assert rows and all(set(r) == {"src", "tgt"} for r in rows)
    plain = build_data(str(tmp_path / "plain"), [2, 3], 5, n_sft=20, n_train=10, n_test=10)
    assert all("think" not in r for r in plain["sft"])


# ---------------------------------------------------------------------------
# The kk_reasoning reward: the case split replayed against the puzzle read from the prompt.
# ---------------------------------------------------------------------------

def test_numbered_puzzle_reads_back_to_its_statements():
    """read_numbered_puzzle inverts the tiny data's wording exactly (2-5 people, nested connectives included)."""
    for people in (2, 3, 4, 5):
        for puzzle in generate_puzzles(people, 100, seed=3):
            names, statements = read_numbered_puzzle(render_prompt(puzzle_text(puzzle), "tiny"))
            assert names == list(puzzle.names) and tuple(statements) == tuple(puzzle.statements)
    with pytest.raises(ValueError, match="numbered"):
        read_numbered_puzzle("Zoey: Oliver is a knave.")
    with pytest.raises(ValueError, match="cannot read the statement"):
        read_numbered_puzzle("(1) Zoey: Bob is a knave. (2) Oliver: Zoey is a knight. Who is a knight and who is a knave?")


def _corrupt(text, k):
    """The worked text with its k-th "true"/"false" or "knight"/"knave" flipped (k counts such words)."""
    words = list(re.finditer(r"\b(true|false|knight|knave)\b", text))
    m = words[k % len(words)]
    flip = {"true": "false", "false": "true", "knight": "knave", "knave": "knight"}[m.group(1)]
    return text[:m.start()] + flip + text[m.end():], m.start()


def test_reasoning_score_replays_the_case_split():
    """The worked case split with its answer scores 1 (2-4 people); with the roles of the answer flipped, all but the
    conclusion; with one word of it flipped, at least the share of sentences before the flipped one (over sentences
    + 1), and 1 only where the independent reader (check_reasoning) accepts the changed text; no puzzle, 0."""
    rng = np.random.default_rng(0)
    accepted = 0
    for people in (2, 3, 4):
        for puzzle in generate_puzzles(people, 60, seed=11):
            prompt = render_prompt(puzzle_text(puzzle), "tiny")
            text, truth = reasoning_text(puzzle), puzzle.ground_truth()
            sentences = len(SENTENCE.findall(text))
            assert reasoning_score(f" {text}</think>\n<answer>{truth}</answer>", prompt) == 1.0
            flipped = truth.replace("knight", "X").replace("knave", "knight").replace("X", "knave")
            assert reasoning_score(f" {text}</think>\n<answer>{flipped}</answer>", prompt) == pytest.approx(
                sentences / (sentences + 1))
            bad, at = _corrupt(text, int(rng.integers(100)))
            got = reasoning_score(f" {bad}</think>\n<answer>{truth}</answer>", prompt)
            names, formulas = read_compact_text(puzzle.text(compact=True))
            try:
                final = check_reasoning(bad, names, formulas)
                valid = all(("knight" if final[n] else "knave") in line for n, line in zip(names, truth.splitlines()))
            except AssertionError:
                valid = False
            accepted += valid
            if valid:
                assert got == 1.0, bad
            else:
                assert got < 1.0, bad
                # the sentences before the flipped one still hold (the flipped one may too: a supposition of the
                # other role opens a branch of its own)
                assert got >= len(SENTENCE.findall(bad[:at])) / (sentences + 1) - 1e-9, (bad, got)
    assert accepted < 20  # a flipped word almost always breaks the replay
    assert reasoning_score(" Suppose Zoey is a knight.</think><answer>x</answer>", "no puzzle here") == 0.0


def test_reasoning_score_of_steps_that_lead_to_a_chosen_answer():
    """Steps written toward an answer rather than worked out score by how far they hold: here the first claim's
    truth is misstated (the speaker supposed a knight says something false, without calling it a contradiction)."""
    prompt = render_prompt("Knights tell the truth, knaves lie. (1) Oliver: Yvonne is a knave. (2) Yvonne: Oliver "
                           "is a knave. Who is a knight and who is a knave?", "tiny")
    answer = "</think>\n<answer>(1) Oliver is a knight\n(2) Yvonne is a knave</answer>"
    good = " Suppose Oliver is a knight. Oliver's claim is true, so Yvonne is a knave. Yvonne's claim is false: fits."
    made_up = " Suppose Oliver is a knight. Oliver's claim is false, so Yvonne is a knave. Yvonne's claim is false: fits."
    assert reasoning_score(good + answer, prompt) == 1.0
    assert reasoning_score(made_up + answer, prompt) == pytest.approx(1 / 4)
    assert kk_score(made_up + answer, "(1) Oliver is a knight\n(2) Yvonne is a knave") == 3.0  # the answer rule alone
    truth = {"tgt": "(1) Oliver is a knight\n(2) Yvonne is a knave"}
    samples = [RewardSample(prompt=prompt, response=r + answer, record=truth, response_length=0) for r in (good, made_up)]
    result = build_reward(config_from_values(dict(reward_funcs=["kk", "kk_reasoning"])))(samples)
    np.testing.assert_allclose(result.scores, [4.0, 3.25])
    assert result.metrics()["reward/kk_reasoning_mean"] == pytest.approx(0.625)
    # a claim's truth must follow from the roles known: stated so that it agrees with its speaker's role is not enough
    prompt = render_prompt("Knights tell the truth, knaves lie. (1) Oliver: Yvonne is a knave. (2) Yvonne: Oliver is "
                           "a knave and Yvonne is a knave. Who is a knight and who is a knave?", "tiny")
    right = "</think>\n<answer>(1) Oliver is a knight\n(2) Yvonne is a knave</answer>"
    wrong = "</think>\n<answer>(1) Oliver is a knave\n(2) Yvonne is a knight</answer>"
    assert reasoning_score(" Suppose Oliver is a knave. Oliver's claim is false, so Yvonne is a knight. Yvonne's claim "
                           "is true: fits." + wrong, prompt) == pytest.approx(2 / 4)  # her claim is false there
    assert reasoning_score(" Oliver's claim is true, so Oliver is a knight and Yvonne is a knave. Yvonne's claim is "
                           "false: fits." + right, prompt) == 0.0  # nothing decides his claim yet: a guess
    assert reasoning_score(" Yvonne's claim is false, so Yvonne is a knave. Oliver's claim is true, so Oliver is a "
                           "knight." + right, prompt) == 0.0  # her claim is undecided until someone is supposed
    assert reasoning_score(" Suppose Yvonne is a knight. Yvonne's claim is false: contradiction. So Yvonne is a knave. "
                           "Oliver's claim is true, so Oliver is a knight. Yvonne's claim is false: fits." + right,
                           prompt) == 1.0  # refuted, then forced: every step holds


def test_tiny_builder_sft_only_people(tmp_path):
    """--sft-only-people 4: the supervised split gains that many 4-people puzzles, none of them in test_4p.jsonl,
    and the RL / test files stay 2-3 people."""
    splits = build_data(str(tmp_path / "kk"), [2, 3], 5, n_sft=20, n_train=10, n_test=10, unseen=[4],
                        write_sft=True, reasoning=True, sft_only=[4], n_sft_only=8)
    four = [r for r in splits["sft"] if r["tgt"].count("\n") == 3]
    assert len(four) == 8 and len(splits["sft"]) == 28
    assert not {r["src"] for r in four} & {r["src"] for r in splits["test_4p"]}
    assert all(r["tgt"].count("\n") < 3 for name in ("train", "test") for r in splits[name])
    assert len(open(tmp_path / "kk" / "sft.jsonl").readlines()) == 28
    assert not (tmp_path / "kk" / "train_4p.jsonl").exists()


def test_tiny_builder_rl_extra_people(tmp_path):
    """--rl-extra-people 4: RL gets a 4-people file of its own, disjoint from the supervised 4-people puzzles and
    from the held-out test_4p.jsonl; train.jsonl and test.jsonl stay 2-3 people."""
    splits = build_data(str(tmp_path / "kk"), [2, 3], 5, n_sft=20, n_train=10, n_test=10, unseen=[4],
                        write_sft=True, reasoning=True, sft_only=[4], n_sft_only=8, rl_extra=[4], n_rl_extra=6)
    rl4 = [json.loads(line) for line in open(tmp_path / "kk" / "train_4p.jsonl")]
    assert len(rl4) == 6 and all(r["tgt"].count("\n") == 3 and set(r) == {"src", "tgt"} for r in rl4)
    sources = {r["src"] for r in rl4}
    assert len(sources) == 6
    for name in ("sft", "train", "test", "test_4p"):
        assert not sources & {r["src"] for r in splits[name]}, name
    assert all(r["tgt"].count("\n") < 3 for name in ("train", "test") for r in splits[name])

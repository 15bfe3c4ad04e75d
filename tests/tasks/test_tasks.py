"""Tests for logra.tasks: extraction, pass@k, splits, mixtures and graders."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from fractions import Fraction

import pytest

from logra.rl.evaluation import distinct_problems
from logra.tasks import (
    EXTRACT_MODES,
    REASONING_GYM_HARD,
    MathJsonlTask,
    MixtureTask,
    Problem,
    ReasoningGymTask,
    Task,
    base,
    extract_answer,
    format_answer,
    gym,
    is_correct,
    list_tasks,
    make_task,
    pass_at_k,
    pass_at_k_mean,
)

# A problem space of only 2 terms of one digit each (a few hundred distinct
# questions), where a seed-based split would certainly leak.
TINY_ARITH = dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
    allow_parentheses=False, allow_negation=False,
)


# --------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------


def _pass_at_k_brute(n: int, c: int, k: int) -> Fraction:
    """Fraction of k-subsets of n samples (the first c correct) with a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_matches_subset_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_brute(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable_and_pass1_is_mean():
    # C(1000, 500) overflows a float; the product form must not.
    assert 0.0 < pass_at_k(1000, 1, 500) <= 1.0
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert pass_at_k(200, 37, 1) == pytest.approx(37 / 200)


def test_pass_at_k_mean_and_errors():
    counts = [0, 3, 8]
    assert pass_at_k_mean(counts, 8, 2) == pytest.approx(sum(float(_pass_at_k_brute(8, c, 2)) for c in counts) / 3)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    with pytest.raises(ValueError):
        pass_at_k_mean([], 4, 1)


def test_is_correct_requires_full_credit():
    assert is_correct(1.0) and is_correct(1.0 - 1e-12)
    assert not is_correct(0.99) and not is_correct(0.01) and not is_correct(0.0)


# --------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Let x = 1.\nAnswer: 3\nAnswer: 42\nsome trailing words", "42"),
        ("Answer: first\nThe final answer: 7", "7"),
        ("**Answer:** 12", "12"),
        ("answer:   hello world  \n", "hello world"),
        ("Work...\nAnswer:\n4.5 4.5\n4.75 5.0\n\nDone.", "4.5 4.5\n4.75 5.0"),
        ("no marker here", None),
        ("Answer:   \n\n", None),
    ],
)
def test_extract_answer_mode(response, expected):
    assert extract_answer(response, "answer") == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        (r"so \boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{1} then \boxed{ {2}+{3} }", "{2}+{3}"),
        (r"set \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\boxed{5}}", "5"),
        (r"\fbox{x}", "x"),
        (r"\boxed{1} and truncated \boxed{\frac{1}{2", None),
        (r"\boxed{}", None),
        ("no box", None),
    ],
)
def test_extract_boxed(response, expected):
    assert extract_answer(response, "boxed") == expected


# the modes that read back any text (the last reads numbers only)
TEXT_MODES = [m for m in EXTRACT_MODES if m != "last_number"]


def test_extract_other_modes():
    assert extract_answer("a\n  b  \n\n   \n", "last_line") == "b"
    assert extract_answer("  \n ", "last_line") is None
    assert extract_answer("  whole\nthing ", "full") == "whole\nthing"
    assert extract_answer("   ", "full") is None
    assert extract_answer("<answer>1</answer> x <answer>\n 2 \n</answer>", "tag") == "2"
    assert extract_answer("<answer>unclosed", "tag") is None
    assert extract_answer("7 + 5 = 12.", "last_number") == "12"
    assert extract_answer("Total: 1,234 apples, i.e. −3.50 per box", "last_number") == "-3.50"
    assert extract_answer("So 9 - 12 = -3\n", "last_number") == "-3"
    assert extract_answer("no digits", "last_number") is None
    with pytest.raises(ValueError, match="boxed"):
        extract_answer("x", "nope")


def test_format_answer_round_trips_through_extract():
    rng = random.Random(0)
    alphabet = "abcXYZ0189 .,-+*/^=()[]'\"?!_%:"
    for _ in range(300):
        answer = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))).strip(" *")
        if not answer:
            continue
        for mode in TEXT_MODES:
            assert extract_answer("Reasoning.\n" * (mode != "full") + format_answer(answer, mode), mode) == answer
        number = str(rng.randint(-10**6, 10**6))  # 'last_number' reads numbers only
        assert extract_answer("Reasoning 1.\n" + format_answer(number, "last_number"), "last_number") == number
    multi = "1 2\n3 4"
    assert extract_answer("blah\n" + format_answer(multi, "answer"), "answer") == multi


# --------------------------------------------------------------------------
# Reasoning-gym tasks
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arith():
    return ReasoningGymTask("basic_arithmetic", config=TINY_ARITH)


def test_list_tasks_and_preset_names_exist():
    names = list_tasks()
    assert names == sorted(names) and "chain_sum" in names
    assert set(REASONING_GYM_HARD) <= set(names)


def test_unknown_task_suggests_nearest_and_lists_valid():
    with pytest.raises(ValueError) as err:
        ReasoningGymTask("word-ladder")
    msg = str(err.value)
    assert "'word_ladder'" in msg and "Did you mean" in msg and "chain_sum" in msg
    with pytest.raises(ValueError, match="size"):
        ReasoningGymTask("chain_sum", config={"size": 10})


@pytest.mark.parametrize("mode", TEXT_MODES)
def test_rg_task_grades_its_references_full_and_garbage_low(mode):
    task = ReasoningGymTask("spell_backward", extract=mode, config=dict(min_word_len=3, max_word_len=6))
    probs = task.problems("train", 20, seed=3)
    for p in probs:
        assert p.task == "spell_backward" and p.answer
        assert task.score(p, "I think...\n" * (mode != "full") + task.reference_response(p)) == 1.0
        assert task.score(p, "zzzzqqqq") < 1.0
        assert task.score(p, "") == 0.0
    assert task.failures == 0


def test_last_number_grades_what_chat_models_write_for_sums():
    task = ReasoningGymTask("chain_sum", extract="last_number")
    for p in task.problems("train", 20, seed=3):
        assert task.score(p, task.reference_response(p)) == 1.0
        assert task.score(p, f"{p.prompt.splitlines()[0]} The answer is {p.answer}.") == 1.0
        assert task.score(p, f"The answer is {int(p.answer) + 1}.") == 0.0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # codeio exec()s snippets with old escapes
def test_rg_hard_preset_grades_references():
    mix = make_task("rg-hard")
    assert isinstance(mix, MixtureTask) and mix.name == "rg-hard"
    assert [t.name for t in mix.tasks] == list(REASONING_GYM_HARD)
    probs = mix.problems("eval", 24, seed=0)
    assert {p.task for p in probs} <= set(REASONING_GYM_HARD)
    for p in probs:
        assert mix.score(p, mix.reference_response(p)) == 1.0
        assert not is_correct(mix.score(p, "Answer: garbage"))
    assert mix.failures == 0


def test_rg_hard_preset_missing_name_raises(monkeypatch):
    monkeypatch.setattr(gym, "REASONING_GYM_HARD", REASONING_GYM_HARD + ("no_such_task",))
    with pytest.raises(ValueError, match="no_such_task"):
        make_task("rg-hard")


def test_partial_credit_switch():
    cfg = dict(min_word_len=5, max_word_len=5)
    soft = ReasoningGymTask("spell_backward", config=cfg)
    hard = ReasoningGymTask("spell_backward", config=cfg, partial_credit=False)
    p = soft.problems("train", 1, seed=0)[0]
    near_miss = "Answer: " + p.answer[:-1]
    assert 0.0 < soft.score(p, near_miss) < 1.0
    assert hard.score(p, near_miss) == 0.0
    assert hard.score(p, "Answer: " + p.answer) == 1.0


def test_prompt_states_format_and_instruction_override(arith):
    p = arith.problems("train", 1, seed=0)[0]
    q = p.metadata["entry"]["question"]
    assert p.prompt.startswith(q.strip()) and "Answer:" in p.prompt
    boxed = ReasoningGymTask("basic_arithmetic", extract="boxed", config=TINY_ARITH)
    assert "\\boxed{}" in boxed.problems("train", 1, seed=0)[0].prompt
    bare = ReasoningGymTask("basic_arithmetic", extract="full", config=TINY_ARITH, instruction="")
    assert bare.problems("train", 1, seed=0)[0].prompt == q.strip()


def test_train_eval_disjoint_even_for_tiny_problem_space(arith):
    train = {p.prompt for s in range(3) for p in arith.problems("train", 400, seed=s)}
    evals = {p.prompt for s in range(3) for p in arith.problems("eval", 30, seed=s)}
    assert len(train) > 100 and len(evals) > 5
    assert train.isdisjoint(evals)


def test_distinct_problems_stay_in_their_split_without_repeats(arith):
    # ~240 questions, ~25 of them held out: the first 150 training draws repeat some
    pools = {"train": distinct_problems(arith, 150, seed=3, split="train"),
             "eval": distinct_problems(arith, 20, seed=3)}
    for split, pool in pools.items():
        questions = [p.metadata["entry"]["question"] for p in pool]
        assert len(set(questions)) == len(questions) == {"train": 150, "eval": 20}[split]
        assert {base.split_of(q, arith.eval_fraction) for q in questions} == {split}


def test_rg_problems_deterministic_prefix_and_seeded(arith):
    a = arith.problems("train", 50, seed=7)
    assert a == arith.problems("train", 50, seed=7)
    assert a[:20] == arith.problems("train", 20, seed=7)
    assert [p.prompt for p in a] != [p.prompt for p in arith.problems("train", 50, seed=8)]
    assert arith.problems("eval", 0, seed=0) == []
    with pytest.raises(ValueError):
        arith.problems("test", 1, seed=0)


def test_too_small_problem_space_for_eval_raises():
    # count_bits with n fixed to 1 has a single question, so one split is empty.
    task = ReasoningGymTask("count_bits", config=dict(min_n=1, max_n=1))
    (question,) = {p.metadata["entry"]["question"] for s in base.SPLITS for p in _safe_problems(task, s)}
    empty = "train" if base.split_of(question, task.eval_fraction) == "eval" else "eval"
    with pytest.raises(RuntimeError, match="too small"):
        task.problems(empty, 3, seed=0)


def _safe_problems(task, split):
    try:
        return task.problems(split, 2, seed=0)
    except RuntimeError:
        return []


# --------------------------------------------------------------------------
# Grader failures
# --------------------------------------------------------------------------


def test_grader_exception_scores_zero_and_is_counted():
    task = ReasoningGymTask("basic_arithmetic", config=TINY_ARITH)
    p = task.problems("train", 1, seed=0)[0]

    def boom(answer, entry):
        raise RuntimeError("scorer bug")

    task._scorer.score_answer = boom
    assert task.score(p, "Answer: 3") == 0.0
    assert task.score(p, "Answer: 3") == 0.0
    assert task.failures == 2
    # No extractable answer: zero reward without calling the broken scorer.
    assert task.score(p, "nothing") == 0.0 and task.failures == 2

    other = _ConstTask("other")
    mix = MixtureTask([task, other])
    assert mix.score(p, "Answer: 4") == 0.0 and mix.failures == 3
    assert mix.score(other.problems("train", 1, 0)[0], "x") == 1.0 and mix.failures == 3


class _ConstTask(Task):
    """Problems named by index; rewards scripted by the test."""

    def __init__(self, name: str, reward: float = 1.0):
        self.name = name
        self.reward = reward

    def problems(self, split, n, seed):
        rng = random.Random(f"{self.name}{split}{seed}")
        return [Problem(f"{self.name} {split} {rng.random()}", "a", self.name, i) for i in range(n)]

    def _grade(self, problem, response):
        return self.reward


def test_non_finite_reward_is_a_failure_and_rewards_are_clipped():
    nan = _ConstTask("nan", float("nan"))
    p = nan.problems("train", 1, 0)[0]
    assert nan.score(p, "x") == 0.0 and nan.failures == 1
    big = _ConstTask("big", 3.0)
    assert big.score(big.problems("train", 1, 0)[0], "x") == 1.0 and big.failures == 0


# --------------------------------------------------------------------------
# Mixtures and specs
# --------------------------------------------------------------------------


def test_mixture_respects_weights_and_is_deterministic():
    a, b, c = _ConstTask("a", 1.0), _ConstTask("b", 0.5), _ConstTask("c", 0.0)
    mix = MixtureTask([a, b, c], [0.6, 0.3, 0.1])
    probs = mix.problems("train", 5000, seed=1)
    freq = Counter(p.task for p in probs)
    for name, w in [("a", 0.6), ("b", 0.3), ("c", 0.1)]:
        assert abs(freq[name] / 5000 - w) < 0.03
    assert probs == mix.problems("train", 5000, seed=1)
    assert [p.task for p in probs[:50]] != [p.task for p in mix.problems("train", 50, seed=2)]
    # Each problem is graded by the task that made it.
    assert {mix.score(p, "r") for p in probs if p.task == "b"} == {0.5}
    assert MixtureTask([a, c], [1.0, 0.0]).problems("eval", 30, 0)[0].task == "a"
    with pytest.raises(ValueError, match="not from mixture"):
        mix.score(Problem("q", "a", "zzz", 0), "r")
    with pytest.raises(ValueError, match="distinct"):
        MixtureTask([a, _ConstTask("a")], [1, 1])
    with pytest.raises(ValueError):
        MixtureTask([a, b], [1.0, -1.0])
    with pytest.raises(ValueError):
        MixtureTask([a, b], [1.0])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # codeio exec()s snippets with old escapes
def test_make_task_specs(tmp_path):
    rg = make_task("chain_sum", extract="boxed")
    assert isinstance(rg, ReasoningGymTask) and rg.extract == "boxed"

    mix = make_task("chain_sum:0.7,basic_arithmetic:0.3")
    assert isinstance(mix, MixtureTask) and mix.weights == [0.7, 0.3]
    probs = mix.problems("train", 400, seed=0)
    share = sum(p.task == "chain_sum" for p in probs) / len(probs)
    assert 0.6 < share < 0.8
    assert all(mix.score(p, mix.reference_response(p)) == 1.0 for p in probs[:50])
    # The mixture's splits stay disjoint through its components.
    assert {p.prompt for p in probs}.isdisjoint({p.prompt for p in mix.problems("eval", 100, seed=0)})

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2"}) + "\n")
    math_task = make_task(f"math:{path}")
    assert isinstance(math_task, MathJsonlTask) and math_task.name == f"math:{path}"
    nested = make_task(f"math:{path}:1,rg-hard:2")
    assert isinstance(nested, MixtureTask) and nested.weights == [1.0, 2.0]
    p = next(q for q in nested.problems("train", 40, seed=0) if q.task == "tsumego")
    assert nested.score(p, nested.reference_response(p)) == 1.0
    with pytest.raises(ValueError):
        make_task("")


# --------------------------------------------------------------------------
# MATH-style JSONL
# --------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_math_jsonl_loads_key_styles_and_grades_equivalence(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Half of one?", "answer": "\\frac{1}{2}"},
        "",
        {"question": "Natalia sold clips...", "answer": "She sold 48/2 = 24.\n#### 72"},
        {"problem": "Solve x+1=3.", "solution": "So $x = \\boxed{2}$."},
        {"problem": "Pick one.", "answer": "B"},
        {"problem": "Count.", "answer": 7},
    ])
    task = MathJsonlTask(str(path), eval_fraction=0.5)
    by_text = {r[1]: r for r in task._records}
    assert by_text["Natalia sold clips..."][2] == "72"
    assert by_text["Solve x+1=3."][2] == "2" and by_text["Solve x+1=3."][0] == 4
    assert task.num_problems("train") + task.num_problems("eval") == 5

    def problem(text):
        i = [r[1] for r in task._records].index(text)
        return task._problem(i)

    half = problem("Half of one?")
    assert half.prompt.startswith("Half of one?") and "\\boxed{}" in half.prompt
    assert task.score(half, "so \\boxed{0.5}") == 1.0
    assert task.score(half, "so \\boxed{1/2}") == 1.0
    assert task.score(half, "so \\boxed{\\dfrac{2}{4}}") == 1.0
    assert task.score(half, "so \\boxed{0.51}") == 0.0
    assert task.score(half, "no box: 0.5") == 0.0
    assert task.score(problem("Pick one."), "\\boxed{B}") == 1.0
    assert task.score(problem("Count."), "\\boxed{7.0}") == 1.0
    clips = problem("Natalia sold clips...")
    assert task.score(clips, task.reference_response(clips)) == 1.0
    assert task.failures == 0

    answer_mode = MathJsonlTask(str(path), extract="answer")
    assert answer_mode.score(answer_mode._problem(0), "Answer: $0.5$") == 1.0


@pytest.mark.parametrize(
    "bad_line, lineno, message",
    [
        ("{not json", 3, "invalid JSON"),
        (json.dumps({"problem": "no answer here"}), 3, "no answer"),
        (json.dumps({"answer": "1"}), 3, "problem"),
        (json.dumps([1, 2]), 3, "JSON object"),
        (json.dumps({"problem": "p", "solution": "no box"}), 3, "no answer"),
    ],
)
def test_math_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, lineno, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1+1", "answer": "2"}, "", bad_line])
    with pytest.raises(ValueError) as err:
        MathJsonlTask(str(path))
    assert f"{path}:{lineno}:" in str(err.value) and message in str(err.value)


def test_math_jsonl_split_disjoint_deterministic_and_cycles(tmp_path):
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(200)]
    task = MathJsonlTask(str(_write_jsonl(tmp_path / "m.jsonl", rows)))
    n_train, n_eval = task.num_problems("train"), task.num_problems("eval")
    assert n_train + n_eval == 200 and 5 <= n_eval <= 40
    train = task.problems("train", n_train, seed=0)
    evals = task.problems("eval", n_eval, seed=0)
    assert len({p.prompt for p in train}) == n_train and len({p.prompt for p in evals}) == n_eval
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in evals})
    assert train == task.problems("train", n_train, seed=0)
    assert train != task.problems("train", n_train, seed=1)
    # The split depends on the text only, not on the file's line order.
    shuffled = MathJsonlTask(str(_write_jsonl(tmp_path / "r.jsonl", rows[::-1])))
    assert {p.prompt for p in shuffled.problems("eval", n_eval, 0)} == {p.prompt for p in evals}
    # Asking for more than the split cycles through it in fresh shuffles.
    many = task.problems("eval", 2 * n_eval + 1, seed=0)
    assert len(many) == 2 * n_eval + 1 and Counter(p.prompt for p in many).most_common(1)[0][1] == 3
    for p in train[:20]:
        assert task.score(p, task.reference_response(p)) == 1.0

    tiny = MathJsonlTask(str(_write_jsonl(tmp_path / "t.jsonl", rows[:1])), eval_fraction=0.01)
    split = "eval" if tiny.num_problems("eval") == 0 else "train"
    with pytest.raises(ValueError, match="split is empty"):
        tiny.problems(split, 1, seed=0)

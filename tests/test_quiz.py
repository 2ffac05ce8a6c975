from collections import Counter
from pathlib import Path

import pytest

from ar_lab.base.errors import BadValue
from ar_lab.course.views.quiz import Question, QuizWidget, check_answer, display_order, questions
from ar_lab.course.views.quiz_bank import QUIZZES, TF
from tests.raising import raises


def test_every_chapter_has_a_well_formed_quiz():
    notebooks = (Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9]*.ipynb")
    chapters = {p.name.split("_")[0] for p in notebooks}
    assert set(QUIZZES) == chapters, (
        "one quiz per chapter and part (07b is the key of 07b_...ipynb)"
    )
    for chapter in QUIZZES:
        qs = questions(chapter)
        assert 3 <= len(qs) <= 6, chapter
        for d in QUIZZES[chapter]:
            assert isinstance(d["answer"], int) and 0 <= d["answer"] < len(d["choices"]), d["q"]
        for q in qs:
            assert len(q.choices) >= 2 and 0 <= q.answer < len(q.choices) and q.explanation
            assert len(set(q.choices)) == len(q.choices)


def test_choices_are_shown_in_a_fixed_order_that_keeps_the_answer():
    for chapter, bank in QUIZZES.items():
        for d, q in zip(bank, questions(chapter), strict=True):
            order = display_order(d["q"], d["choices"])
            assert sorted(order) == list(range(len(d["choices"]))), d["q"]
            assert q.choices == tuple(d["choices"][i] for i in order)
            assert q.choices[q.answer] == d["choices"][d["answer"]], d["q"]
            if d["choices"] == TF:
                assert q.choices == ("True", "False")
    # Pinned: the order comes from SHA-256 of the prompt, not from Python's per-process salted
    # hash().
    assert display_order("Why is decoding sequential?", ["a", "b", "c"]) == [1, 2, 0]
    assert display_order("Weight tying means:", ["a", "b", "c", "d"]) == [3, 1, 0, 2]


def key_tells(qs: list[Question]) -> dict[str, float]:
    """How often a guessing rule finds the answer among multiple-choice questions (True/False left
    out)."""
    mc = [q for q in qs if list(q.choices) != TF]
    tells = {f"position {i}": n / len(mc) for i, n in Counter(q.answer for q in mc).items()}
    right = [len(q.choices[q.answer]) for q in mc]
    tells["longest"] = sum(
        r == max(map(len, q.choices)) for q, r in zip(mc, right, strict=True)
    ) / len(mc)
    tells["shortest"] = sum(
        r == min(map(len, q.choices)) for q, r in zip(mc, right, strict=True)
    ) / len(mc)
    return tells


def test_the_answer_key_cannot_be_guessed_by_position_or_length():
    # ties count as longest / shortest
    limits = {"position": 0.45, "longest": 0.40, "shortest": 0.40}
    every = [q for chapter in QUIZZES for q in questions(chapter)]
    tells = key_tells(every)
    too_telling = {k: round(v, 2) for k, v in tells.items() if v > limits[k.split()[0]]}
    assert not too_telling, (
        f"the right answer is too often {too_telling}: reword or reorder choices in quiz_bank"
    )
    # The check catches the key this test was written against: the answer second and longest.
    old_style = [Question("q", ("short", "the long right answer", "medium one"), 1, "why")] * 9
    old_style += [Question("q", ("a wrong choice here", "right", "other"), 1, "why")]
    old_tells = key_tells(old_style)
    assert (
        old_tells["position 1"] == 1.0 > limits["position"]
        and old_tells["longest"] == 0.9 > limits["longest"]
    )


def test_required_questions_are_there():
    assert any(q.prompt == "Why is decoding sequential?" for q in questions("01"))
    spec = [
        q
        for q in questions("07")
        if q.prompt.startswith("Speculative decoding improves the quality")
    ]
    assert spec and spec[0].choices[spec[0].answer] == "False"
    clocks = [q for q in questions("05") if "(TTFT) and tokens per second" in q.prompt]
    assert clocks and "FLOP/s" in clocks[0].choices[clocks[0].answer]
    assert any("bonus token" in q.choices[q.answer] for q in questions("07"))


def test_check_answer_explains_right_and_wrong():
    q = questions("04")[0]
    ok, text = check_answer(q, q.answer)
    assert ok and text.startswith("✔") and q.explanation in text
    wrong = (q.answer + 1) % len(q.choices)
    ok, text = check_answer(q, wrong)
    assert not ok and q.choices[q.answer] in text and q.explanation in text
    assert check_answer(q, None) == (False, "Pick an answer first.")
    with raises(BadValue, 'choice'):
        check_answer(q, 99)
    with raises(BadValue, 'chapter'):
        questions("42")


def test_widget_headless():
    quiz = QuizWidget("07")
    n = len(questions("07"))
    assert n == len(quiz.questions) == len(quiz.buttons) and quiz.score.value.startswith(
        f"<i>Score: 0 / {n}"
    )
    q0 = quiz.questions[0]
    quiz.choices[0].value = q0.choices[q0.answer]
    quiz.buttons[0].click()
    assert "✔" in quiz.feedback[0].value and f"Score: 1 / {n} (1 answered)" in quiz.score.value
    q1 = quiz.questions[1]
    quiz.choices[1].value = q1.choices[(q1.answer + 1) % len(q1.choices)]
    assert quiz.check(1) is False
    assert "✘" in quiz.feedback[1].value and f"Score: 1 / {n} (2 answered)" in quiz.score.value
    quiz.buttons[2].click()  # nothing picked
    assert "Pick an answer first" in quiz.feedback[2].value


def test_a_chapter_that_is_no_chapter_is_refused_at_the_boundary():
    for bad, error in [("²", ValueError), ("7c", ValueError)]:
        with pytest.raises(error):
            questions(bad)
    assert questions(7) == questions("07") and questions("07b")

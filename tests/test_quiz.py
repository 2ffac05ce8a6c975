import pytest

from ar_lab.quiz import QuizWidget, check_answer, questions
from ar_lab.quiz_bank import QUIZZES


def test_every_chapter_has_a_well_formed_quiz():
    assert sorted(QUIZZES) == [f"{i:02d}" for i in range(9)]
    for chapter in QUIZZES:
        qs = questions(chapter)
        assert 3 <= len(qs) <= 6, chapter
        for q in qs:
            assert len(q.choices) >= 2 and 0 <= q.answer < len(q.choices) and q.explanation
            assert len(set(q.choices)) == len(q.choices)


def test_required_questions_are_there():
    assert any(q.prompt == "Why is decoding sequential?" for q in questions("01"))
    spec = [q for q in questions("07") if q.prompt.startswith("Speculative decoding improves the quality")]
    assert spec and spec[0].choices[spec[0].answer] == "False"


def test_check_answer_explains_right_and_wrong():
    q = questions("04")[0]
    ok, text = check_answer(q, q.answer)
    assert ok and text.startswith("✔") and q.explanation in text
    wrong = (q.answer + 1) % len(q.choices)
    ok, text = check_answer(q, wrong)
    assert not ok and q.choices[q.answer] in text and q.explanation in text
    assert check_answer(q, None) == (False, "Pick an answer first.")
    with pytest.raises(ValueError, match="choice must be"):
        check_answer(q, 99)
    with pytest.raises(ValueError, match="no quiz for chapter"):
        questions("42")


def test_widget_headless():
    quiz = QuizWidget("07")
    n = len(questions("07"))
    assert n == len(quiz.questions) == len(quiz.buttons) and quiz.score.value.startswith(f"<i>Score: 0 / {n}")
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

"""End-of-chapter self-checks: multiple-choice and true/false questions with explanations.

The questions live in ``ar_lab.course.views.quiz_bank``; ``questions`` builds them, with the choices
of every multiple-choice question in a fixed order of their own (``display_order``), so
that the right answer's position carries no hint; ``check_answer`` is the pure logic the
widget calls (and tests call directly); ``show(chapter)`` builds the widget.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.quiz_bank import QUIZZES, TF


@dataclass(frozen=True)
class Question:
    prompt: str
    choices: tuple[str, ...]
    answer: int
    explanation: str


def display_order(prompt: str, choices: list[str]) -> list[int]:
    """The order in which a question's choices are shown: indices into ``choices``.

    True/false keeps its order. Any other question gets a permutation drawn from the
    SHA-256 of its prompt (read as digits of a mixed-radix number), the same on every
    machine and in every run (Python's ``hash`` is salted per process), so authors may
    write the right answer anywhere and the shown positions still spread evenly.
    """
    rest = list(range(len(choices)))
    if list(choices) == TF:
        return rest
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest(), "big")
    order = []
    while rest:
        seed, k = divmod(seed, len(rest))
        order.append(rest.pop(k))
    return order


def _question(d: dict) -> Question:
    order = display_order(d["q"], d["choices"])
    choices = tuple(d["choices"][i] for i in order)
    return Question(d["q"], choices, order.index(d["answer"]), d["why"])


def questions(chapter: str) -> list[Question]:
    """The quiz of a chapter ("00" … "09"), choices in their shown order."""
    chapter = (
        f"{int(chapter):02d}" if str(chapter).isascii() and str(chapter).isdigit() else str(chapter)
    )
    if chapter not in QUIZZES:
        raise BadValue(
            f"no quiz for chapter {chapter!r}; chapters with quizzes: {sorted(QUIZZES)}",
            arg="chapter",
        )
    return [_question(d) for d in QUIZZES[chapter]]


def check_answer(question: Question, choice: int | None) -> tuple[bool, str]:
    """(correct?, feedback to show). ``choice`` is the index picked, None if nothing was picked."""
    if choice is None:
        return False, "Pick an answer first."
    if not isinstance(choice, int) or isinstance(choice, bool):
        raise BadType(
            f"choice must be the index of a choice (an int) or None, got {choice!r}", arg="choice"
        )
    if not 0 <= choice < len(question.choices):
        raise BadValue(f"choice must be 0..{len(question.choices) - 1}, got {choice}", arg="choice")
    right = question.choices[question.answer]
    if choice == question.answer:
        return True, f"✔ Right. {question.explanation}"
    return False, f"✘ Not quite: the answer is “{right}”. {question.explanation}"


class QuizWidget:
    """One block per question: choices, a Check button, feedback; and a running score."""

    def __init__(self, chapter: str) -> None:
        import ipywidgets as w

        self.questions = questions(chapter)
        self.choices, self.buttons, self.feedback, self.results = (
            [],
            [],
            [],
            [None] * len(self.questions),
        )
        blocks = []
        for i, q in enumerate(self.questions):
            radio = w.RadioButtons(
                options=list(q.choices), value=None, layout=w.Layout(width="auto")
            )
            button = w.Button(description="Check", button_style="primary")
            fb = w.HTML()
            button.on_click(lambda _b, i=i: self.check(i))
            self.choices.append(radio)
            self.buttons.append(button)
            self.feedback.append(fb)
            blocks.append(w.VBox([w.HTML(f"<b>{i + 1}. {q.prompt}</b>"), radio, button, fb]))
        self.score = w.HTML()
        self._update_score()
        self.widget = w.VBox([*blocks, self.score])

    def check(self, i: int) -> bool:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.questions):
            raise BadValue(
                f"question i must be an index 0..{len(self.questions) - 1}, got {i!r}", arg="i"
            )
        radio = self.choices[i]
        choice = None if radio.value is None else list(radio.options).index(radio.value)
        correct, text = check_answer(self.questions[i], choice)
        if choice is not None:
            self.results[i] = correct
        colour = "#1e8449" if correct else "#b03a2e"
        self.feedback[i].value = f"<span style='color:{colour}'>{text}</span>"
        self._update_score()
        return correct

    def _update_score(self) -> None:
        answered = [r for r in self.results if r is not None]
        self.score.value = (
            f"<i>Score: {sum(answered)} / {len(self.questions)} ({len(answered)} answered)</i>"
        )

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def show(chapter: str) -> QuizWidget:
    """The quiz widget of a chapter; display it as the last expression of a cell."""
    return QuizWidget(chapter)

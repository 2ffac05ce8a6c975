"""The speculative explorer's text: whole characters, each coloured by the token that completed
it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadValue
from ar_lab.course.views.plots import COLORS
from ar_lab.course.views.speculative_view import (
    speculation_text_html,
    speculation_view,
    token_pieces,
)
from ar_lab.engine.speculative import SpeculativeStats
from ar_lab.model.tokenizer import EOS_ID, decode, encode
from tests.conftest import ScriptedModel
from tests.raising import raises


def test_a_multi_byte_character_belongs_to_the_token_that_completes_it():
    assert encode("naïve") == [110, 97, 0xC3, 0xAF, 118, 101]
    assert token_pieces(encode("naïve")) == ["n", "a", "", "ï", "v", "e"]
    assert token_pieces(encode("€😀")) == ["", "", "€", "", "", "", "😀"]
    assert token_pieces([]) == []


def test_eos_is_marked_and_a_character_it_cuts_short_is_replaced():
    assert token_pieces(encode("a") + [EOS_ID] + encode("b")) == ["a", "⟨EOS⟩", "b"]
    cut = encode("é")[:1]  # the first byte of a two-byte character, then EOS
    assert token_pieces(cut + [EOS_ID]) == ["\ufffd", "⟨EOS⟩"]
    assert token_pieces(encode("ï")[:1]) == ["\ufffd"]  # the text ends inside a character


@given(st.lists(st.integers(0, 255), max_size=40))
def test_pieces_join_to_the_decoded_text(tokens):
    pieces = token_pieces(tokens)
    assert len(pieces) == len(tokens) and "".join(pieces) == decode(tokens)


def _view(tokens, accepted, emitted):
    stats = SpeculativeStats(
        gamma=2, accepted_per_iteration=accepted, emitted_per_iteration=emitted
    )
    return SimpleNamespace(prompt="A ", result=SimpleNamespace(tokens=tokens, stats=stats))


def test_the_text_html_shows_whole_characters_in_the_colour_of_their_last_byte():
    # iterations: (draft, draft, target) (draft, target) (target) -> n a 0xC3 | 0xAF v | e
    html = speculation_text_html(_view(encode("naïve"), [2, 1, 0], [3, 2, 1]))
    span = "<span style='color:{}'>{}</span>"
    assert "\ufffd" not in html and "na\ufffd" not in html
    assert span.format(COLORS["draft"], "ï") in html  # its second byte was an accepted draft token
    assert (
        span.format(COLORS["draft"], "n")
        + span.format(COLORS["draft"], "a")
        + span.format(COLORS["draft"], "ï")
        in html
    )
    assert span.format(COLORS["target"], "v") + span.format(COLORS["target"], "e") in html


def test_the_explorer_text_of_a_real_run_is_not_garbled():
    script = encode("naïve café") + [EOS_ID]
    prompt = encode("A ")
    model = ScriptedModel(script, len(prompt))
    view = speculation_view(model, model, "A ", gamma=3, max_new_tokens=len(script) - 1, repeats=1)
    html = speculation_text_html(view)
    text = "".join(p for p in token_pieces(view.result.tokens))
    assert text == "naïve café" and "\ufffd" not in html
    assert "ï" in html and "é" in html


def test_chi_square_against_known_values():
    from ar_lab.course.views.speculative_view import chi_square

    stat, dof, p = chi_square(torch.tensor([25.0, 25, 50]), torch.tensor([0.25, 0.25, 0.5]))
    assert stat == 0 and dof == 2 and abs(p - 1) < 1e-12
    stat, dof, p = chi_square(torch.tensor([30, 20, 50]), torch.tensor([0.25, 0.25, 0.5]))
    assert abs(stat - 2.0) < 1e-12 and abs(p - math.exp(-1)) < 1e-9  # 2 dof: p = exp(-stat / 2)
    # an impossible outcome
    assert chi_square(torch.tensor([1, 9, 0]), torch.tensor([0.0, 0.5, 0.5]))[2] == 0.0
    with raises(BadValue, 'probs'):
        chi_square(torch.ones(3), torch.ones(4) / 4)

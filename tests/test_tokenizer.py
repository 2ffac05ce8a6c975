from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.tokenizer import EOS_ID, VOCAB_SIZE, StreamDecoder, decode, encode
from tests.raising import raises


@given(st.text())
def test_round_trip_any_unicode(text):
    assert decode(encode(text)) == text


@given(st.text())
def test_stream_decoder_never_emits_half_a_character(text):
    dec = StreamDecoder()
    pieces = [dec.feed(t) for t in encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    # every piece is whole characters: no replacement character can appear for valid UTF-8
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stream_decoder_holds_partial_bytes():
    dec = StreamDecoder()
    euro = encode("€")
    assert len(euro) == 3
    assert [dec.feed(b) for b in euro] == ["", "", "€"]


def test_eos_and_vocabulary():
    assert VOCAB_SIZE == 257 and EOS_ID == 256
    assert encode("hi", add_eos=True) == [104, 105, EOS_ID]
    assert decode([104, 105, EOS_ID, 106]) == "hi"
    assert decode([104, EOS_ID, 105], stop_at_eos=False) == "hi"
    dec = StreamDecoder()
    assert dec.feed(104) == "h" and dec.feed(EOS_ID) == "" and dec.feed(105) == ""


def test_invalid_bytes_become_replacement_characters():
    assert decode([0xFF, 104]) == "\ufffdh"


def test_bad_input_is_rejected_clearly():
    with raises(BadValue, 'ids'):
        decode([300])
    with raises(BadValue, 'token_id'):
        StreamDecoder().feed(-1)
    with raises(BadType, 'text'):
        encode(b"bytes")

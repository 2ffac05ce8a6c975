"""Chapter 06b's grammar exercise: a learner's "bytes so far -> allowed next token ids" function
against ``ar_lab.engine.constrained.JsonObject``, prefix by prefix, with the classic mistakes named.

``grading_prefixes`` gives the prefixes to grade on: the empty one, every prefix of texts that reach
the grammar's edges (an empty string, a string at its length limit, 0, a negative number, an integer
at its digit limit, the complete object), prefixes that break the grammar (a backslash in a string,
a leading zero, a second object...), and prefixes of random walks through the grammar.
``check_allowed_next`` compares the learner's answer with the grammar's on each and, at the first
difference, says which rule the answer breaks (EOS before the object closes, a quote inside a string
not closing it, a field after the last one, ...).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable

import torch

from ar_lab.course.checkers.answers import require_answer
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.engine.constrained import DIGITS, STRING_BYTES, JsonObject, describe_ids
from ar_lab.model.tokenizer import EOS_ID, VOCAB_SIZE


def _edge_texts(grammar: JsonObject) -> list[str]:
    """Complete texts that reach the grammar's limits."""
    def value(kind: str, i: int):
        if kind == "string":
            return ["", "x" * grammar.max_string, "a b~{}"][i % 3]
        return [0, -(10 ** grammar.max_digits - 1), 42][i % 3]

    return [json.dumps({key: value(kind, i) for key, kind in grammar.fields}) for i in range(3)]


def _walk(grammar: JsonObject, rnd: random.Random) -> bytes:
    state, out = grammar.start(), []
    while True:
        token = rnd.choice(sorted(grammar.allowed_ids(state)))
        if token == EOS_ID:
            return bytes(out)
        out.append(token)
        state = grammar.advance(state, token)


def grading_prefixes(grammar: JsonObject, *, walks: int = 0, seed: int = 0) -> list[bytes]:
    """The prefixes to grade on (see the module's docstring); ``walks`` random walks add all their
    prefixes."""
    texts = [t.encode() for t in _edge_texts(grammar)]
    rnd = random.Random(seed)
    texts += [_walk(grammar, rnd) for _ in range(walks)]
    prefixes = {t[:i] for t in texts for i in range(len(t) + 1)}
    first = texts[0]
    open_string = next(
        (first[:i] for i in range(len(first)) if grammar.state_after(first[:i]).part == "string"),
        b"{",
    )
    broken = [
        open_string + b"\\",  # an escape
        open_string + b'"x',  # a letter where the closing quote was
        first + b"{",  # a second object
        first + b",",
        b'{"',
        b"x",
    ]
    for text in texts:  # a leading zero, a letter in an integer
        for i in range(len(text)):
            if grammar.state_after(text[:i]).part == "integer":
                prefixes |= {
                    text[:i] + b"00",
                    text[:i] + b"0",
                    text[:i] + b"-",
                    text[:i] + b"-0",
                    text[:i] + b"a",
                }
                break
    return sorted(prefixes | set(broken), key=lambda p: (len(p), p))


def _ids(got, what: str) -> set[int]:
    if isinstance(got, torch.Tensor) and got.dtype == torch.bool:
        return set(got.nonzero().flatten().tolist())
    if isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
        raise CheckFailed(
            f"{what}: expected a set of token ids (ints; EOS is {EOS_ID}), got {type(got).__name__}"
        )
    ids = set(got)
    bad = [
        t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB_SIZE
    ]
    if bad:
        raise CheckFailed(
            f"{what}: {bad[0]!r} is not a token id (ints 0..{VOCAB_SIZE - 1}; EOS is {EOS_ID})"
        )
    return ids


def _mistake(grammar: JsonObject, prefix: bytes, got: set[int], want: set[int]) -> str:
    """The rule a wrong answer breaks, in words."""
    if not want:
        return (
            "this prefix has already broken the grammar (no valid text starts with it): nothing "
            "may follow it, return an empty set"
        )
    state = grammar.state_after(prefix)
    extra, missing = got - want, want - got
    if EOS_ID in extra:
        return (
            "EOS is allowed only once the object is closed by its '}': before that the text is "
            "not valid JSON"
        )
    if EOS_ID in missing:
        return (
            f"after the closing '}}' the text is complete: EOS ({EOS_ID}) is the only token allowed"
        )
    if ord("\\") in extra:
        return "escapes are refused here: a backslash may not appear in a string value"
    if ord(",") in extra and ord("}") in want:
        return (
            "after the last value the object closes with '}': a ',' would start a key again (a "
            "key allowed twice)"
        )
    if state.part == "string" and ord('"') in missing:
        return (
            "a quote inside a string ends it: it is always allowed in a string (it closes the "
            "value)"
        )
    if state.part == "string" and state.n == grammar.max_string:
        return (
            f"a string holds at most {grammar.max_string} characters: at the limit only the "
            "closing quote"
        )
    closed = prefix.endswith(b'"') and grammar.state_after(prefix[:-1]).part == "string"
    if state.part == "literal" and closed and extra & STRING_BYTES:
        return (
            "a quote inside a string ends it: after the closing quote only the next fixed piece "
            "(', \"key\": ' or '}') may come"
        )
    if state.part == "integer" and state.zero and extra & DIGITS:
        return (
            "no leading zeros in JSON: after a first digit 0 the integer is over (',' or '}' next)"
        )
    if state.part == "integer" and state.n == grammar.max_digits and extra & DIGITS:
        return f"an integer has at most {grammar.max_digits} digits here: at the limit it must end"
    if state.part == "integer" and state.n == 0 and extra - DIGITS - {ord("-")}:
        return "an integer needs at least one digit (after an optional '-')"
    if state.part == "literal":
        return (
            "here the next byte is fixed: the pieces between values are written exactly as "
            "json.dumps writes them"
        )
    return "compare with the rules above, byte by byte"


def check_allowed_next(
    name: str, fn: Callable[[bytes], Iterable[int]], grammar: JsonObject, prefixes: Iterable[bytes]
) -> None:
    """``fn(prefix)`` must be the set of ids ``grammar`` allows after ``prefix`` (empty for a broken
    prefix); None, or ar_lab's own function, is no answer yet (``answers.require_answer``)."""
    require_answer(name, fn)
    for prefix in prefixes:
        want = set(grammar.allowed_after(list(prefix)).nonzero().flatten().tolist())
        what = f"{name}({prefix!r})"
        got = _ids(fn(prefix), what)
        if got != want:
            diff = [f"yours also allows {describe_ids(got - want)}" if got - want else "",
                    f"yours leaves out {describe_ids(want - got)}" if want - got else ""]
            raise CheckFailed(
                f"{what}: the grammar allows {describe_ids(want)}; "
                f"{'; '.join(d for d in diff if d)}\nHint: {_mistake(grammar, prefix, got, want)}"
            )

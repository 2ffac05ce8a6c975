"""Constrained (structured) decoding: a grammar's state machine masks the vocabulary at every step.

JSON mode and grammars in serving engines (Outlines, XGrammar, vLLM's guided decoding, Hugging
Face's ``prefix_allowed_tokens_fn``) add one step to the sampler chain: before the sampler sees the
logits, every token the grammar does not allow next gets logit ``-inf`` (llama.cpp's GBNF, by
default, checks the drawn token instead and draws again with the mask first when it is refused: the
same distribution when no truncation is on). A grammar here is a state machine over token ids:

- ``start()`` -> the state before the first new token;
- ``allowed(state)`` -> a bool mask (vocab,): the tokens that keep the text a valid prefix; EOS is
  in it only where the text so far is complete;
- ``advance(state, token)`` -> the next state (a ``ValueError`` saying what is allowed, for a token
  that is not);
- ``complete(state)`` -> whether the text so far is a whole sentence of the grammar.

States are immutable values, so one grammar object serves any number of generations, in any number
of threads, at once. The vocabulary is the course's bytes (ids 0..255, EOS 256): a grammar over
bytes is a few dozen lines. ``JsonObject`` (a JSON object with fixed keys, in order, whose values
are strings or integers), ``Choice`` (one of some literal strings) and ``PrefixFunction`` (a
function "bytes so far -> allowed next ids", what chapter 06's learner writes) are the grammars of
this module.

**What the mask does to the distribution.** Masking logits to ``-inf`` and taking the softmax is the
distribution *renormalised over the allowed tokens*: q'(t) = q(t) / sum of q over the allowed set,
for allowed t, else 0 (q: the model's distribution after the penalty and the temperature). The
decode loops mask *before* the sampler chain (temperature, top-k, top-p, min-p), so each truncation
works on that renormalised distribution: top-p's nucleus is made of allowed tokens, and it can never
leave nothing. The renormalisation is local, one step at a time: when the model puts little mass on
every allowed token (a key it would never write, a closing brace where it wanted to keep talking),
the whole mass is handed to tokens it considered unlikely, and the text goes on from there. The
output is always valid, but it is not the model's distribution conditioned on validity (Park et al.,
2024, *Grammar-Aligned Decoding*, show the distortion): a forced low-probability path can degrade
what follows. ``python -m ar_lab.bench constrained`` measures it on the course model.

With vocabularies of 100k+ multi-byte tokens, computing the mask is the hard part (a token may span
several grammar steps). Outlines precomputes, for each state of a regular expression's automaton,
the tokens it allows (Willard and Louf, 2023, *Efficient Guided Generation for Large Language
Models*); XGrammar (Dong et al., 2024) decides the tokens that do not depend on the parser's stack
ahead of time and checks the few others at run time; llama.cpp checks candidates at run time. On 257
byte tokens the mask is computed directly from the state, every step.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.tokenizer import EOS_ID, VOCAB_SIZE, encode

# String values: printable ASCII without the quote (it closes the string) and the backslash (no
# escapes).
# ' ' .. '~', without '"' and '\\'
STRING_BYTES = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\")}
DIGITS = frozenset(b"0123456789")
MASK_CACHE = 4096  # masks a grammar keeps, one per distinct allowed set
KINDS = {str: "string", int: "integer", "string": "string", "integer": "integer"}


def describe_ids(ids: Iterable[int]) -> str:
    """Token ids as a short readable list: "'0'-'9', ',', EOS" (runs of consecutive bytes as
    ranges)."""
    ids = sorted(ids)
    if not ids:
        return "nothing"
    parts, i = [], 0
    byte_ids = [t for t in ids if t < 256]
    while i < len(byte_ids):
        j = i
        while j + 1 < len(byte_ids) and byte_ids[j + 1] == byte_ids[j] + 1:
            j += 1
        lo, hi = repr(chr(byte_ids[i])), repr(chr(byte_ids[j]))
        parts.append(lo if i == j else f"{lo}-{hi}" if j > i + 1 else f"{lo}, {hi}")
        i = j + 1
    parts += ["EOS" if t == EOS_ID else str(t) for t in ids if t >= 256]
    return ", ".join(parts)


class Grammar:
    """The state-machine interface; a subclass gives ``start``, ``allowed_ids`` (the allowed next
    ids, EOS included where the text is complete), ``_step`` (the state after an allowed byte) and
    ``complete``.

    ``allowed``, ``advance`` and the helpers over whole texts (``state_after``, ``accepts``,
    ``allowed_after``) are written once here on top of those four.
    """

    vocab_size = VOCAB_SIZE

    def start(self):
        raise NotImplementedError

    def allowed_ids(self, state) -> frozenset[int]:
        raise NotImplementedError

    def _step(self, state, token: int):
        raise NotImplementedError

    def complete(self, state) -> bool:
        raise NotImplementedError

    def allowed(self, state) -> torch.Tensor:
        """The bool mask (vocab,) of the tokens allowed next (a fresh tensor: the caller may change
        it).

        Masks are built once per distinct allowed set and kept (``MASK_CACHE`` of them at most): a
        grammar has few distinct sets (string characters, digits, one literal byte...), and indexing
        a tensor costs more than looking a set up. Outlines and XGrammar push this further and
        precompute (most of) the masks ahead of time.
        """
        ids = self.allowed_ids(state)
        # set -> mask; equal values if two threads race
        masks = self.__dict__.setdefault("_masks", {})
        mask = masks.get(ids)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(ids)] = True
            if len(masks) < MASK_CACHE:
                masks[ids] = mask
        return mask.clone()

    def advance(self, state, token: int):
        """The state after ``token``; a ``ValueError`` naming what is allowed if the grammar refuses
        it."""
        if isinstance(token, torch.Tensor) and token.numel() == 1 and not token.is_floating_point():
            token = token.item()
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise BadType(f"token must be a token id (an int), got {token!r}", arg="token")
        token = int(token)
        ids = self.allowed_ids(state)
        if token not in ids:
            shown = (
                "EOS" if token == EOS_ID else repr(chr(token)) if 0 <= token < 256 else str(token)
            )
            raise BadValue(
                f"token {token} ({shown}) is not allowed here by {self!r}; allowed: "
                f"{describe_ids(ids)}",
                arg="token",
            )
        if token == EOS_ID:
            raise BadValue(
                "EOS ends the text: there is no state after this token (the decode loops stop "
                "there)",
                arg="token",
            )
        return self._step(state, token)

    def state_after(self, tokens: str | Sequence[int]):
        """The state after a prefix (text or token ids); a ``ValueError`` at the first refused
        token."""
        ids = encode(tokens) if isinstance(tokens, str) else list(tokens)
        state = self.start()
        for i, token in enumerate(ids):
            try:
                state = self.advance(state, token)
            # a token of ``tokens`` is at fault, or a PrefixFunction's ``fn``
            except ValueError as e:
                arg = "fn" if getattr(e, "arg", None) == "fn" else "tokens"
                shown = bytes(t for t in ids[:i] if t < 256)
                raise BadValue(f"at position {i} of tokens {shown!r}: {e}", arg=arg) from None
        return state

    def accepts(self, tokens: str | Sequence[int]) -> bool:
        """True if the text (or ids, optionally ending in EOS) is a complete sentence of the
        grammar."""
        ids = encode(tokens) if isinstance(tokens, str) else list(tokens)
        if ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        try:
            return self.complete(self.state_after(ids))
        except ValueError:
            return False

    def allowed_after(self, tokens: str | Sequence[int]) -> torch.Tensor:
        """The mask after a prefix: all False when the prefix itself is not valid."""
        try:
            return self.allowed(self.state_after(tokens))
        except ValueError:
            return torch.zeros(self.vocab_size, dtype=torch.bool)


def _check_key(key) -> str:
    if not isinstance(key, str) or not key:
        raise BadValue(f"every key of fields must be a non-empty str, got {key!r}", arg="fields")
    bad = [c for c in key if ord(c) not in STRING_BYTES]
    if bad:
        raise BadValue(
            f"key {key!r} of fields holds {bad[0]!r}: keys are printable ASCII without '\"' or "
            "'\\' (written without escapes)",
            arg="fields",
        )
    return key


def _fields(fields) -> tuple[tuple[str, str], ...]:
    """``fields`` (a dict key -> str/int, or (key, kind) pairs) checked, as ((key,
    "string"|"integer"), ...)."""
    pairs = list(fields.items()) if isinstance(fields, Mapping) else fields
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise BadType(
            "fields must be a dict key -> str or int (or (key, kind) pairs), got "
            f"{type(fields).__name__}",
            arg="fields",
        )
    pairs = list(pairs)
    if not pairs:
        raise BadValue(
            "fields is empty: give at least one key, e.g. {'name': str, 'size': int}", arg="fields"
        )
    out, seen = [], set()
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise BadValue(
                f"each field is a (key, kind) pair, got {pair!r} in fields", arg="fields"
            )
        key, kind = _check_key(pair[0]), pair[1]
        if key in seen:
            raise BadValue(
                f"key {key!r} is given twice in fields: a JSON object's keys must be distinct",
                arg="fields",
            )
        if not isinstance(kind, (type, str)) or kind not in KINDS:
            raise BadValue(
                f"the kind of {key!r} in fields must be str or int (or 'string' / 'integer'), "
                f"got {kind!r}",
                arg="fields",
            )
        seen.add(key)
        out.append((key, KINDS[kind]))
    return tuple(out)


class JsonState(NamedTuple):
    """Where a ``JsonObject`` text stands: ``part`` is "literal" (the fixed bytes before value
    ``field``, ``n`` of them written; field == number of fields: the closing brace), "string" (``n``
    characters of value ``field``), "integer" (``n`` digits; ``sign``: a minus came first; ``zero``:
    the first digit was 0, so no digit may follow) or "end" (the object is closed)."""

    part: str
    field: int
    n: int = 0
    sign: bool = False
    zero: bool = False


class JsonObject(Grammar):
    """A JSON object with the keys of ``fields``, in that order, written the way ``json.dumps``
    writes it: ``{"name": "spam", "size": 42}`` (one space after each colon and comma, none
    elsewhere).

    ``fields``: a dict key -> ``str`` or ``int`` (or a list of (key, kind) pairs). String values
    hold printable ASCII (space to '~') without '"' or '\\' (no escapes), at most ``max_string``
    characters; integers are JSON integers (an optional minus, no leading zeros) of at most
    ``max_digits`` digits. ``valid(text)`` checks a finished text with ``json.loads``, independently
    of the state machine.
    """

    def __init__(self, fields, *, max_string: int = 32, max_digits: int = 9) -> None:
        self.fields = _fields(fields)
        self.max_string = positive_int("max_string", max_string)
        self.max_digits = positive_int("max_digits", max_digits)
        if self.max_digits > 18:
            raise BadValue(
                f"max_digits must be at most 18 (an int64), got {max_digits!r}", arg="max_digits"
            )
        # The fixed bytes before each value ('{"name": "' opens a string value too), then the
        # closing brace.
        self.literals = tuple(
            encode(
                ("{" if i == 0 else ", ")
                + json.dumps(key)
                + ": "
                + ('"' if kind == "string" else "")
            )
            for i, (key, kind) in enumerate(self.fields)
        ) + (encode("}"),)

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{k!r}: {'str' if kind == 'string' else 'int'}" for k, kind in self.fields
        )
        return (
            f"JsonObject({{{inner}}}, max_string={self.max_string}, max_digits={self.max_digits})"
        )

    def start(self) -> JsonState:
        return JsonState("literal", 0)

    def complete(self, state: JsonState) -> bool:
        return state.part == "end"

    def allowed_ids(self, state: JsonState) -> frozenset[int]:
        part, field, n = state.part, state.field, state.n
        if part == "literal":
            return frozenset({self.literals[field][n]})
        if part == "string":  # more characters (up to the cap), or the quote that closes the string
            return (STRING_BYTES if n < self.max_string else frozenset()) | {ord('"')}
        if part == "integer":
            if n == 0:  # a digit must come first (after an optional minus)
                return DIGITS if state.sign else DIGITS | {ord("-")}
            more = DIGITS if not state.zero and n < self.max_digits else frozenset()
            return more | {self.literals[field + 1][0]}  # or the next literal: the integer is over
        return frozenset({EOS_ID})  # "end": only EOS

    def _step(self, state: JsonState, token: int) -> JsonState:
        part, field, n = state.part, state.field, state.n
        if part == "literal":
            if n + 1 < len(self.literals[field]):
                return state._replace(n=n + 1)
            if field == len(self.fields):
                return JsonState("end", field)
            # the value starts: "string" or "integer"
            return JsonState(self.fields[field][1], field)
        if part == "string":
            return JsonState("literal", field + 1) if token == ord('"') else state._replace(n=n + 1)
        if token in DIGITS:
            return state._replace(n=n + 1, zero=state.zero or (n == 0 and token == ord("0")))
        if token == ord("-"):
            return state._replace(sign=True)
        # the first byte of the next literal
        return self._step(JsonState("literal", field + 1), token)

    def valid(self, text: str, *, trailing: bool = False) -> bool:
        """True if ``text`` is a JSON object with exactly these keys in order, values of their
        kinds, within the limits (by ``json.loads``, not by the state machine); ``trailing``: text
        after the object is ignored (what judging free text fairly needs: the model need not stop
        where the object ends)."""
        return json_problem(text, self, trailing=trailing) is None


class _Pairs(list):
    """A JSON object as the (key, value) pairs it was written with."""


def json_problem(text: str, grammar: JsonObject, *, trailing: bool = False) -> str | None:
    """Why ``text`` is not a valid object of ``grammar`` (None when it is): "not JSON", "keys ...",
    ...

    Judged with the ``json`` module: an independent check of what the state machine produces.
    """
    if not isinstance(text, str):
        raise BadType(f"text must be a str, got {type(text).__name__}", arg="text")
    if not isinstance(grammar, JsonObject):
        raise BadType(f"grammar must be a JsonObject, got {type(grammar).__name__}", arg="grammar")
    try:  # pairs, not a dict: a key written twice must not pass as one
        obj, end = json.JSONDecoder(object_pairs_hook=_Pairs).raw_decode(text)
    except json.JSONDecodeError:
        return "not JSON"
    if text[end:] and not trailing:
        return f"text after the object: {text[end:][:20]!r}"
    if not isinstance(obj, _Pairs):
        return f"not an object (a {type(obj).__name__})"
    if [k for k, _ in obj] != [k for k, _ in grammar.fields]:
        return f"keys {[k for k, _ in obj]} instead of {[k for k, _ in grammar.fields]}"
    for (key, kind), (_, v) in zip(grammar.fields, obj, strict=True):
        if kind == "string" and not (isinstance(v, str) and len(v) <= grammar.max_string):
            return f"{key!r} is not a string of at most {grammar.max_string} characters"
        whole = isinstance(v, int) and not isinstance(v, bool)
        if kind == "integer" and (not whole or len(str(abs(v))) > grammar.max_digits):
            return f"{key!r} is not an integer of at most {grammar.max_digits} digits"
    return None


class Choice(Grammar):
    """Exactly one of some literal strings (e.g. ``Choice(["yes", "no"])``); the state is the bytes
    so far."""

    def __init__(self, options: Sequence[str]) -> None:
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise BadValue(
                f"options must be a non-empty list of strings, got {options!r}", arg="options"
            )
        for o in options:
            if not isinstance(o, str) or not o:
                raise BadValue(
                    f"every option must be a non-empty str, got {o!r} in options", arg="options"
                )
        if len(set(options)) != len(options):
            raise BadValue(f"options must be distinct, got {list(options)!r}", arg="options")
        self.options = tuple(options)
        self._encoded = tuple(bytes(encode(o)) for o in options)

    def __repr__(self) -> str:
        return f"Choice({list(self.options)!r})"

    def start(self) -> bytes:
        return b""

    def complete(self, state: bytes) -> bool:
        return state in self._encoded

    def allowed_ids(self, state: bytes) -> frozenset[int]:
        n = len(state)
        ids = {o[n] for o in self._encoded if len(o) > n and o.startswith(state)}
        return frozenset(ids | ({EOS_ID} if state in self._encoded else set()))

    def _step(self, state: bytes, token: int) -> bytes:
        return state + bytes([token])


class PrefixFunction(Grammar):
    """A grammar from a function ``prefix (bytes) -> the allowed next token ids`` (a set of ints,
    EOS = 256 where the prefix is complete): what chapter 06's learner writes. The state is the
    bytes so far and what the function allowed after them: one call of the function per token, on
    the whole prefix; its answers are checked (ids of the vocabulary)."""

    def __init__(self, fn: Callable[[bytes], Iterable[int]], name: str = "PrefixFunction") -> None:
        if not callable(fn):
            raise BadType(
                "fn must be a function prefix (bytes) -> allowed next ids, got "
                f"{type(fn).__name__}",
                arg="fn",
            )
        self.fn, self.name = fn, name

    def __repr__(self) -> str:
        return self.name

    def _ids(self, prefix: bytes) -> frozenset[int]:
        ids = self.fn(prefix)
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise BadType(
                f"{self.name} (fn) returned {type(ids).__name__}: it must return a set of token "
                "ids",
                arg="fn",
            )
        out = frozenset(ids)
        bad = [
            t
            for t in out
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < VOCAB_SIZE
        ]
        if bad:
            last = VOCAB_SIZE - 1
            raise BadValue(
                f"{self.name} (fn) returned {bad[0]!r} after {prefix!r}: token ids are ints 0.."
                f"{last}",
                arg="fn",
            )
        return frozenset(int(t) for t in out)

    def start(self) -> tuple[bytes, frozenset[int]]:
        return b"", self._ids(b"")

    def allowed_ids(self, state: tuple[bytes, frozenset[int]]) -> frozenset[int]:
        return state[1]

    def complete(self, state: tuple[bytes, frozenset[int]]) -> bool:
        return EOS_ID in state[1]

    def _step(
        self, state: tuple[bytes, frozenset[int]], token: int
    ) -> tuple[bytes, frozenset[int]]:
        prefix = state[0] + bytes([token])
        return prefix, self._ids(prefix)


# --- what the decode loops call ----------------------------------------------------------


def check_constraint(constraint, vocab_size: int) -> None:
    """A ``constraint=`` argument: None, or a grammar whose start state allows a token of this
    vocabulary."""
    if constraint is None:
        return
    if not all(
        callable(getattr(constraint, m, None)) for m in ("start", "allowed", "advance", "complete")
    ):
        raise BadType(
            "constraint must be a grammar with start(), allowed(state), advance(state, token) "
            "and complete(state), e.g. ar_lab.engine.constrained.JsonObject({'name': str}); "
            f"got {type(constraint).__name__}",
            arg="constraint",
        )
    mask = constraint.allowed(constraint.start())
    _check_mask(mask, vocab_size, "at the start")


def check_constraint_eos(constraint, eos_id) -> None:
    """A loop that stops at ``eos_id`` can run ``constraint`` only if that is the EOS the grammar
    allows."""
    if constraint is not None and eos_id != EOS_ID:
        raise BadValue(
            f"a constraint ends its text with EOS ({EOS_ID}): pass eos_id={EOS_ID}, got {eos_id!r}",
            arg="eos_id",
        )


def _check_mask(mask, vocab_size: int, where: str) -> None:
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.shape != (vocab_size,)
    ):
        got = (
            f"{mask.dtype} {tuple(mask.shape)}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise BadValue(
            f"the constraint's allowed(state) must be a bool tensor ({vocab_size},), got {got} "
            f"{where}",
            arg="constraint",
        )
    if not mask.any():
        raise BadValue(
            f"the constraint allows no token {where}: a grammar must allow a next token in every "
            "state it reaches (EOS once its text is complete)",
            arg="constraint",
        )


def masked_logits(logits: torch.Tensor, constraint, state, step: int) -> torch.Tensor:
    """``logits`` (vocab,) or (B, vocab) with the tokens ``constraint`` refuses in ``state`` (one
    state, or one per row; None for a finished row: nothing masked) set to -inf: the mask step
    before the sampler chain."""
    if logits.ndim == 1:
        mask = constraint.allowed(state)
        _check_mask(mask, logits.shape[-1], f"after {step} new tokens")
    else:
        full = torch.ones(logits.shape[-1], dtype=torch.bool)
        rows = [full if s is None else constraint.allowed(s) for s in state]
        for row in rows:
            _check_mask(row, logits.shape[-1], f"after {step} new tokens")
        mask = torch.stack(rows)
    return logits.masked_fill(~mask.to(logits.device), float("-inf"))

"""Constrained decoding: the grammar's state machine against an independent oracle (a regular
expression with partial matching, and ``json``), and the ``constraint=`` option of every decode
loop: always valid, exactly the renormalised distribution, greedy unchanged where it was valid
already, errors that say why."""

import json
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.beam import beam_search
from ar_lab.engine.constrained import (
    STRING_BYTES,
    Choice,
    JsonObject,
    PrefixFunction,
    describe_ids,
    json_problem,
    masked_logits,
)
from ar_lab.engine.generate import generate, sample_batch, stream, token_steps
from ar_lab.engine.sampling import GREEDY, SamplingParams, probabilities
from ar_lab.model.tokenizer import EOS_ID, decode, encode
from tests.raising import raises

# partial matching: is a text a prefix of some sentence of a pattern? (installed with transformers)
try:
    import regex
except ImportError:  # pragma: no cover
    regex = None
needs_regex = pytest.mark.skipif(
    regex is None, reason="the oracle needs the regex package (pip install regex)"
)

FIELDS = {"name": str, "size": int, "tag": str}
GRAMMAR = JsonObject(FIELDS, max_string=6, max_digits=3)
STRING_CHARS = "".join(sorted(chr(b) for b in STRING_BYTES))


def pattern(grammar: JsonObject) -> str:
    """The grammar's language as a regular expression, written from its description, not from its
    code."""
    chars = "[" + "".join(regex.escape(c) for c in STRING_CHARS) + "]"
    values = {
        "string": f'"{chars}{{0,{grammar.max_string}}}"',
        "integer": f"-?(0|[1-9][0-9]{{0,{grammar.max_digits - 1}}})",
    }
    body = ", ".join(f'"{key}": {values[kind]}' for key, kind in grammar.fields)
    return regex.escape("{") + body + regex.escape("}")


PATTERN = regex.compile(pattern(GRAMMAR)) if regex is not None else None


def oracle_mask(prefix: bytes) -> torch.Tensor:
    """Byte b is allowed after ``prefix`` iff prefix + b is a prefix of a sentence; EOS iff prefix
    is one."""
    text = prefix.decode("latin-1")
    mask = torch.zeros(257, dtype=torch.bool)
    for b in range(256):
        mask[b] = PATTERN.fullmatch(text + chr(b), partial=True) is not None
    mask[EOS_ID] = PATTERN.fullmatch(text) is not None
    return mask


strings = st.text(alphabet=STRING_CHARS, max_size=GRAMMAR.max_string)
integers = st.integers(min_value=-999, max_value=999)
objects = st.tuples(strings, integers, strings).map(lambda v: dict(zip(FIELDS, v, strict=True)))


@needs_regex
@given(objects)
def test_a_valid_text_is_accepted_byte_by_byte_and_every_mask_agrees_with_the_oracle(obj):
    text = json.dumps(obj)
    ids = encode(text)
    state = GRAMMAR.start()
    for i, b in enumerate(ids + [EOS_ID]):
        mask = GRAMMAR.allowed(state)
        assert mask[b], f"{describe_ids([b])} refused after {text[:i]!r}"
        assert torch.equal(mask, oracle_mask(bytes(ids[:i]))), f"after {text[:i]!r}"
        if b != EOS_ID:
            assert not GRAMMAR.complete(state)
            state = GRAMMAR.advance(state, b)
    assert GRAMMAR.complete(state) and GRAMMAR.accepts(text) and GRAMMAR.valid(text)


@needs_regex
@given(objects, st.integers(0, 60), st.integers(0, 255))
def test_a_byte_that_breaks_the_text_is_refused_and_leaves_no_valid_continuation(obj, cut, byte):
    prefix = encode(json.dumps(obj))[:cut] + [byte]
    ok = PATTERN.fullmatch(bytes(prefix).decode("latin-1"), partial=True) is not None
    assert GRAMMAR.allowed_after(prefix[:-1])[byte] == ok
    # an invalid prefix allows nothing after it
    assert bool(GRAMMAR.allowed_after(prefix).any()) == ok


@given(st.randoms(use_true_random=False))
def test_random_walks_through_the_grammar_end_in_valid_json(rnd):
    state, ids = GRAMMAR.start(), []
    while True:
        choices = sorted(GRAMMAR.allowed_ids(state))
        token = rnd.choice(choices)
        if token == EOS_ID:
            break
        ids.append(token)
        state = GRAMMAR.advance(state, token)
    text = decode(ids)
    assert json_problem(text, GRAMMAR) is None and list(json.loads(text)) == list(FIELDS)


def test_the_validator_names_what_is_wrong():
    assert json_problem('{"name": "a", "size": 1, "tag": ""}', GRAMMAR) is None
    cases = {
        '{"name": "a", "size": 1}': "keys",
        '{"name": "a", "size": 1, "tag": "", "tag": ""}': "keys",  # a key written twice
        '{"name": "a", "size": 1.5, "tag": ""}': "'size' is not an integer",
        '{"name": "abcdefg", "size": 1, "tag": ""}': "'name' is not a string",
        '{"name": "a", "size": 1, "tag": ""} and more': "text after the object",
        "[1, 2]": "not an object",
        '{"name": ': "not JSON",
    }
    for text, why in cases.items():
        assert why in json_problem(text, GRAMMAR), text
    assert (
        json_problem('{"name": "a", "size": 1, "tag": ""} and more', GRAMMAR, trailing=True) is None
    )


@pytest.mark.parametrize("text, ok", [
    ('{"name": "", "size": 0, "tag": "x"}', True),
    ('{"name": "", "size": -0, "tag": "x"}', True),
    ('{"name": "", "size": 01, "tag": "x"}', False),  # a leading zero
    ('{"name": "", "size": -, "tag": "x"}', False),
    ('{"name": "a\\"b", "size": 1, "tag": "x"}', False),  # escapes are refused
    ('{"name":"a", "size": 1, "tag": "x"}', False),  # json.dumps's spacing only
    ('{"size": 1, "name": "a", "tag": "x"}', False),  # keys in order
    ('{"name": "a", "size": 1, "tag": "x"', False),  # not closed
])
def test_edge_texts(text, ok):
    assert GRAMMAR.accepts(text) == ok


def test_choice_and_prefix_function_grammars():
    c = Choice(["yes", "no", "yesterday"])
    assert (
        c.accepts("yes")
        and c.accepts("yesterday")
        and not c.accepts("ye")
        and not c.accepts("yess")
    )
    assert describe_ids(c.allowed_ids(b"yes")) == "'t', EOS"
    same = PrefixFunction(lambda p: GRAMMAR.allowed_ids(GRAMMAR.state_after(p)), name="mine")
    for text in ['{"name": "a', '{"name": "a", "size": 12', '{"name": "", "size": 0, "tag": ""}']:
        assert torch.equal(same.allowed_after(text), GRAMMAR.allowed_after(text))
        assert same.complete(same.state_after(text)) == GRAMMAR.accepts(text)


# --- the decode loops -------------------------------------------------------------------


SETTINGS = [
    GREEDY,
    SamplingParams(),
    SamplingParams(temperature=1.5, top_k=50),
    SamplingParams(top_p=0.9, min_p=0.05),
]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the model is only read
@given(st.integers(0, 2**32 - 1), st.sampled_from(SETTINGS))
def test_constrained_samples_are_always_valid(tiny_model, seed, params):
    g = torch.Generator().manual_seed(seed)
    run = generate(tiny_model, "x", 60, sampling=params, generator=g, constraint=GRAMMAR)
    assert run.stats.stop_reason == "eos" and json_problem(run.text, GRAMMAR) is None, run.text


def test_the_hook_sees_exactly_the_renormalised_distribution(tiny_model):
    """One step, exactly: the logits the sampler is handed give p(t) / p(allowed) on the allowed
    set, 0 elsewhere."""
    prefix = '{"name": "ab", "size": 1'
    seen = []

    def spy(logits, params, generator):
        seen.append(logits.clone())
        return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))

    class FromThere(JsonObject):  # the same grammar, started after the prefix
        def start(self):
            return GRAMMAR.state_after(prefix)

    g = torch.Generator().manual_seed(0)
    generate(tiny_model, "x" + prefix, 1, sampling=SamplingParams(), generator=g, sampler=spy,
             constraint=FromThere(FIELDS, max_string=6, max_digits=3))
    with torch.inference_mode():
        raw = tiny_model(torch.tensor([encode("x" + prefix)]))[0, -1].float()
    allowed = GRAMMAR.allowed_after(prefix)
    p = torch.softmax(raw, -1)
    want = torch.where(allowed, p, 0.0) / p[allowed].sum()
    got = torch.softmax(seen[0], -1)
    torch.testing.assert_close(got, want)
    assert int(allowed.sum()) == 11  # ten digits and the comma
    # the same through the package's own chain, at T = 1 and with a truncation after the mask
    masked = masked_logits(raw, GRAMMAR, GRAMMAR.state_after(prefix), 0)
    torch.testing.assert_close(probabilities(masked, SamplingParams()), want)
    top = probabilities(masked, SamplingParams(top_k=3))
    # top-k among the allowed tokens
    assert int((top > 0).sum()) == 3 and bool((top > 0).le(allowed).all())


def test_greedy_is_unchanged_where_the_free_output_is_already_valid():
    from conftest import ScriptedModel

    text = '{"name": "ok", "size": 7, "tag": "t"}'
    model = ScriptedModel(encode(text) + [EOS_ID], prompt_len=1)
    free, constrained = (generate(model, "x", 60, constraint=c) for c in (None, GRAMMAR))
    assert free.tokens == constrained.tokens and constrained.text == text
    broken = ScriptedModel(encode('{"name": "ok", size: 7}') + [EOS_ID], prompt_len=1)
    out = generate(broken, "x", 60, constraint=GRAMMAR)
    assert out.text.startswith('{"name": "ok", "size": ') and GRAMMAR.valid(out.text)


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95)], ids=lambda p: p.label
)
def test_cached_and_uncached_give_the_same_tokens_under_a_constraint(tiny_model, params):
    runs = [
        generate(
            tiny_model,
            "x",
            50,
            use_cache=c,
            sampling=params,
            generator=torch.Generator().manual_seed(3),
            constraint=GRAMMAR,
        ).tokens
        for c in (True, False)
    ]
    assert runs[0] == runs[1]


def test_stream_token_steps_and_sample_batch_take_the_constraint(tiny_model):
    params = SamplingParams(temperature=1.2)
    run = generate(
        tiny_model,
        "x",
        60,
        sampling=params,
        generator=torch.Generator().manual_seed(5),
        constraint=GRAMMAR,
    )
    events = list(
        stream(
            tiny_model,
            "x",
            60,
            sampling=params,
            generator=torch.Generator().manual_seed(5),
            constraint=GRAMMAR,
        )
    )
    assert "".join(e.text for e in events) == run.text and events[-1].stats.stop_reason == "eos"
    steps = list(
        token_steps(
            tiny_model,
            "x",
            60,
            sampling=params,
            generator=torch.Generator().manual_seed(5),
            constraint=GRAMMAR,
        )
    )
    assert steps == run.tokens + [EOS_ID]  # the steps end with the EOS the grammar allowed
    rows = sample_batch(
        tiny_model,
        ["ab", "cd", "ef"],
        60,
        sampling=params,
        generator=torch.Generator().manual_seed(1),
        constraint=GRAMMAR,
    )
    assert all(GRAMMAR.accepts(r) for r in rows) and len({tuple(r) for r in rows}) > 1
    greedy = sample_batch(tiny_model, ["ab", "cd"], 60, sampling=GREEDY, constraint=GRAMMAR)
    assert greedy == [generate(tiny_model, p, 60, constraint=GRAMMAR).tokens for p in ["ab", "cd"]]


def test_the_cap_returns_a_valid_unfinished_prefix_and_says_so(tiny_model):
    run = generate(tiny_model, "x", 12, constraint=GRAMMAR)
    assert run.stats.stop_reason == "max_new_tokens" and len(run.tokens) == 12
    assert not GRAMMAR.accepts(run.text) and GRAMMAR.allowed_after(run.text).any()


def test_choice_constrains_generation_to_its_options(tiny_model):
    options = ["spam", "eggs", "ham"]
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        run = generate(
            tiny_model, "x", 10, sampling=SamplingParams(), generator=g, constraint=Choice(options)
        )
        assert run.text in options and run.stats.stop_reason == "eos"


def test_one_grammar_serves_several_threads(tiny_model):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(
            tiny_model, "x", 50, sampling=SamplingParams(), generator=g, constraint=GRAMMAR
        ).tokens

    alone = [run(s) for s in range(4)]
    together = [None] * 4
    threads = [
        threading.Thread(target=lambda i=i: together.__setitem__(i, run(i))) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_bad_grammars_and_bad_constraints_are_refused_with_the_reason(tiny_model):
    for fields, _why in [
        ({}, "fields is empty"),
        ([("a", str), ("a", int)], "given twice"),
        ({"naïve": str}, "printable ASCII"),
        ({'a"b': str}, "printable ASCII"),
        ({"": str}, "non-empty str"),
        ({"a": float}, "must be str or int"),
        ([("a",)], "each field is a"),
    ]:
        with raises(BadValue, 'fields'):
            JsonObject(fields)
    with raises(BadType, 'fields'):
        JsonObject("name")
    # 19 digits overflow an int64
    for kw in [{"max_string": 0}, {"max_digits": 19}, {"max_digits": True}]:
        (arg,) = kw
        with raises(BadValue, arg):
            JsonObject({"a": str}, **kw)
    for options in [[], "yes", ["a", "a"], ["a", ""]]:
        with raises(BadValue, 'options'):
            Choice(options)  # the message names the option(s)
    state = GRAMMAR.state_after('{"name": "a')
    with raises(BadValue, 'token'):
        GRAMMAR.advance(state, ord("\\"))
    with raises(BadValue, 'token'):
        GRAMMAR.advance(GRAMMAR.state_after('{"name": "", "size": 0, "tag": ""}'), EOS_ID)
    with raises(BadType, 'token'):
        GRAMMAR.advance(state, "a")
    with raises(BadValue, 'tokens'):
        GRAMMAR.state_after('{"name": x')
    with raises(BadType, 'constraint'):
        generate(tiny_model, "x", 5, constraint="json")
    with raises(BadValue, 'eos_id'):
        generate(tiny_model, "x", 5, constraint=GRAMMAR, eos_id=None)
    with raises(BadValue, 'eos_id'):
        sample_batch(tiny_model, ["ab"], 5, constraint=GRAMMAR, eos_id=None)
    with raises(BadValue, 'constraint'):
        generate(tiny_model, "x", 5, constraint=PrefixFunction(lambda p: set()))
    with raises(BadValue, 'constraint'):
        generate(
            tiny_model,
            "x",
            5,
            constraint=PrefixFunction(lambda p: set() if len(p) == 2 else {ord("a")}),
        )
    with raises(BadValue, 'fn'):
        generate(tiny_model, "x", 5, constraint=PrefixFunction(lambda p: {300}))
    with raises(BadType, 'fn'):
        generate(tiny_model, "x", 5, constraint=PrefixFunction(lambda p: "abc"))
    with raises(BadType, 'fn'):
        PrefixFunction("abc")

    class WrongShape(Choice):
        def allowed(self, state):
            return torch.ones(10, dtype=torch.bool)

    with raises(BadValue, 'constraint'):
        generate(tiny_model, "x", 5, constraint=WrongShape(["a"]))
    # beam search and speculative decoding take no constraint
    with pytest.raises(TypeError, match="constraint"):
        beam_search(tiny_model, "x", 5, num_beams=2, constraint=GRAMMAR)

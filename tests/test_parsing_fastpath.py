"""The token-id fast path of request parsing (``kvplug/_token_json.pyx`` + ``parse_token_prompt``)
against the general path: on any body it accepts, the same request; on anything else, it steps
aside (None) and the general path decides - its error included."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug._token_json import parse_token_ids, read_common_completion
from kvplug.frontend.errors import ApiError
from kvplug.frontend.parsing import (
    COMPLETIONS,
    MAX_JSON_DEPTH,
    parse_request,
    parse_request_general,
    parse_token_prompt,
    parse_token_prompt_decoded,
)

U32 = 2**32


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"[1, 2 ,3]", [1, 2, 3]),
        (b" \t[\n0\r] ", [0]),
        (b"[4294967295]", [U32 - 1]),
        (b"[" + b",".join(b"7" for _ in range(1000)) + b"]", [7] * 1000),
    ],
)
def test_plain_token_arrays_are_read(raw, expected):
    ids = parse_token_ids(raw)
    assert ids is not None and ids.dtype == np.uint32 and ids.tolist() == expected


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b"[4294967296]",  # past u32
        b"[99999999999999999999999]",
        b"[-1]",
        b"[1.0]",
        b"[1e3]",
        b"[01]",
        b"[1,]",
        b"[,1]",
        b'["1"]',
        b"[[1]]",
        b"[true]",
        b"[null]",
        b"[1] x",
        b"[1",
        b"1",
        b"",
        b"{}",
    ],
)
def test_anything_else_steps_aside(raw):
    assert parse_token_ids(raw) is None


def _general(raw: bytes):
    try:
        return parse_request_general(raw, COMPLETIONS)
    except ApiError as exc:
        return exc


def _same_request(fast, general) -> None:
    assert not isinstance(general, ApiError), general.message
    assert isinstance(fast.prompt_ids, np.ndarray)
    assert fast.prompt_ids.tolist() == list(general.prompt_ids)
    for name in ("path", "raw", "model", "stream", "cache_salt", "prompt_text", "batch_size"):
        assert getattr(fast, name) == getattr(general, name), name
    assert fast.prompts is None and general.prompts is None
    assert fast.nvext is None and general.nvext is None
    assert fast.decoded is None  # not decoded unless asked for
    assert fast.body == general.body


def test_the_common_body_takes_the_fast_path():
    raw = json.dumps(
        {"model": "m", "prompt": [5, 6, 7], "stream": True, "max_tokens": 8, "cache_salt": "s"}
    ).encode()
    fast = parse_request(raw, COMPLETIONS)
    assert isinstance(fast.prompt_ids, np.ndarray)  # not the general path's list
    _same_request(fast, _general(raw))
    assert fast.body["max_tokens"] == 8


token = st.one_of(
    st.integers(0, U32 - 1),
    st.integers(0, 300),
    st.sampled_from([-1, U32, U32 + 5, 2**70]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
prompt = st.one_of(
    st.lists(st.integers(0, U32 - 1), max_size=40),
    st.lists(token, max_size=8),
    st.text(max_size=10),
    st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3),
    st.none(),
    st.integers(),
)
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.floats())
field_values = {
    "model": st.one_of(st.text(max_size=6), scalar),
    "prompt": prompt,
    "stream": scalar,
    "nvext": st.one_of(st.none(), st.just({}), st.just({"token_data": [1, 2]}), scalar),
    "cache_salt": scalar,
    "max_tokens": scalar,
    "extra": st.recursive(scalar, lambda kids: st.lists(kids, max_size=3), max_leaves=6),
}


@st.composite
def bodies(draw) -> bytes:
    """JSON object text: any subset of the fields, repeated keys, odd whitespace, sometimes cut."""
    names = draw(st.lists(st.sampled_from(sorted(field_values)), max_size=6))
    parts = [(n, draw(field_values[n])) for n in names]
    if draw(st.booleans()):  # most of these take the fast path, unless a later key undoes it
        ids = draw(st.lists(st.integers(0, U32 - 1), min_size=1, max_size=40))
        parts[:0] = [("model", draw(st.text(min_size=1, max_size=6))), ("prompt", ids)]
        parts = draw(st.permutations(parts))
    sep = draw(st.sampled_from([",", ", ", " ,\n"]))
    colon = draw(st.sampled_from([":", ": ", " :\t"]))
    parts = [f"{json.dumps(n)}{colon}{json.dumps(v)}" for n, v in parts]
    text = "{" + sep.join(parts) + "}"
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_fast_path_agrees_with_the_general_path(raw):
    fast = parse_token_prompt(raw)
    general = _general(raw)
    if fast is not None:
        _same_request(fast, general)
    # whichever path served it, parse_request answers as the general path does
    try:
        got = parse_request(raw, COMPLETIONS)
    except ApiError as exc:
        assert isinstance(general, ApiError) and exc.message == general.message
    else:
        assert not isinstance(general, ApiError)
        assert list(got.prompt_ids if got.prompt_ids is not None else []) == list(
            general.prompt_ids if general.prompt_ids is not None else []
        )
        assert got.body == general.body


def test_deep_bodies_are_left_to_the_general_path():
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    raw = ('{"model": "m", "prompt": [1, 2], "extra": ' + deep + "}").encode()
    assert parse_token_prompt(raw) is None
    assert isinstance(_general(raw), ApiError)


# "{", the prompt's "[" and extra_lists + 1 more: exactly MAX_JSON_DEPTH, then one over
@pytest.mark.parametrize("extra_lists", [MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH - 2])
def test_the_bracket_bound_holds_with_a_long_prompt(extra_lists):
    """The fast path skips counting brackets only when the bytes besides the prompt cannot hold
    more than MAX_JSON_DEPTH of them; a long prompt with many (shallow) lists beside it is
    still counted: at most MAX_JSON_DEPTH brackets in all ("{" + the prompt's "[" + these)
    stay on the fast path, one more goes to the general path."""
    shallow = "[" + ",".join(["[]"] * extra_lists) + "]"  # extra_lists + 1 brackets, depth 2
    ids = list(range(2000))
    raw = json.dumps({"model": "m", "prompt": ids}).encode()[:-1] + b', "x": ' + shallow.encode()
    raw += b"}"
    total = raw.count(b"[") + raw.count(b"{")
    assert total == extra_lists + 3
    fast = parse_token_prompt(raw)
    if total > MAX_JSON_DEPTH:
        assert fast is None
    else:
        assert fast is not None and list(fast.prompt_ids) == ids
    assert list(parse_request(raw, COMPLETIONS).prompt_ids) == ids  # either way, same answer


# -- the one-pass reader of the common body (read_common_completion) --------------------------


def _same_as_decoded(raw: bytes) -> None:
    """What the one-pass reader accepts, the msgspec path accepts with the same fields."""
    common = read_common_completion(raw)
    if common is None:
        return
    model, ids, stream, salt = common
    decoded = parse_token_prompt_decoded(raw)
    assert decoded is not None, raw
    assert ids.dtype == np.uint32 and ids.flags.c_contiguous and ids.flags.owndata
    assert (model, ids.tolist(), stream, salt) == (
        decoded.model,
        decoded.prompt_ids.tolist(),
        decoded.stream,
        decoded.cache_salt,
    )
    assert parse_token_prompt(raw).prompt_ids.tolist() == ids.tolist()


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            b'{"model": "m", "prompt": [1, 2], "stream": false, "max_tokens": 8}',
            ("m", [1, 2], False, None),
        ),
        (
            b' \n{"prompt":[4294967295],"model":"a b","stream":true,"cache_salt":"s"}\t',
            ("a b", [U32 - 1], True, "s"),
        ),
        (
            b'{"model":"m","prompt":[0],"stream":null,"nvext":null,"cache_salt":7,'
            b'"temperature":-0.5e-3,"top_p":1E+2,"n":0,"echo":false,"user":"","x":null}',
            ("m", [0], False, None),
        ),
        (b'{"model":"m","prompt":[3],"cache_salt":"s","x":true}', ("m", [3], False, "s")),
    ],
)
def test_the_common_body_is_read_in_one_pass(raw, expected):
    model, ids, stream, salt = read_common_completion(raw)
    assert (model, ids.tolist(), stream, salt) == expected
    _same_as_decoded(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": [1], "model": "n"}',  # a repeated key: msgspec decides
        b'{"model": "m", "prompt": [1], "prompt": [2]}',
        b'{"model": "m", "prompt": [1], "stream": true, "stream": false}',
        b'{"model": "m\\u00e9", "prompt": [1]}',  # an escape
        '{"model": "\u00e9", "prompt": [1]}'.encode(),  # non-ASCII
        b'{"model": "m\tx", "prompt": [1]}',  # a control byte in a string
        b'{"model": "", "prompt": [1]}',
        b'{"model": 5, "prompt": [1]}',
        b'{"model": "m"}',
        b'{"prompt": [1]}',
        b"{}",
        b'{"model": "m", "prompt": "text"}',
        b'{"model": "m", "prompt": []}',
        b'{"model": "m", "prompt": [1], "stream": "yes"}',
        b'{"model": "m", "prompt": [1], "stream": 1}',
        b'{"model": "m", "prompt": [1], "nvext": {}}',
        b'{"model": "m", "prompt": [1], "nvext": false}',
        b'{"model": "m", "prompt": [1], "stop": ["x"]}',  # nested: left to msgspec
        b'{"model": "m", "prompt": [1], "max_tokens": 1234567890123456}',  # 16 digits
        b'{"model": "m", "prompt": [1], "t": 1e100}',  # 3 exponent digits
        b'{"model": "m", "prompt": [1], "t": 01}',
        b'{"model": "m", "prompt": [1], "t": 1.}',
        b'{"model": "m", "prompt": [1], "t": .5}',
        b'{"model": "m", "prompt": [1], "t": -}',
        b'{"model": "m", "prompt": [1], "t": tru}',
        b'{"model": "m", "prompt": [1], "t": NaN}',
        b'{"model": "m", "prompt": [1],}',
        b'{"model": "m", "prompt": [1]} x',
        b'{"model": "m", "prompt": [1]',
        b'{"model": "m", "prompt": [1] "x": 1}',
        b'{"model" "m", "prompt": [1]}',
        b'{model: "m", "prompt": [1]}',
        b'[{"model": "m", "prompt": [1]}]',
        b"",
    ],
)
def test_other_bodies_are_left_to_msgspec(raw):
    assert read_common_completion(raw) is None
    _same_as_decoded(raw)


def test_only_bytes_are_read_in_one_pass():
    raw = b'{"model": "m", "prompt": [1]}'
    assert read_common_completion(raw) is not None
    for other in (bytearray(raw), memoryview(raw), raw.decode(), None):
        assert read_common_completion(other) is None


def test_a_long_prompt_is_read_whole_again_and_again():
    """The reader's scratch buffer grows for a long prompt and is let go after a huge one;
    every array is the ids' own."""
    for size in (1, 5000, 300_000, 3):
        ids = [(i * 7919) % U32 for i in range(size)]
        raw = json.dumps({"model": "m", "prompt": ids}).encode()
        model, got, _, _ = read_common_completion(raw)
        assert got.tolist() == ids and got.flags.owndata
        assert parse_token_ids(json.dumps(ids).encode()).tolist() == ids


ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=6)
flat_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**18), 10**18),
    st.floats(allow_nan=False, allow_infinity=False),
    ascii_text,
)


@st.composite
def flat_bodies(draw) -> bytes:
    """Flat objects near the common shape: ASCII strings (some with escapes), numbers of any
    size, the five fields with right and wrong values, repeated keys, odd whitespace."""
    keys = ["model", "prompt", "stream", "nvext", "cache_salt", "max_tokens", "x"]
    names = draw(st.lists(st.sampled_from(keys), max_size=7))
    parts = []
    for name in names:
        if name == "prompt":
            value = draw(
                st.one_of(
                    st.lists(st.integers(0, U32 - 1), min_size=1, max_size=30),
                    st.lists(st.integers(-2, U32 + 2), max_size=5),
                    ascii_text,
                )
            )
        else:
            value = draw(flat_value)
        parts.append((name, value))
    if draw(st.booleans()):
        parts[:0] = [
            ("model", draw(ascii_text.filter(bool))),
            ("prompt", draw(st.lists(st.integers(0, U32 - 1), min_size=1, max_size=30))),
        ]
        parts = draw(st.permutations(parts))
    space = draw(st.sampled_from(["", " ", "\n\t ", "\r"]))
    text = (
        "{"
        + space
        + ("," + space).join(f"{json.dumps(n)}{space}:{space}{json.dumps(v)}" for n, v in parts)
        + space
        + "}"
    )
    return text.encode()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(flat_bodies(), bodies()))
def test_one_pass_reader_agrees_with_msgspec(raw):
    _same_as_decoded(raw)
    # and the whole fast path still agrees with the general path
    fast = parse_token_prompt(raw)
    if fast is not None:
        _same_request(fast, _general(raw))


def test_one_pass_reader_takes_generated_common_bodies():
    """The shapes clients send (json.dumps of model, token ids and flat options) are read in
    one pass, not left to msgspec (a check the agreement test alone would not make)."""
    for options in ({}, {"stream": True, "max_tokens": 8}, {"temperature": 0.7, "seed": 3}):
        raw = json.dumps({"model": "stub-model", "prompt": [1, 22, 333], **options}).encode()
        assert read_common_completion(raw) is not None


def test_one_pass_reader_on_mutated_bodies():
    """Seeded byte mutations of common bodies (deletions, insertions and replacements with
    JSON's own characters, escapes and non-ASCII bytes): whatever the reader accepts, msgspec
    and the general path read the same."""
    import random

    rng = random.Random(12)
    base = [
        json.dumps(
            {
                "model": "m",
                "prompt": [rng.randrange(U32) for _ in range(rng.randrange(1, 20))],
                "stream": rng.choice([True, False, None]),
                "max_tokens": 8,
                "temperature": 0.5,
                "cache_salt": "s",
            }
        ).encode()
        for _ in range(20)
    ]
    alphabet = b'{}[]",:0123456789-+.eE truefalsn\\\t\n\xc3\xa9x'
    accepted = 0
    for _ in range(60_000):
        raw = bytearray(rng.choice(base))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(raw) + 1)
            op = rng.randrange(3)
            if op == 0 and at < len(raw):
                del raw[at]
            elif op == 1:
                raw[at:at] = bytes([rng.choice(alphabet)])
            elif at < len(raw):
                raw[at] = rng.choice(alphabet)
        body = bytes(raw)
        if read_common_completion(body) is None:
            continue
        accepted += 1
        _same_as_decoded(body)
        general = _general(body)
        assert not isinstance(general, ApiError), (body, general.message)
        assert list(general.prompt_ids) == parse_token_prompt(body).prompt_ids.tolist()
    assert accepted > 5000  # the mutations left many bodies the reader takes

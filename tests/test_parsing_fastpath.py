"""The token-id fast path of request parsing (``kvplug/_token_json.pyx`` + ``parse_token_prompt``)
against the general path: on any body it accepts, the same request; on anything else, it steps
aside (None) and the general path decides - its error included."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug._token_json import parse_token_ids
from kvplug.frontend.errors import ApiError
from kvplug.frontend.parsing import (
    COMPLETIONS,
    MAX_JSON_DEPTH,
    parse_request,
    parse_request_general,
    parse_token_prompt,
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

"""Properties of the code that reads what a client or an admin sends: whatever the input, the
only failure is the documented one (``ApiError`` with a 4xx, or ``ConfigError``) - never an
exception that would become a 500."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.errors import ApiError
from kvplug.frontend.hints import ClientHints, check_hint_targets
from kvplug.frontend.parsing import CHAT, COMPLETIONS, MAX_JSON_DEPTH, decode_json, parse_request

pytestmark = pytest.mark.timeout(120)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = ["model", "prompt", "messages", "stream", "nvext", "max_tokens", "cache_salt"]
NVEXT = ["backend_instance_id", "decode_worker_id", "prefill_worker_id", "dp_rank",
         "allowed_worker_ids", "labels", "agent_hints", "token_data"]  # fmt: skip
HEADERS = ["x-kvplug-worker", "x-worker-instance-id", "x-kvplug-prefill-worker",
           "x-kvplug-dp-rank", "x-dynamo-dp-rank", "x-kvplug-allowed-workers"]  # fmt: skip
bodies = st.fixed_dictionaries(
    {}, optional={**{k: json_values for k in FIELDS}, "model": st.just("m") | json_values}
)
nvexts = st.dictionaries(st.sampled_from(NVEXT), json_values, max_size=4)
headers = st.dictionaries(st.sampled_from(HEADERS), st.text(max_size=12), max_size=3)


def _4xx(exc: ApiError) -> None:
    assert 400 <= exc.status < 500 and exc.body()["error"]["message"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_parse_or_give_a_4xx(raw):
    for path in (COMPLETIONS, CHAT):
        try:
            parse_request(raw, path)
        except ApiError as exc:
            _4xx(exc)


@settings(max_examples=200, deadline=None)
@given(bodies, st.booleans())
def test_any_json_body_parses_or_gives_a_4xx(body, chat):
    try:
        req = parse_request(json.dumps(body).encode(), CHAT if chat else COMPLETIONS)
    except ApiError as exc:
        _4xx(exc)
        return
    assert isinstance(req.model, str) and req.model
    assert b"nvext" not in req.raw or "nvext" not in body  # nvext never reaches the engine


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.sampled_from("[{"))
def test_nesting_over_the_limit_is_refused_at_any_depth(depth, bracket):
    if bracket == "[":
        raw = "[" * depth + "]" * depth
    else:
        raw = '{"k": ' * (depth - 1) + "{}" + "}" * (depth - 1)
    try:
        decode_json(raw.encode())
    except ApiError as exc:
        assert depth > MAX_JSON_DEPTH, (depth, exc.message)
        assert exc.code == "json_too_deep"
    else:
        assert depth <= MAX_JSON_DEPTH


class _Entry:
    def __init__(self, start: int, size: int) -> None:
        self.worker = type("W", (), {"dp_ranks": range(start, start + size)})()


@settings(max_examples=200, deadline=None)
@given(nvexts, headers, st.sampled_from(["ignore", "trust", "reject"]))
def test_any_hints_are_read_or_give_a_4xx(nvext, hdrs, policy):
    workers = {"a": _Entry(0, 1), "b": _Entry(0, 4)}
    try:
        hints = ClientHints(policy).read(nvext, hdrs)
        check_hint_targets(hints, workers)
    except ApiError as exc:
        _4xx(exc)
        return
    if policy != "trust":  # nothing steering survives
        assert hints.worker_id is None and hints.allowed_worker_ids is None
        assert hints.dp_rank is None and not hints.labels
    if hints.dp_rank is not None:
        assert any(hints.dp_rank in e.worker.dp_ranks for e in workers.values())


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "id",
                "url",
                "engine",
                "role",
                "labels",
                "taints",
                "dp_start",
                "dp_size",
                "device",
                "models",
                "options",
                "metrics_url",
                "kv_capacity_blocks",
            ]
        ),
        json_values | st.text(max_size=40).map(lambda t: "http://" + t),
        max_size=6,
    )  # fmt: skip
)
def test_any_worker_entry_is_a_spec_or_a_config_error(entry):
    try:
        spec = spec_from_mapping(entry, "fuzz")
    except ConfigError:
        return
    assert 1 <= spec.dp_size <= 1024 and spec.url.startswith(("http://", "https://"))
    assert spec.metrics_url is None or spec.metrics_url.startswith(("http://", "https://"))

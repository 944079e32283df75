"""SGLang PD transform: bootstrap_host/port/room exactly as SGLang's PD router sends them."""

from __future__ import annotations

import json
import random

import pytest
from kvplug.integrations.sglang.adapter import SglangAdapter, bootstrap_room

from kvplug.adapters import PDContext, PDStyle, create_adapter
from kvplug.errors import ConfigError
from kvplug.workers import Role, Worker

BODY = {
    "model": "qwen",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 32,
    "nvext": {"agent_hints": {"osl": 32}},
}


def _ctx(options=None, *, dp_size=1, dp_rank=0, url="http://10.1.2.3:30000"):
    p = Worker("p0", url=url, engine="sglang", role=Role.PREFILL, dp_size=dp_size)
    d = Worker("d0", url="http://10.1.2.4:30000", engine="sglang", role=Role.DECODE)
    return PDContext(
        request_id="r",
        path="/v1/chat/completions",
        prefill_worker=p,
        prefill_dp_rank=dp_rank,
        prefill_options=options or {},
        decode_worker=d,
        decode_options={},
    )


def test_same_bootstrap_fields_on_both_hops():
    adapter = create_adapter("sglang")
    assert isinstance(adapter, SglangAdapter) and adapter.pd_style is PDStyle.CONCURRENT
    adapter.rng = random.Random(1)
    ctx = _ctx()
    before = json.dumps(BODY, sort_keys=True)
    p = adapter.prefill_request(BODY, ctx)
    d = adapter.decode_request(BODY, None, ctx)
    assert p == d  # SGLang: the same body to P and D
    room = p["bootstrap_room"]
    assert p == {
        "model": "qwen",
        "messages": BODY["messages"],
        "stream": True,
        "max_tokens": 32,
        "bootstrap_host": "10.1.2.3",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }
    assert isinstance(room, int) and 0 <= room < 2**63
    assert json.dumps(BODY, sort_keys=True) == before
    # a new request gets a new room
    assert adapter.prefill_request(BODY, _ctx())["bootstrap_room"] != room


def test_bootstrap_port_option_and_none():
    adapter = SglangAdapter(rng=random.Random(2))
    assert adapter.prefill_request(BODY, _ctx({"bootstrap_port": 9001}))["bootstrap_port"] == 9001
    body = adapter.prefill_request(BODY, _ctx({"bootstrap_port": None}))
    assert body["bootstrap_port"] is None and "bootstrap_port" in body
    with pytest.raises(ConfigError):
        adapter.prefill_request(BODY, _ctx({"bootstrap_port": "8998"}))


def test_ipv6_prefill_host_is_bare():
    adapter = SglangAdapter(rng=random.Random(3))
    body = adapter.prefill_request(BODY, _ctx(url="http://[fd00::5]:30000"))
    assert body["bootstrap_host"] == "fd00::5"


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_room_steers_the_prefill_dp_rank(rank):
    # SGLang's prefill with --load-balance-method auto serves room % dp_size
    rng = random.Random(rank)
    for _ in range(200):
        room = bootstrap_room(rng, rank, 4)
        assert room % 4 == rank and 0 <= room < 2**63
    adapter = SglangAdapter(rng=random.Random(9))
    body = adapter.prefill_request(BODY, _ctx(dp_size=4, dp_rank=rank))
    assert body["bootstrap_room"] % 4 == rank and "routed_dp_rank" not in body


def test_dp_aware_option_sends_routed_dp_rank_per_hop():
    adapter = SglangAdapter(rng=random.Random(4))
    ctx = _ctx({"dp_aware": True}, dp_size=2, dp_rank=1)
    ctx.decode_options = {"dp_aware": True}
    ctx.decode_dp_rank = 0
    p = adapter.prefill_request(BODY, ctx)
    assert p["routed_dp_rank"] == 1 == p["bootstrap_room"] % 2  # never contradicts the room
    d = adapter.decode_request(BODY, None, ctx)
    assert d["routed_dp_rank"] == 0 and d["disagg_prefill_dp_rank"] == 1
    assert "disagg_prefill_dp_rank" not in p

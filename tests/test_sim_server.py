"""The simulator's server face: OpenAI HTTP, vLLM metrics, and KV events that the vLLM
integration's decoder (and replay client) read back as the blocks of the prompt we sent."""

import asyncio
import json
import socket
import time

import aiohttp
import pytest
import zmq
from kvplug.integrations.vllm.wire import (
    BatchDecoder,
    parse_replay_reply,
    replay_request,
    split_frames,
)
from vllm_helpers import wait_sub_hears

from kvplug.events import BlockStored
from kvplug.sim.server import FleetOptions, render_chat, start_fleet, tokenize_text


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _one_engine(**options) -> tuple[FleetOptions, int, int, int]:
    """Options for one fast simulated engine of 16-token blocks on free ports (over: options)."""
    http, ev, rp = _free_ports(3)
    opts = FleetOptions(
        engines=1,
        base_port=http,
        events_base_port=ev,
        replay_base_port=rp,
        **{"block_size": 16, "speed": 20.0, **options},
    )
    return opts, http, ev, rp


@pytest.fixture
async def fleet():
    opts, http, ev, rp = _one_engine(capacity_blocks=256, topic="kv")
    servers = await start_fleet(opts)
    yield servers[0], http, ev, rp
    for s in servers:
        await s.stop()


async def _recv_batches(sub, n_blocks_min, timeout=20.0):
    """Receive until the BlockStored events cover at least n_blocks_min blocks."""
    dec = BatchDecoder("sim-0", block_size=16)
    events, seqs = [], []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if sub.poll(0):
            topic, seq, payload, _ = split_frames(sub.recv_multipart())
            assert topic == b"kv"
            seqs.append(seq)
            batch = dec.decode(payload)
            assert batch is not None and batch.dropped == 0
            events.extend(batch.events)
            stored = sum(len(e.engine_hashes) for e in events if isinstance(e, BlockStored))
            if stored >= n_blocks_min:
                return events, seqs, dec
        else:
            await asyncio.sleep(0.01)
    raise AssertionError(f"timed out; got {len(events)} events")


async def test_completion_events_decode_with_the_vllm_decoder(fleet):
    server, http, ev, rp = fleet
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{ev}")
    wait_sub_hears(sub, server.publisher)  # PUB/SUB join
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # 135 bytes = 8 full blocks
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://127.0.0.1:{http}/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 5},
        ) as r:
            assert r.status == 200
            body = await r.json()
    assert body["usage"] == {
        "prompt_tokens": 135,
        "completion_tokens": 5,
        "total_tokens": 140,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(body["choices"][0]["text"].split()) == 5
    events, seqs, dec = await _recv_batches(sub, 8)
    tokens = tokenize_text(prompt)
    stored = [e for e in events if isinstance(e, BlockStored)]
    got = [t for e in stored for t in e.token_ids]
    assert got[: 8 * 16] == tokens[: 8 * 16]  # the prompt's full blocks, in chain order
    assert stored[0].parent_engine_hash is None and stored[0].block_size == 16
    assert seqs[0] == 0 and seqs == list(range(len(seqs)))
    assert dec.stats.batches == len(seqs)

    # replay: a DEALER asking from seq 0 gets the same batches back, then the end marker
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{rp}")
    dealer.send_multipart(replay_request(0))
    replayed = []
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while loop.time() < end:
        if dealer.poll(0):
            item = parse_replay_reply(dealer.recv_multipart())
            if item is None:
                break
            replayed.append(item.seq)
        else:
            await asyncio.sleep(0.01)
    assert replayed[: len(seqs)] == seqs
    dealer.close(0)
    sub.close(0)

    # the same prompt again hits the cache (all but the last token's block)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://127.0.0.1:{http}/v1/completions", json={"prompt": prompt, "max_tokens": 2}
        ) as r:
            again = await r.json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * 16
        async with s.get(f"http://127.0.0.1:{http}/metrics") as r:
            text = await r.text()
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert "vllm:prefix_cache_hits_total" in text and "vllm:num_requests_running" in text


async def test_chat_streaming_and_tokenize_agree(fleet):
    server, http, _, _ = fleet
    messages = [{"role": "user", "content": "hello there"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{http}/tokenize", json={"messages": messages}) as r:
            tok = await r.json()
        assert tok["tokens"] == tokenize_text(render_chat(messages))
        async with s.post(
            f"http://127.0.0.1:{http}/v1/chat/completions",
            json={
                "messages": messages,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            assert r.status == 200
            raw = (await r.read()).decode()
    chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    pieces = [c["choices"][0]["delta"].get("content") for c in parsed if c["choices"][0]["delta"]]
    assert len(pieces) == 4 and parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["usage"]["completion_tokens"] == 4


async def test_bad_requests_are_400_not_crashes(fleet):
    server, http, _, _ = fleet
    async with aiohttp.ClientSession() as s:
        for body in (
            b"not json",
            b"[1,2]",
            json.dumps({"prompt": 5}).encode(),
            json.dumps({"prompt": "x", "max_tokens": 0}).encode(),
            json.dumps({"prompt": [-1, 3]}).encode(),
        ):
            async with s.post(f"http://127.0.0.1:{http}/v1/completions", data=body) as r:
                assert r.status == 400, body
        # a prompt larger than the whole KV cache (256 blocks x 16) is refused, not queued forever
        async with s.post(
            f"http://127.0.0.1:{http}/v1/completions", json={"prompt": [1] * 5000, "max_tokens": 1}
        ) as r:
            assert r.status == 400
        async with s.get(f"http://127.0.0.1:{http}/health") as r:
            assert r.status == 200
    assert server.counters["bad_requests"] == 6


@pytest.mark.parametrize("host_offload", ["evicted", "stored"])
async def test_host_tier_events_keep_a_vllm_fed_index_in_sync(host_offload):
    """Offloads and reloads go on the wire as vLLM offloading connectors send them (token-less
    stores on the new medium, removals on the old; an inclusive host's copies as token-less
    stores on the host); decoded and applied in order they must leave an index holding exactly
    what the engine holds."""
    from kvplug.index import KvIndex

    opts, http, ev, _rp = _one_engine(
        capacity_blocks=24, host_blocks=40, speed=50.0, host_offload=host_offload
    )
    (server,) = await start_fleet(opts)
    try:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{ev}")
        wait_sub_hears(sub, server.publisher)  # PUB/SUB join
        prompts = [f"prompt number {i} " * 12 for i in range(3)]  # ~200 bytes = 12-13 blocks
        async with aiohttp.ClientSession() as s:
            for p in prompts + prompts[:1]:  # the last one reloads from the host tier
                async with s.post(
                    f"http://127.0.0.1:{http}/v1/completions", json={"prompt": p, "max_tokens": 2}
                ) as r:
                    assert r.status == 200
                    last = await r.json()
        assert server.engine.cache.counters["reloaded"] > 0
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        dec = BatchDecoder("sim-0", block_size=16)
        ix = KvIndex(16)
        ix.add_endpoint("sim-0")
        cache = server.engine.cache
        deadline = time.monotonic() + 10
        while True:  # until the events in flight have arrived (or the deadline)
            while sub.poll(0):
                _, _, payload, _ = split_frames(sub.recv_multipart())
                batch = dec.decode(payload)
                assert batch is not None and batch.dropped == 0
                for e in batch.events:
                    ix.apply(e)
            # one entry per block held in either tier or both
            held = len(set(cache.device_blocks()) | set(cache.host_blocks()))
            if ix.stats()["entries"] == held or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        sub.close(0)
        st = ix.stats()
        for key in (
            "unknown_moves",
            "unknown_removes",
            "orphan_stores",
            "conflicting_stores",
            "unresolved_tier_copies",
            "dropped_events",
        ):
            assert st[key] == 0, (key, st)
        assert st["entries"] == held
    finally:
        await server.stop()


async def test_client_disconnect_aborts_the_request(fleet):
    server, http, _, _ = fleet
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            f"http://127.0.0.1:{http}/v1/completions",
            json={"prompt": "tell me a long story", "max_tokens": 3000, "stream": True},
        )
        assert r.status == 200
        await r.content.readline()  # the first chunk arrives, then the client hangs up
        r.close()
    deadline = time.monotonic() + 15
    while server.engine.has_work() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not server.engine.has_work() and server.counters["aborted"] == 1
    assert not server.streams


async def test_an_engine_failure_ends_requests_instead_of_hanging_them(fleet):
    server, http, _, _ = fleet
    real_step = server.engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated model bug")
        return real_step()

    server.engine.step = failing_step
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "hello", "max_tokens": 3}
        ) as r:
            assert r.status == 200
            body = await asyncio.wait_for(r.json(), 20)
        assert body["usage"]["completion_tokens"] == 0
        assert body["choices"][0]["finish_reason"] == "abort"
        async with s.post(  # the engine keeps serving afterwards
            f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "hello", "max_tokens": 3}
        ) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 3
    assert server.counters["engine_errors"] == 1


def test_a_mixed_fleet_serves_each_engine_at_its_speed():
    """``kvplug sim --slowdowns 1,3``: every other engine steps with the model's times x3."""
    from kvplug.sim.steptime import REFERENCE

    opts = FleetOptions(engines=4, slowdowns=(1.0, 3.0))
    assert [opts.model_of(i) for i in range(4)] == [REFERENCE, REFERENCE.slowed(3.0)] * 2
    assert FleetOptions(engines=2).model_of(1) == REFERENCE


async def test_engines_allocating_as_vllm_preempt_and_count_it_as_vllm_does():
    """kvplug sim --kv-allocation vllm: two requests that outgrow a 16-block cache together;
    one is preempted and recomputed, both complete, and /metrics counts the preemption."""
    opts, http, _ev, _rp = _one_engine(capacity_blocks=16, kv_allocation="vllm")
    servers = await start_fleet(opts)
    url = f"http://127.0.0.1:{http}"
    try:
        async with aiohttp.ClientSession() as s:

            async def complete(prompt: str) -> dict:
                body = {"prompt": prompt, "max_tokens": 80}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.json()

            # 80 prompt tokens (5 blocks) + 80 generated: 10 blocks each, 16 in the cache
            done = await asyncio.gather(complete("a" * 80), complete("b" * 80))
            async with s.get(url + "/metrics") as r:
                text = await r.text()
    finally:
        for server in servers:
            await server.stop()
    assert [d["usage"]["completion_tokens"] for d in done] == [80, 80]
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:num_preemptions_total{")]
    assert float(line.split()[-1]) >= 1

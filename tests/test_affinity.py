"""The affinity policy: keeps a request on the engine holding its prefix where kv would move it
for a little queue, and still moves it when the queue there is long."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_router_helpers import FakeClock, make_router, store_prefix, tokens

from kvplug.affinity import AffinityParams, AffinityRouter, affinity_setting, parse_affinity
from kvplug.events import Tier
from kvplug.request import RouteRequest, RoutingHints

PARAMS = AffinityParams(guard=8.0, memory=0.25, cap=128.0)


def _queue(r, worker: str, n_blocks: int, tag: str) -> None:
    """A request pinned to ``worker`` whose prefill is still pending (no first token yet)."""
    r.route(
        RouteRequest(
            tag, tokens(n_blocks, start=90_000), hints=RoutingHints(pinned_worker_id=worker)
        )
    )


def _setup(queued_blocks: int):
    r = make_router(workers=("w1", "w2"))
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8)  # w1 holds 8 of the prompt's 10 blocks
    _queue(r, "w1", queued_blocks, "busy")
    return r, toks


def test_kv_moves_the_request_off_its_prefix_for_a_short_queue_affinity_keeps_it():
    r, toks = _setup(20)  # kv cost 44 vs 20; affinity: 15 blocks more work <= 8 x 8 saved
    assert r.preview(RouteRequest("x", toks)).worker_id == "w2"  # kv: the idle engine
    aff = AffinityRouter(r, PARAMS)
    d = aff.route(RouteRequest("x", toks))
    assert d.worker_id == "w1"
    assert d.overlap_blocks == 8  # booked on w1 with its cached prefix
    assert aff.affinity_counters["affinity"] == 1


def test_a_long_queue_on_the_prefix_engine_still_sends_the_request_elsewhere():
    r, toks = _setup(400)  # far beyond the cap: staying would cost ~400 blocks of waiting
    aff = AffinityRouter(r, PARAMS)
    assert aff.route(RouteRequest("x", toks)).worker_id == "w2"
    assert aff.affinity_counters["guarded"] == 1


def test_a_prefix_held_in_the_host_tier_counts_as_held():
    # w1 offloaded 8 of the prompt's 10 blocks to host memory; w2 holds 4 on its device. kv
    # prefers w2 (its device blocks also cut the decode term); affinity moves the request to
    # the longest prefix in the engine's own tiers, w1, where it recomputes 2 blocks, not 6.
    # Counting device blocks alone it saw w2 as the longest holder and kept kv's pick.
    r = make_router(workers=("w1", "w2"))
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8, tier=Tier.HOST)
    store_prefix(r, "w2", toks, 4)
    assert r.preview(RouteRequest("x", toks)).worker_id == "w2"
    aff = AffinityRouter(r, PARAMS)
    d = aff.route(RouteRequest("x", toks))
    assert d.worker_id == "w1"
    assert d.overlap_blocks == 8  # booked with its host-tier prefix as cached
    assert aff.affinity_counters["affinity"] == 1


def test_no_cached_prefix_means_kv_decides():
    r = make_router(workers=("w1", "w2"))
    _queue(r, "w1", 4, "busy")
    aff = AffinityRouter(r, PARAMS)
    assert aff.route(RouteRequest("x", tokens(10, start=5_000))).worker_id == "w2"
    assert aff.affinity_counters["kept_kv"] == 1


def test_pinned_requests_are_not_redirected():
    r, toks = _setup(0)
    aff = AffinityRouter(r, PARAMS)
    d = aff.route(RouteRequest("x", toks, hints=RoutingHints(pinned_worker_id="w2")))
    assert d.worker_id == "w2"


def test_bad_params_and_wrong_mode_are_refused():
    with pytest.raises(ValueError):
        AffinityParams(guard=-1)
    with pytest.raises(ValueError):
        AffinityParams(memory=-0.5)
    with pytest.raises(ValueError):
        AffinityRouter(make_router(router_mode="round-robin"))


def test_affinity_policy_parses_its_own_keys_and_router_keys():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("affinity:guard=4,credit=1.5")
    assert p.mode == "kv" and p.feed_events
    assert p.affinity == {"guard": 4} and p.overrides == {"router_kv_overlap_score_credit": 1.5}
    assert p.router_factory() is not None
    with pytest.raises(ValueError):
        parse_policy("affinity:gaurd=4")
    with pytest.raises(ValueError):
        parse_policy("affinity:guard=-1")


# ---- tail mode: the guard in seconds of predicted time to first token


def _tail(slack: float, tail: float = 0.99) -> AffinityParams:
    return AffinityParams(guard=8.0, memory=0.25, tail=tail, slack=slack)


def test_tail_mode_moves_a_request_whose_queue_costs_more_time_than_its_recompute():
    # w1's queue (20 blocks of someone's prefill) takes longer than recomputing the 8 cached
    # blocks on idle w2; the block cap (test above) keeps the request, the time guard moves it
    r, toks = _setup(20)
    aff = AffinityRouter(r, _tail(slack=0.0))
    assert aff.route(RouteRequest("x", toks)).worker_id == "w2"
    assert aff.affinity_counters["guarded"] == 1


def test_tail_mode_keeps_a_request_whose_extra_wait_is_within_the_slack():
    r, toks = _setup(20)  # the extra wait is milliseconds: well within 0.5 s
    aff = AffinityRouter(r, _tail(slack=0.5))
    assert aff.route(RouteRequest("x", toks)).worker_id == "w1"
    assert aff.affinity_counters["affinity"] == 1


@pytest.mark.parametrize("threshold, expect", [(0, "w2"), (32, "w1")])
def test_tail_mode_with_a_long_prefill_threshold_lets_a_follow_up_share_the_steps(
    threshold, expect
):
    """An engine run with vLLM's --long-prefill-token-threshold gives a newcomer its own share of
    every step beside a long prefill: waiting there costs the long prefill's share of the
    newcomer's few steps, not the whole of it, so the follow-up stays with its cached prefix."""
    from kvplug.workers import Worker

    workers = (
        Worker("w1", max_batched_tokens=512, long_prefill_token_threshold=threshold),
        Worker("w2", max_batched_tokens=512),
    )
    r = make_router(workers=workers)
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8)
    _queue(r, "w1", 400, "busy")  # a long cold prefill just started on the prefix's engine
    # the TTFT guard alone decides, as in the default (its block guard is 1000)
    aff = AffinityRouter(r, replace(_tail(slack=0.0), guard=1000.0))
    assert aff.route(RouteRequest("x", toks)).worker_id == expect
    assert r.long_prefill_tokens(0) == threshold


def test_tail_mode_stops_counting_a_prefill_once_its_first_token_came():
    r, toks = _setup(20)
    r.on_first_token("busy")  # w1's queue has drained
    aff = AffinityRouter(r, _tail(slack=0.0))
    assert aff.route(RouteRequest("x", toks)).worker_id == "w1"


def test_tail_mode_lets_a_request_wait_while_it_stays_below_kvs_tail():
    r, toks = _setup(20)
    aff = AffinityRouter(r, _tail(slack=0.0, tail=0.5))
    # earlier decisions whose kv pick was predicted at 2 s to first token: tau = 2 s, so a
    # wait of milliseconds keeps this request out of the tail and it stays with its cache
    # (20 samples: the median needs ten above it before it counts)
    aff._kv_ttft.extend([2.0] * 20)
    assert aff.route(RouteRequest("x", toks)).worker_id == "w1"


def test_chunked_prefill_seconds_sums_the_chunks_over_their_growing_context():
    from kvplug.affinity import chunked_prefill_seconds
    from kvplug.prefill_model import CalibratedPrefillModel

    model = CalibratedPrefillModel()
    # one pass when unchunked or the prompt fits one chunk: the shipped model as it is
    assert chunked_prefill_seconds(5000, 300, 0) == pytest.approx(model.predict(5000, 300))
    assert chunked_prefill_seconds(5000, 300, 8192) == pytest.approx(model.predict(5000, 300))
    # 20,000 new tokens in 8,192-token chunks: 8192 + 8192 + 3616, each over what precedes it
    want = sum(
        model.predict(n, 1000 + done) for n, done in ((8192, 0), (8192, 8192), (3616, 16384))
    )
    assert chunked_prefill_seconds(20000, 1000, 8192) == pytest.approx(want)
    assert chunked_prefill_seconds(0, 1000, 8192) == 0.0


def test_tail_keys_parse_and_bad_values_are_refused():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("affinity:tail=0.99,slack=1,window=500")
    assert p.affinity == {"tail": 0.99, "slack": 1, "window": 500}
    for bad in ("tail=1", "tail=-0.1", "slack=-1", "window=0"):
        with pytest.raises(ValueError):
            parse_policy(f"affinity:{bad}")


# ---- tail mode over every request (pool), the tail rescue and the spread of long cold prompts


def _decoding(r, worker: str, n_blocks: int, tag: str) -> None:
    """A request on ``worker`` past its first token: active KV, no queued prefill."""
    _queue(r, worker, n_blocks, tag)
    r.on_first_token(tag)


def test_pool_all_remembers_cold_requests_and_choice_does_not():
    # a cold request (no engine holds any of it) is no choice between holders: only the
    # "all" pool takes its predicted TTFT into tau
    for pool, remembered in (("choice", 0), ("all", 1), ("cold", 1)):
        r = make_router(workers=("w1", "w2"))
        aff = AffinityRouter(r, AffinityParams(tail=0.99, pool=pool))
        aff.route(RouteRequest("cold", tokens(10, start=5_000)))
        assert len(aff._kv_ttft) == remembered, pool


def test_pool_all_lets_a_request_wait_below_the_tail_of_every_request():
    # tau from long cold prompts' predicted TTFT (seconds): a follow-up may wait behind w1's
    # queue for its cache, where the choice pool (no history of choices) moves it
    r, toks = _setup(20)
    params = AffinityParams(tail=0.5, slack=0.0, pool="all")
    aff = AffinityRouter(r, params)
    aff._kv_ttft.extend([5.0] * 20)
    assert aff.route(RouteRequest("x", toks)).worker_id == "w1"
    r, toks = _setup(20)
    aff = AffinityRouter(r, replace(params, pool="choice"))
    assert aff.route(RouteRequest("x", toks)).worker_id == "w2"


def test_pool_all_has_no_tau_until_the_tail_has_ten_samples_above_it():
    # nine samples: the 0.5 quantile of a handful of predictions is no tail estimate yet, so
    # only the slack counts and the queue moves the request
    r, toks = _setup(20)
    aff = AffinityRouter(r, AffinityParams(tail=0.5, slack=0.0, pool="all"))
    aff._kv_ttft.extend([5.0] * 8)  # + this request's own prediction = 9 < 10 / (1 - 0.5)
    assert aff.route(RouteRequest("x", toks)).worker_id == "w2"


def test_warm_sets_how_many_samples_above_the_tail_tau_waits_for():
    # the same nine samples: with warm=1 a tail of 0.5 needs 2 of them, so tau (5 s) lets the
    # request wait behind w1's queue for its cache; warm=10 (the default) still moves it
    for warm, went in ((1.0, "w1"), (10.0, "w2")):
        r, toks = _setup(20)
        aff = AffinityRouter(r, AffinityParams(tail=0.5, slack=0.0, pool="all", warm=warm))
        aff._kv_ttft.extend([5.0] * 8)
        assert aff.route(RouteRequest("x", toks)).worker_id == went, warm
    with pytest.raises(ValueError, match="warm"):
        AffinityParams(warm=0)


def test_hold_share_keeps_requests_on_their_cache_while_the_fleet_is_saturated():
    # w1 holds the prefix behind a queue, w2 is idle: the TTFT guard moves the request to w2,
    # unless at least hold_share of the last HOLD_WINDOW requests were predicted at or above
    # tau at kv's pick (every engine has a queue the tail does not cover): then a move would
    # recompute the prefix where the fleet lacks the work, and the holder stands
    from kvplug.affinity import HOLD_WINDOW

    params = AffinityParams(tail=0.5, slack=0.0, pool="all", hold_share=0.5)
    for above, went in ((0, "w2"), (HOLD_WINDOW // 2 - 2, "w2"), (HOLD_WINDOW // 2 + 2, "w1")):
        r, toks = _setup(20)
        aff = AffinityRouter(r, params)
        aff._kv_ttft.extend([0.001] * 20)  # tau: 1 ms, below every prediction here
        for i in range(HOLD_WINDOW):  # earlier requests' predictions at kv's pick
            aff._note_saturation(1.0 if i < above else 0.0)
        assert aff.route(RouteRequest("x", toks)).worker_id == went, above
        assert aff.affinity_counters["held_saturated"] == int(went == "w1")
        assert aff.affinity_counters["saturated_spells"] == int(went == "w1")
    # the spell ends when the recent predictions fall below tau again
    for _ in range(HOLD_WINDOW):
        aff._note_saturation(0.0)
    assert not aff._saturated and aff.affinity_counters["saturated_ends"] == 1
    r, toks = _setup(20)
    aff = AffinityRouter(r, replace(params, hold_share=0.0))  # off: the queue moves it
    aff._kv_ttft.extend([0.001] * 20)
    assert aff.route(RouteRequest("x", toks)).worker_id == "w2"
    assert parse_affinity("affinity-fitted").hold_share == 0.1
    assert not parse_affinity("affinity-balance").hold_share
    for bad in ({"hold_share": 1.5}, {"hold_share": 0.1, "tail": 0.98, "pool": "choice"}):
        with pytest.raises(ValueError, match="hold_share"):
            AffinityParams(**bad)


def test_hold_inflight_counts_a_queued_turn_as_cached_on_its_engine_while_saturated():
    # a session's turn is routed to an engine and has not run: the engines' events show none of
    # its blocks, so its next turn looks cold and kv sends it to the other (idle) engine, where
    # it recomputes the history. While the fleet is saturated, hold_inflight counts the queued
    # turn's blocks as cached where it went (behind it, the next turn finds them computed)
    from kvplug.affinity import HOLD_WINDOW

    def route_next_turn(setting: str, saturated: bool):
        r = make_router(
            workers=("w1", "w2"),
            router_mode="affinity",
            router_affinity=f"affinity:tail=0.5,slack=0,pool=all,hold_share=0.5,{setting}",
        )
        aff = r._policy.affinity
        went = r.route(RouteRequest("turn1", tokens(10))).worker_id  # queued: no first token
        aff._kv_ttft.extend([0.001] * 20)  # tau: 1 ms, below every prediction here
        for _ in range(HOLD_WINDOW if saturated else 0):
            aff._note_saturation(1.0)
        assert aff._saturated == saturated
        d = r.route(RouteRequest("turn2", tokens(12)))
        return went, d, aff.affinity_counters

    went, d, counters = route_next_turn("hold_inflight=true", saturated=True)
    assert (d.worker_id, d.overlap_blocks) == (went, 10)  # booked with the 10 blocks as cached
    assert counters["inflight_held"] == 1
    for setting, saturated in (("hold_inflight=true", False), ("hold_inflight=false", True)):
        went, d, counters = route_next_turn(setting, saturated)
        assert (d.worker_id != went, d.overlap_blocks) == (True, 0), setting
        assert counters["inflight_held"] == 0
    assert parse_affinity("affinity-fitted").hold_inflight
    assert not parse_affinity("affinity-balance").hold_inflight
    with pytest.raises(ValueError, match="hold_inflight"):
        AffinityParams(tail=0.98, pool="all", hold_inflight=True)  # no hold to act in
    with pytest.raises(ValueError, match="hold_inflight"):  # the wrapper cannot change kv's scores
        AffinityRouter(make_router(), parse_affinity("affinity-fitted"))


def _rescue_setup():
    """kv picks w1 (20 queued prefill blocks cost less than w2's 60 decoding ones), where the
    prompt waits for someone's prefill; on w2 it starts at once."""
    r = make_router(workers=("w1", "w2"))
    _decoding(r, "w2", 60, "decoding")
    _queue(r, "w1", 20, "busy")
    req = RouteRequest("x", tokens(10, start=5_000))
    assert r.preview(req).worker_id == "w1"
    return r, req


def test_rescue_sends_a_request_predicted_in_the_tail_where_it_starts_soonest():
    r, req = _rescue_setup()
    # (16-token test blocks: w1's queue is ~9 ms of predicted prefill)
    aff = AffinityRouter(r, AffinityParams(tail=0.5, pool="all", rescue=0.001))
    aff._kv_ttft.extend([0.001] * 20)  # tau: 1 ms, the wait on w1 is far beyond
    assert aff.route(req).worker_id == "w2"
    assert aff.affinity_counters["rescued"] == 1


def test_rescue_leaves_a_request_below_the_tail_and_is_off_by_default():
    r, req = _rescue_setup()
    aff = AffinityRouter(r, AffinityParams(tail=0.5, pool="all", rescue=0.001))
    aff._kv_ttft.extend([60.0] * 20)  # tau: a minute, the wait on w1 is not in the tail
    assert aff.route(req).worker_id == "w1"
    r, req = _rescue_setup()
    aff = AffinityRouter(r, AffinityParams(tail=0.5, pool="all"))
    aff._kv_ttft.extend([0.001] * 20)
    assert aff.route(req).worker_id == "w1"


def test_rescue_idle_rescues_only_to_an_engine_with_no_prefill_queued():
    # near saturation a rescue to a busy engine adds its prefill where others wait, and more
    # requests land in the tail: rescue_idle (the default's) sends it only where it starts at
    # once. w2 only decodes: the rescue there stands
    params = AffinityParams(tail=0.5, pool="all", rescue=0.001, rescue_idle=True)
    r, req = _rescue_setup()
    aff = AffinityRouter(r, params)
    aff._kv_ttft.extend([0.001] * 20)
    assert aff.route(req).worker_id == "w2"
    # w2 with a shorter prefill queue than kv's pick: rescued there without rescue_idle, held
    # on kv's pick with it
    for idle, went in ((False, "w2"), (True, "w1")):
        r, req = _rescue_setup()
        _queue(r, "w2", 2, "short")
        assert r.preview(req).worker_id == "w1"
        aff = AffinityRouter(r, replace(params, rescue_idle=idle))
        aff._kv_ttft.extend([0.001] * 20)
        assert aff.route(req).worker_id == went, idle
        assert aff.affinity_counters["rescued"] == int(not idle)
        assert aff.affinity_counters["rescue_held"] == int(idle)
    assert parse_affinity("affinity-fitted").rescue_idle
    assert not parse_affinity("affinity-balance").rescue_idle


def _spread_setup():
    """w1 has just served a follow-up (a request on its cached prefix); w2 has more active KV,
    so kv sends a cold prompt to w1, where the session's next turn will queue behind it."""
    r = make_router(workers=("w1", "w2"))
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8)
    return r, toks


def test_spread_sends_a_long_cold_prompt_away_from_the_engine_with_recent_follow_ups():
    r, toks = _spread_setup()
    aff = AffinityRouter(r, AffinityParams(spread=0.001))
    assert aff.route(RouteRequest("turn", toks)).worker_id == "w1"  # a follow-up on w1
    r.on_first_token("turn")
    _decoding(r, "w2", 40, "decoding")
    cold = RouteRequest("cold", tokens(10, start=5_000))
    assert r.preview(cold).worker_id == "w1"  # kv: less active KV
    assert aff.route(cold).worker_id == "w2"
    assert aff.affinity_counters["spread"] == 1


def test_spread_keeps_kvs_pick_for_short_prompts_and_much_more_active_kv():
    for params in (
        AffinityParams(spread=1000.0),  # the prompt's prefill is far below 1,000 s
        AffinityParams(spread=0.001, spread_kv=10),  # w2 has 40 more active blocks than w1
    ):
        r, toks = _spread_setup()
        aff = AffinityRouter(r, params)
        aff.route(RouteRequest("turn", toks))
        r.on_first_token("turn")
        _decoding(r, "w2", 40, "decoding")
        assert aff.route(RouteRequest("cold", tokens(10, start=5_000))).worker_id == "w1"


def test_spread_and_rescue_keys_parse_and_bad_values_are_refused():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("affinity:tail=0.98,pool=all,rescue=0.1,spread=3,half_life=300,spread_kv=64")
    assert p.affinity == {
        "tail": 0.98,
        "pool": "all",
        "rescue": 0.1,
        "spread": 3,
        "half_life": 300,
        "spread_kv": 64,
    }
    for bad in ("pool=some", "rescue=-1", "spread=-1", "half_life=0", "spread_kv=-1"):
        with pytest.raises(ValueError):
            parse_policy(f"affinity:{bad}")


def test_affinity_rescue_is_the_measured_setting_and_takes_overrides():
    from kvplug.sim.policies import parse_policy

    long = "affinity:tail=0.98,pool=all,window=50000,guard=1000,rescue=0.1,spread=3,"
    long += "half_life=300,spread_kv=64"
    assert parse_policy("affinity-rescue").affinity == parse_policy(long).affinity
    p = parse_policy("affinity-rescue:tail=0.99,credit=1.5")
    assert p.affinity is not None and p.affinity["tail"] == 0.99 and p.affinity["rescue"] == 0.1
    assert p.overrides == {"router_kv_overlap_score_credit": 1.5}
    with pytest.raises(ValueError):
        parse_policy("affinity-rescue:pool=some")


def _quantile_windows():
    from kvplug import core
    from kvplug.affinity import RecentQuantile

    compiled = [core.SlidingQuantile] if core.SlidingQuantile is not None else []
    return [RecentQuantile, *compiled]


@pytest.mark.parametrize("window_class", _quantile_windows(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("window", [1, 50, 2000])
def test_recent_quantile_matches_numpy_over_the_last_window_values(window_class, window):
    """Python's window and the compiled core's twin, against numpy over the last values: a
    window of one, one inside a sorted block, and one of several blocks that split and empty
    as values come and go."""
    import random

    rng = random.Random(7)
    recent = window_class(window)
    added: list[float] = []
    for i in range(3000 if window < 2000 else 12000):
        # repeats (ties) and a drifting scale, so values leave the window in every order
        v = float(rng.choice([1.0, 2.0, rng.random() * (1 + (i % 700) / 40)]))
        recent.add(v)
        added.append(v)
        assert len(recent) == min(len(added), window)
        if window < 2000 or i % 97 == 0:
            for q in (0.0, 0.5, 0.98, 0.985, 0.99, 1.0):
                assert recent.quantile(q) == np.quantile(added[-window:], q)


def test_the_compiled_quantile_window_refuses_what_has_no_quantile():
    from kvplug import core
    from kvplug.errors import InvalidArgument

    if core.SlidingQuantile is None:
        pytest.skip("the compiled core is not built")
    window = core.SlidingQuantile(4)
    with pytest.raises(ValueError, match="no values"):
        window.quantile(0.5)
    with pytest.raises(InvalidArgument):
        window.add(float("nan"))
    window.add(1.0)
    with pytest.raises(InvalidArgument):
        window.quantile(1.5)
    with pytest.raises(InvalidArgument):
        core.SlidingQuantile(0)
    assert len(window) == 1 and window.quantile(0.98) == 1.0


# ---- decode reads in the prediction, the spread to the soonest start, weighted follow-ups


def test_read_ms_adds_the_active_sequences_context_read_in_every_prefill_step():
    from kvplug.affinity import chunked_prefill_seconds

    r = make_router(workers=("w1", "w2"))
    _decoding(r, "w2", 60, "decoding")  # 960 tokens of context on w2, none on w1
    aff = AffinityRouter(r, AffinityParams(read_ms=2.0))
    plain = AffinityRouter(r, AffinityParams())
    r.on_output_progress("decoding", 40)  # progress reports grow the context
    overlap = np.zeros(2)
    # the router's endpoint order is w1, w2; 10 blocks = 160 tokens, one step at this budget
    t_w1, t_w2 = aff._predicted_ttft(_trace(r), overlap, 10, 0, 1)
    p_w1, p_w2 = plain._predicted_ttft(_trace(r), overlap, 10, 0, 1)
    assert t_w1 == p_w1 == p_w2 == chunked_prefill_seconds(160, 0, _budget(r))
    assert t_w2 == pytest.approx(p_w2 + 2.0 * (960 + 40) / 1e6)  # one step's read of 1,000 tokens


def _trace(r):
    """A stand-in for a preview's trace: the endpoints in order."""
    from types import SimpleNamespace

    return SimpleNamespace(endpoints=np.arange(len(r.ep_worker)))


def _budget(r) -> float:
    return float(r.max_batched[0]) if len(r.max_batched) else 0.0


def test_spread_by_ttft_sends_a_long_cold_prompt_where_it_starts_soonest():
    # kv picks w1 (20 queued prefill blocks against w2's 60 active ones), where the cold
    # prompt waits for someone's prefill; spread_by="ttft" starts it at once on w2, while the
    # follow-up spread (no follow-ups anywhere: a tie) keeps kv's pick
    r, req = _rescue_setup()
    aff = AffinityRouter(r, AffinityParams(spread=0.001, spread_by="ttft"))
    assert aff.route(req).worker_id == "w2"
    assert aff.affinity_counters["spread"] == 1
    r, req = _rescue_setup()
    assert AffinityRouter(r, AffinityParams(spread=0.001)).route(req).worker_id == "w1"


def _followups(weigh: bool) -> str:
    """w1 served one follow-up on an 8-block prefix, w2 two on 2-block ones; where does a long
    cold prompt go (kv: w1)?"""
    r = make_router(workers=("w1", "w2"))
    store_prefix(r, "w1", tokens(10), 8)
    store_prefix(r, "w2", tokens(3, start=40_000), 2)
    store_prefix(r, "w2", tokens(3, start=50_000), 2, engine_base=100)
    aff = AffinityRouter(r, AffinityParams(spread=0.001, weigh_followups=weigh))
    for tag, toks, worker in (
        ("long", tokens(10), "w1"),
        ("short1", tokens(3, start=40_000), "w2"),
        ("short2", tokens(3, start=50_000), "w2"),
    ):
        assert aff.route(RouteRequest(tag, toks)).worker_id == worker
        r.on_first_token(tag)
        r.on_finish(tag)
    _decoding(r, "w2", 5, "decoding")  # kv's pick for the cold prompt: w1 (no tie to draw)
    return aff.route(RouteRequest("cold", tokens(10, start=5_000))).worker_id


def test_weigh_followups_counts_the_cached_blocks_a_session_would_recompute():
    # counted once each, w2's two short sessions outweigh w1's one; by their cached blocks
    # (4 against 8) w1's long session is the one a long cold prefill should not sit in front of
    assert _followups(weigh=False) == "w1"
    assert _followups(weigh=True) == "w2"


def test_read_and_spread_by_keys_parse_and_bad_values_are_refused():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("affinity:read_ms=0.0305,spread_by=ttft,spread_eps=0.1,weigh_followups=true")
    assert p.affinity == {
        "read_ms": 0.0305,
        "spread_by": "ttft",
        "spread_eps": 0.1,
        "weigh_followups": True,
    }
    for bad in ("read_ms=-1", "spread_by=fastest", "spread_eps=-0.1", "protect=-1"):
        with pytest.raises(ValueError):
            parse_policy(f"affinity:{bad}")


def _protect_setup():
    """kv picks w1 for a cold prompt (as in the rescue's setup), where a prefill routed 5 s ago
    has still no first token: its predicted TTFT (5 s) is in the tail (tau = 1 s) and the new
    prompt would share its last step."""
    r, req = _rescue_setup()
    r._clock.advance(5.0)
    return r, req


def test_protect_keeps_a_request_off_the_last_step_of_a_prefill_in_the_tail():
    r, req = _protect_setup()
    aff = AffinityRouter(r, AffinityParams(tail=0.5, pool="all", protect=1e-6))
    aff._kv_ttft.extend([1.0] * 20)
    assert aff.route(req).worker_id == "w2"
    assert aff.affinity_counters["protected"] == 1
    for params in (
        AffinityParams(tail=0.5, pool="all"),  # off by default
        AffinityParams(tail=0.5, pool="all", protect=10.0),  # the prompt's chunk is ~5 ms
    ):
        r, req = _protect_setup()
        aff = AffinityRouter(r, params)
        aff._kv_ttft.extend([1.0] * 20)
        assert aff.route(req).worker_id == "w1"
    r, req = _protect_setup()  # w1's prefill is not in the tail: tau = 60 s
    aff = AffinityRouter(r, AffinityParams(tail=0.5, pool="all", protect=1e-6))
    aff._kv_ttft.extend([60.0] * 20)
    assert aff.route(req).worker_id == "w1"


def _protect_blocks_route(
    protect_blocks: float,
    tail_values: list[float],
    protect_below: float = 0.0,
    w2_blocks: int = 0,
    capped: float = 0.0,
    w1_threshold: int = 0,
) -> str:
    """A follow-up (w1 holds 8 of its 10 blocks, w2 ``w2_blocks`` with a short prefill just
    queued, w3 nothing) whose holder w1 has a prefill routed 5 s ago and still no first token:
    predicted in the tail (tau = 1 s). The affinity guards keep it on w1; where does it go?
    ``capped``: protect_blocks_capped; ``w1_threshold``: w1's long_prefill_token_threshold."""
    from kvplug.workers import Worker

    r = make_router(workers=(Worker("w1", long_prefill_token_threshold=w1_threshold), "w2", "w3"))
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8)
    if w2_blocks:
        store_prefix(r, "w2", toks, w2_blocks, engine_base=100)
    _queue(r, "w1", 20, "busy")
    r._clock.advance(5.0)
    _queue(r, "w2", 20, "fresh")  # predicted well below tau: w2 is no tail prefill's last step
    aff = AffinityRouter(
        r,
        AffinityParams(
            tail=0.4,
            pool="all",
            protect_blocks=protect_blocks,
            protect_below=protect_below,
            protect_blocks_capped=capped,
        ),
    )
    aff._kv_ttft.extend(tail_values)
    return aff.route(RouteRequest("x", toks)).worker_id


def test_protect_blocks_moves_a_follow_up_off_a_tail_prefills_last_step_if_it_forgoes_little():
    tail = [1.0] * 20
    assert _protect_blocks_route(0.0, tail) == "w1"  # off by default
    assert _protect_blocks_route(8.0, tail) == "w3"  # forgoes its 8 cached blocks: allowed
    assert _protect_blocks_route(7.0, tail) == "w1"  # ... more than 7: it stays
    # the engine it goes to is the one keeping most of its prefix (w2: 6 blocks, behind a
    # short queue), not the soonest (w3, cold): it forgoes 2 blocks, not 8
    assert _protect_blocks_route(4.0, tail, w2_blocks=6) == "w2"
    assert _protect_blocks_route(1.0, tail, w2_blocks=6) == "w1"
    # nowhere predicted below tau (1 us): moving would only put it in the tail elsewhere
    assert _protect_blocks_route(8.0, [1e-6] * 20) == "w1"


def test_protect_blocks_capped_applies_on_an_engine_that_caps_a_prompts_step():
    """On an engine run with --long-prefill-token-threshold a follow-up shares every step of the
    tail prefill: protect_blocks_capped is the limit there, protect_blocks elsewhere."""
    tail = [1.0] * 20
    assert _protect_blocks_route(7.0, tail, capped=8.0) == "w1"  # w1 has no cap: 7 decides
    assert _protect_blocks_route(7.0, tail, capped=8.0, w1_threshold=64) == "w3"
    assert _protect_blocks_route(8.0, tail, capped=7.0, w1_threshold=64) == "w1"
    # capped alone: engines without a cap are left alone, as with protect off
    assert _protect_blocks_route(0.0, tail, capped=8.0) == "w1"
    assert _protect_blocks_route(0.0, tail, capped=8.0, w1_threshold=64) == "w3"


def test_protect_below_leaves_a_prefill_already_above_the_quantile():
    # w1's last prefill is predicted at ~5 s; tau (the 0.4 quantile) is 1 s either way
    high = [1.0] * 10 + [10.0] * 10  # the 0.9 quantile (10 s) is above it: protected
    assert _protect_blocks_route(8.0, high, protect_below=0.9) == "w3"
    low = [1.0] * 10 + [4.0] * 10  # the 0.9 quantile (4 s) is below it: in the top anyway
    assert _protect_blocks_route(8.0, low, protect_below=0.9) == "w1"
    assert _protect_blocks_route(8.0, low) == "w3"


def test_protect_blocks_keys_parse_and_bad_values_are_refused():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("affinity-soonest:protect_blocks=32,protect_below=0.99")
    assert p.affinity is not None
    assert p.affinity["protect_blocks"] == 32 and p.affinity["protect_below"] == 0.99
    for bad in ("protect_blocks=-1", "protect_below=1", "protect_below=-0.5"):
        with pytest.raises(ValueError):
            parse_policy(f"affinity-soonest:{bad}")


def test_affinity_soonest_is_affinity_rescue_with_the_second_pass_options():
    from kvplug.sim.policies import parse_policy

    soonest = parse_policy("affinity-soonest").affinity
    rescue = parse_policy("affinity-rescue").affinity
    assert soonest == {
        **rescue,
        "read_ms": 0.0305,
        "spread_by": "ttft",
        "weigh_followups": True,
    }
    assert parse_policy("affinity-soonest:protect=0.2").affinity == {**soonest, "protect": 0.2}


def test_affinity_protect_is_the_third_pass_setting_measured_by_its_keys():
    from kvplug.affinity import parse_affinity

    # the setting docs/sim.md's third pass measured as a list of keys, now a name
    measured = "affinity-soonest:half_life=120,protect_blocks=24,protect_below=0.99"
    assert parse_affinity("affinity-protect") == parse_affinity(measured)
    assert parse_affinity("affinity-protect:protect_blocks=16") == parse_affinity(
        "affinity-soonest:half_life=120,protect_blocks=16,protect_below=0.99"
    )


def test_affinity_balance_is_affinity_protect_with_the_balance_guard_and_the_default_fits_it():
    from kvplug.affinity import parse_affinity
    from kvplug.config import RouterConfig

    assert parse_affinity("affinity-balance") == parse_affinity(
        "affinity-protect:balance=0.5,warm=1,churn_cap=0.1,churn_half_life=300"
    )
    assert parse_affinity("affinity-protect").balance == 0.0
    # the default since issue 14's twenty-fourth pass: affinity-balance with the fitted model,
    # since its twenty-fifth each engine at its own speed once it is a tenth off, and since its
    # twenty-seventh more follow-ups kept off a tail prefill on engines that cap a prompt's
    # step, since its forty-second the tail rescue only to an engine with no prefill queued,
    # since its forty-third nothing moved off its cache while the fleet is saturated, since its
    # forty-fourth a turn queued on an engine counted as cached there while it is
    assert RouterConfig().router_affinity == "affinity-fitted"
    assert parse_affinity("affinity-fitted") == parse_affinity(
        "affinity-balance:fit_prefill=on,fit_speeds=1.1,protect_blocks_capped=96,rescue_idle=on,"
        "hold_share=0.1,hold_inflight=on"
    )
    with pytest.raises(ValueError, match="protect_blocks_capped"):
        parse_affinity("affinity-fitted:protect_blocks_capped=-1")
    with pytest.raises(ValueError, match="balance"):
        parse_affinity("affinity-balance:balance=-1")
    with pytest.raises(ValueError, match="fit_speeds"):
        parse_affinity("affinity-balance:fit_speeds=1.1")  # learnt from the fit's first tokens
    with pytest.raises(ValueError, match="fit_speeds"):
        parse_affinity("affinity-fitted:fit_speeds=0.9")


def _walk_every_request(aff, endpoints):
    """The predictions' inputs as a walk over every request in flight computes them (the way
    the affinity decision did before the load tracker kept them per endpoint): the reference."""
    import math

    from kvplug.affinity import chunked_prefill_seconds

    router = aff._router
    now, read_ms = router._clock(), aff.params.read_ms
    total = dict.fromkeys(endpoints, 0.0)
    oldest, active, steps, latest = {}, {}, {}, {}
    for r in router.load.requests.values():
        ep = r.endpoint
        if ep not in total:
            continue
        count, context = active.get(ep, (0, 0.0))
        active[ep] = (count + 1, context + r.prompt_tokens + r.output_tokens)
        if r.prefill_done or r.prefill_tokens <= 0:
            continue
        chunk = router.chunk_tokens(ep)
        seconds = chunked_prefill_seconds(
            r.prefill_tokens, r.prompt_tokens - r.prefill_tokens, chunk
        )
        steps[ep] = steps.get(ep, 0.0) + (
            1.0 if chunk <= 0 else math.ceil(r.prefill_tokens / chunk)
        )
        total[ep] += seconds
        latest[ep] = max(latest.get(ep, r.routed_at), r.routed_at)
        if ep not in oldest or r.routed_at < oldest[ep][0]:
            oldest[ep] = (r.routed_at, seconds)
    for ep, n in steps.items():
        total[ep] += n * read_ms * active[ep][1] / 1e6
    for ep, (at, seconds) in oldest.items():
        total[ep] = max(total[ep] - min(max(now - at, 0.0), seconds), 0.0)
    last = {ep: total[ep] + now - at for ep, at in latest.items()}
    return total, last, {ep: active.get(ep, (0, 0.0)) for ep in endpoints}


def _route_then_move_on(aff, clock, rng, live: list[str], rid: str, prompt, step_s, odds):
    """Route ``rid`` (up to ``prompt[0]`` blocks, starting at one of ``prompt[1]`` offsets
    ``prompt[2]`` tokens apart), then move the fleet on: time passes (``step_s`` on average),
    and with ``odds`` a request in flight gets its first token, reports output, finishes."""
    longest, starts, stride = prompt
    first, output, finish = odds
    r = aff._router
    n = int(rng.integers(1, longest))
    aff.route(RouteRequest(rid, tokens(n, start=int(rng.integers(0, starts)) * stride)))
    live.append(rid)
    clock.advance(float(rng.exponential(step_s)))
    if rng.random() < first:
        r.on_first_token(live[int(rng.integers(len(live)))])
    if output and rng.random() < output:
        r.on_output_progress(live[int(rng.integers(len(live)))], int(rng.integers(1, 300)))
    if rng.random() < finish:
        r.on_finish(live.pop(int(rng.integers(len(live)))))


def test_the_per_endpoint_walk_predicts_exactly_what_a_walk_over_every_request_does():
    """Same floats, not approximately: the simulator's measured settings must route a replay
    as they did when every decision walked every request in flight."""
    from test_router_helpers import FakeClock

    clock = FakeClock()
    r = make_router(workers=("w1", "w2", "w3", "w4"), clock=clock)
    aff = AffinityRouter(r, AffinityParams(read_ms=0.0305, tail=0.98))
    rng = np.random.default_rng(3)
    live: list[str] = []
    endpoints = tuple(range(len(r.ep_worker)))
    for i in range(300):
        _route_then_move_on(aff, clock, rng, live, f"q{i}", (60, 4, 5_000), 0.05, (0.5, 0.4, 0.3))
        total, last, active = _walk_every_request(aff, endpoints)
        now = r._clock()
        both = {ep: aff._endpoint_queue(ep, now) for ep in r.load.prefilling}
        queued = {ep: q for ep, (q, _) in both.items()}
        last_ttft = {ep: t for ep, (_, t) in both.items()}
        assert {ep: queued.get(ep, 0.0) for ep in endpoints} == total
        assert set(queued) == set(r.load.prefilling)  # the endpoints with prefills, only
        assert last_ttft == last
        # as a decision asks for them, one endpoint at a time
        decision = object()
        for ep in endpoints:
            assert aff._queue_of(decision, ep) == (total[ep], last.get(ep, 0.0))
        assert {ep: aff._context(ep) for ep in endpoints} == active


def test_an_adaptive_threshold_is_floored_by_the_requests_in_flight():
    """vLLM's --long-prefill-token-threshold-adaptive floors the cap at the budget over the
    engine's running and waiting requests: the router counts its requests in flight there and
    the one it is deciding; long_prefill_now gives every endpoint's the same."""
    from kvplug.workers import Worker

    r = make_router(
        workers=(
            Worker(
                "w1",
                max_batched_tokens=8192,
                long_prefill_token_threshold=1024,
                long_prefill_token_threshold_adaptive=True,
            ),
            Worker("w2", max_batched_tokens=8192, long_prefill_token_threshold=1024),
        )
    )
    w1, w2 = r.ep_worker.index("w1"), r.ep_worker.index("w2")
    seen = []
    for i in range(10):
        seen.append((r.long_prefill_tokens(w1), r.long_prefill_tokens(w2)))
        assert r.long_prefill_now()[[w1, w2]].tolist() == list(seen[-1])
        r.route(RouteRequest(f"r{i}", tokens(4), hints=RoutingHints(pinned_worker_id="w1")))
    # 8192 // (in flight + 1) until it falls under the threshold; w2 is not adaptive
    assert seen[:4] == [(8192, 1024), (4096, 1024), (8192 // 3, 1024), (2048, 1024)]
    assert seen[-1] == (1024, 1024)
    r.add_worker(Worker("w1", max_batched_tokens=8192, long_prefill_token_threshold=1024))
    assert r.long_prefill_tokens(w1) == 1024 and r.long_prefill_now() is r.long_prefill


def _chunked_workers(budgets, caps, adaptive) -> list:
    """Workers w0, w1, ... with these max_num_batched_tokens, long_prefill_token_thresholds
    and adaptive flags (vLLM's)."""
    from kvplug.workers import Worker

    return [
        Worker(
            f"w{i}",
            max_batched_tokens=b,
            long_prefill_token_threshold=c,
            long_prefill_token_threshold_adaptive=a,
        )
        for i, (b, c, a) in enumerate(zip(budgets, caps, adaptive, strict=True))
    ]


def test_the_predictions_for_many_engines_at_once_are_the_one_by_one_floats(monkeypatch):
    """``_predicted_ttft`` computes eight engines or more in numpy: the same floats as the loop
    (engines with no chunk size, chunks shorter and longer than the prompt, a prompt its cached
    prefix covers entirely, engines with and without requests in flight, with and without a
    long_prefill_token_threshold)."""
    from test_router_helpers import FakeClock

    import kvplug.affinity as affinity_module

    budgets = (0, 64, 256, 8192, 0, 48, 1024, 16, 300)
    caps = (16, 0, 64, 2048, 0, 100, 0, 8, 0)  # vLLM's --long-prefill-token-threshold
    adaptive = (True, False, True, False, False, True, False, False, False)  # ...-adaptive
    clock = FakeClock()
    r = make_router(workers=_chunked_workers(budgets, caps, adaptive), clock=clock)
    rng = np.random.default_rng(11)
    for params in (AffinityParams(read_ms=0.0305, tail=0.98), AffinityParams(tail=0.98)):
        aff = AffinityRouter(r, params)
        for i in range(40):
            rid = f"{params.read_ms}-{i}"
            aff.route(
                RouteRequest(
                    rid, tokens(int(rng.integers(1, 40)), start=int(rng.integers(0, 3)) * 7_000)
                )
            )
            clock.advance(float(rng.exponential(0.02)))
            if rng.random() < 0.3:
                r.on_first_token(rid)
            n = len(r.ep_worker)
            trace = _trace(r)
            overlap = rng.integers(0, 30, size=n).astype(float).tolist()
            blocks = int(rng.integers(1, 30))  # some engines cache all of it: no prefill left
            aff._ttft_for = None
            vector = aff._predicted_ttft(trace, overlap, blocks, *range(n))
            monkeypatch.setattr(affinity_module, "VECTOR_FROM", 10**9)
            aff._ttft_for = None
            one_by_one = aff._predicted_ttft(trace, overlap, blocks, *range(n))
            monkeypatch.setattr(affinity_module, "VECTOR_FROM", 8)
            assert vector == one_by_one
            aff._all_for = None
            assert aff._predicted_all(trace, overlap, blocks) == one_by_one


def test_the_compiled_predictions_are_the_python_floats_as_the_load_changes(monkeypatch):
    """``kvplug._core.predicted_ttfts`` (many engines in one call) against the one-by-one
    Python path after every change a summary must follow: requests routed, first tokens,
    finishes, a worker re-registered with another chunk; every candidate and subsets, with and
    without decode reads; chunks that divide the prompt, exceed it, or are unknown (0); engines
    with a long_prefill_token_threshold below, above and without a chunk, and without one, and
    with an adaptive one (floored by the requests in flight there)."""
    from test_router_helpers import FakeClock

    import kvplug.affinity as affinity_module
    from kvplug.workers import Worker

    budgets = (0, 64, 256, 8192, 0, 48, 1024, 16, 300, 512, 32)
    caps = (0, 32, 0, 2048, 24, 0, 4096, 0, 100, 0, 16)  # vLLM's --long-prefill-token-threshold
    adaptive = (False, True, True, False, True, False, True, False, True, False, False)
    clock = FakeClock()
    r = make_router(workers=_chunked_workers(budgets, caps, adaptive), clock=clock)
    if getattr(r._core, "predicted_ttfts", None) is None:
        pytest.skip("the compiled core is not built (the Python path is the only one)")
    rng = np.random.default_rng(5)
    live: list[str] = []
    for read_ms, slowed in ((0.0305, False), (0.0, False), (0.0305, True), (0.0, True)):
        aff = AffinityRouter(r, AffinityParams(read_ms=read_ms, tail=0.98))
        if slowed:  # engines at their own speeds (fit_speeds), one past the others' table
            for ep, factor in ((1, 2.0), (4, 0.6), (9, 1.35), (12, 3.0)):
                aff._set_slowdown(ep, factor)
        for i in range(120):
            rid = f"k{read_ms}-{slowed}-{i}"
            _route_then_move_on(aff, clock, rng, live, rid, (50, 3, 9_000), 0.03, (0.4, 0.0, 0.25))
            if i == 60:  # another chunk for one engine: its summary must be taken again
                r.add_worker(Worker("w3", max_batched_tokens=128))
            if i == 90:  # an engine's cap turned off, another's on (adaptive)
                r.add_worker(Worker("w1", max_batched_tokens=64))
                r.add_worker(
                    Worker(
                        "w2",
                        max_batched_tokens=256,
                        long_prefill_token_threshold=8,
                        long_prefill_token_threshold_adaptive=True,
                    )
                )
            n = len(r.ep_worker)
            trace = _trace(r)
            overlap = rng.integers(0, 40, size=n).astype(float).tolist()
            blocks = int(rng.choice([1, 8, 16, 32, 40, 64]))  # some multiples of the chunks
            subset = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
            compiled = aff._predicted_many(trace, overlap, blocks, None)
            compiled_subset = aff._predicted_many(trace, overlap, blocks, subset)
            monkeypatch.setattr(affinity_module, "VECTOR_FROM", 10**9)
            aff._ttft_for = None
            one_by_one = aff._predicted_ttft(trace, overlap, blocks, *range(n))
            monkeypatch.setattr(affinity_module, "VECTOR_FROM", 8)
            assert compiled == one_by_one
            assert compiled_subset == [one_by_one[j] for j in subset]
            assert any(q > 0 for q in (aff._queue_of(trace, ep)[0] for ep in range(n)))


def test_the_compiled_predictions_refuse_endpoints_outside_their_tables():
    from kvplug import core
    from kvplug.affinity import PrefillSummaries

    if core.predicted_ttfts is None:
        pytest.skip("the compiled core is not built")
    from kvplug.errors import InvalidArgument

    queues = PrefillSummaries()
    queues.fit(4)
    load = np.zeros(4, dtype=np.int64)
    args = ([0.0] * 2, 512.0, 16.0, np.zeros(4), queues, load, load, 0.0, 0.0, (1.0, 1.0, 1.0))
    assert core.predicted_ttfts(np.arange(2), None, *args) == [(512 + 512 * 512) / 1000.0] * 2
    with pytest.raises(InvalidArgument):
        core.predicted_ttfts(np.array([0, 7]), None, *args)
    with pytest.raises(InvalidArgument):
        core.predicted_ttfts(np.arange(2), [2], *args)
    with pytest.raises(InvalidArgument):
        core.stale_prefill_summaries(np.array([9]), None, np.zeros(4), queues, load)
    assert core.stale_prefill_summaries(np.arange(4), None, np.zeros(4), queues, load) == [
        (ep, 0.0) for ep in range(4)
    ]


# setup.py's COMPILED_PY
COMPILED = ["kvplug.affinity", "kvplug.prefill_fit", "kvplug.load", "kvplug.policies.affinity"]


@pytest.mark.parametrize("name", COMPILED)
def test_the_compiled_modules_are_built_from_this_source(name):
    """setup.py compiles these modules as they are (Cython) and records each source's SHA-256:
    an edit without a rebuild would otherwise run the old compiled code."""
    import hashlib
    import importlib
    import json
    from pathlib import Path

    module = importlib.import_module(name)
    path = Path(module.__file__)
    if path.suffix == ".py":
        pytest.skip(f"{name} is not compiled here (python setup.py build_ext --inplace)")
    root = Path(importlib.import_module("kvplug").__file__).parent
    recorded = json.loads((root / "_compiled_sources.json").read_text())
    source_name = name.replace(".", "/") + ".py"
    source = hashlib.sha256((root.parent / source_name).read_bytes()).hexdigest()
    assert recorded[source_name] == source, (
        f"{source_name} changed since it was compiled: python setup.py build_ext --inplace"
    )


def _sessions_router(balance: float):
    """Two engines; w1 holds a 4-block system prompt and has 20 blocks of prefill queued, so
    kv's cost picks w2 for a new session (system prompt + 6 blocks of its own) while the block
    guard (guard 8 x 4 blocks saved) lets affinity follow the system prompt to w1."""
    r = make_router(
        workers=("w1", "w2"),
        router_mode="affinity",
        router_affinity=f"affinity:balance={balance}",
    )
    system = tokens(4, start=500_000)
    store_prefix(r, "w1", system, 4)
    _queue(r, "w1", 20, "busy")
    return r, system


def _new_sessions(r, system, n: int) -> list[str]:
    went = []
    for i in range(n):
        d = r.route(RouteRequest(f"s{i}", system + tokens(6, start=10_000 * (i + 1))))
        went.append(d.worker_id)
        r.on_finish(f"s{i}")
    return went


def test_balance_guard_spreads_new_sessions_of_a_shared_prefix_off_a_crowded_engine():
    r, system = _sessions_router(0.0)  # no guard: every session follows the system prompt
    assert _new_sessions(r, system, 12) == ["w1"] * 12
    r, system = _sessions_router(0.5)
    went = _new_sessions(r, system, 12)
    # the first sessions follow it (the prefix is not yet seen shared, w1 not yet crowded);
    # once w1 has been sent more than the mean + half of it (and 2 more), kv's pick stands
    assert went[:4] == ["w1"] * 4
    assert "w2" in went[4:]
    assert 5 <= went.count("w1") <= 9
    stats = r.policy.stats()
    assert stats["balanced"] == went.count("w2")


def test_balance_guard_never_moves_a_session_off_its_own_history():
    r, system = _sessions_router(0.5)
    _new_sessions(r, system, 12)  # w1 crowded, the system prompt shared
    # session 0's own turn: its 10 blocks are cached on w1 and no prompt has left them yet
    own = system + tokens(6, start=10_000)
    store_prefix(r, "w1", own, 10)
    balanced = r.policy.stats().get("balanced", 0)
    d = r.route(RouteRequest("s0-turn2", own + tokens(3, start=900_000)))
    assert d.worker_id == "w1"
    assert r.policy.stats().get("balanced", 0) == balanced


def test_balance_guard_forgets_request_rates_with_the_half_life():
    went = {}
    for wait in (0.0, 100.0):
        clock = FakeClock()
        r = make_router(
            workers=("w1", "w2"),
            router_mode="affinity",
            router_affinity="affinity:balance=0.5,half_life=10",
            clock=clock,
        )
        system = tokens(4, start=500_000)
        store_prefix(r, "w1", system, 4)
        _queue(r, "w1", 20, "busy")
        assert _new_sessions(r, system, 5) == ["w1"] * 5
        clock.advance(wait)
        went[wait] = r.route(RouteRequest("next", system + tokens(6, start=777_000))).worker_id
    # right away w1 is crowded (5 of 5 sessions); ten half-lives later its count has decayed
    # under the floor of 2 requests over the mean, and the session follows the prefix again
    assert went == {0.0: "w2", 100.0: "w1"}


def _churn_fleet(params: AffinityParams):
    """Two engines each holding an unrelated prefix (so prompts are looked up), a clock, and
    affinity over kv."""
    clock = FakeClock()
    r = make_router(workers=("w1", "w2"), clock=clock)
    store_prefix(r, "w1", tokens(3, start=90_000), 2)
    store_prefix(r, "w2", tokens(3, start=95_000), 2, engine_base=100)
    return r, clock, AffinityRouter(r, params)


def _run_cold(r, aff, tag: str, blocks: int, start: int, busy: str | None = None) -> str:
    """A cold prompt of ``blocks`` blocks, routed and finished; ``busy``: that engine has a few
    active KV blocks meanwhile, so kv picks the other one."""
    if busy:
        _decoding(r, busy, 2, f"{tag}-busy")
    went = aff.route(RouteRequest(tag, tokens(blocks, start=start))).worker_id
    r.on_first_token(tag)
    r.on_finish(tag)
    if busy:
        r.on_finish(f"{tag}-busy")
    return went


def test_spread_churn_sends_a_long_cold_prompt_off_the_engine_just_written_to():
    for churn, expected in ((0.0, "w1"), (1.0, "w2")):
        r, _, aff = _churn_fleet(AffinityParams(spread=0.001, spread_churn=churn))
        assert _run_cold(r, aff, "a", 10, 1_000, busy="w2") == "w1"  # kv's pick: 10 blocks on w1
        # kv picks w1 again (w2 busy); no follow-ups anywhere: the follow-up spread ties and
        # keeps kv's pick, the churn sees the 10 blocks just written to w1
        nxt = RouteRequest("b", tokens(10, start=2_000))
        _decoding(r, "w2", 2, "b-busy")
        assert r.preview(nxt).worker_id == "w1"
        assert aff.route(nxt).worker_id == expected, churn


@pytest.mark.parametrize(
    ("half_life", "churn_half_life", "expected"),
    [(10.0, 0.0, "w1"), (1e9, 0.0, "w2"), (1e9, 10.0, "w1")],  # churn_half_life 0: half_life's
)
def test_spread_churn_forgets_written_blocks_with_the_half_life(
    half_life, churn_half_life, expected
):
    params = AffinityParams(
        spread=0.001, spread_churn=1.0, half_life=half_life, churn_half_life=churn_half_life
    )
    r, clock, aff = _churn_fleet(params)
    assert _run_cold(r, aff, "a", 10, 1_000, busy="w2") == "w1"  # 10 blocks to w1
    clock.advance(100.0)
    assert _run_cold(r, aff, "c", 5, 3_000, busy="w1") == "w2"  # 5 blocks to w2
    _decoding(r, "w1", 2, "b-busy")  # kv picks w2
    # ten half-lives on, w1's 10 blocks count 0.01 against w2's fresh 5 (the churn moves the
    # prompt to w1); without decay, 10 (kv's pick stands)
    assert aff.route(RouteRequest("b", tokens(10, start=2_000))).worker_id == expected


@pytest.mark.parametrize("key", ["spread_churn", "spread_lag"])
def test_spread_keys_parse_are_off_by_default_and_a_negative_value_is_refused(key):
    from kvplug.affinity import parse_affinity

    assert getattr(parse_affinity(f"affinity-balance:{key}=0.5"), key) == 0.5
    assert getattr(parse_affinity("affinity-balance"), key) == 0.0
    with pytest.raises(ValueError, match=key):
        parse_affinity(f"affinity-balance:{key}=-1")


def test_spread_lag_counts_a_follow_up_only_once_it_is_due_back():
    went = {}
    for wait in (0.0, 60.0):
        clock = FakeClock()
        r = make_router(workers=("w1", "w2"), clock=clock)
        toks = tokens(10)
        store_prefix(r, "w1", toks, 8)
        aff = AffinityRouter(r, AffinityParams(spread=0.001, half_life=600.0, spread_lag=5.0))
        assert aff.route(RouteRequest("turn", toks)).worker_id == "w1"  # a follow-up on w1
        r.on_first_token("turn")
        _decoding(r, "w2", 40, "decoding")  # kv's pick for a cold prompt: w1
        clock.advance(wait)
        went[wait] = aff.route(RouteRequest("cold", tokens(10, start=5_000))).worker_id
    # just served, the session is not due back (its lagged rate cancels it: the engines tie and
    # kv's pick stands); twelve lag half-lives on it counts, and the cold prompt goes to w2
    assert went == {0.0: "w1", 60.0: "w2"}


def _churn_cap_run(params: AffinityParams, wait: float = 0.0) -> str:
    """Where a long cold prompt goes once w2's cache has been written 10 blocks (``wait``
    seconds ago) and w1's 2 since, by a follow-up on w1 that is still decoding: kv picks w2
    (less active KV), and the spread alone keeps it there (no follow-ups on w2)."""
    r, clock, aff = _churn_fleet(params)
    assert _run_cold(r, aff, "a", 10, 1_000, busy="w1") == "w2"  # 10 blocks written to w2
    clock.advance(wait)
    toks = tokens(10, start=5_000)
    store_prefix(r, "w1", toks, 8, engine_base=200)
    assert aff.route(RouteRequest("turn", toks)).worker_id == "w1"  # a follow-up: 2 written
    r.on_first_token("turn")
    _decoding(r, "w2", 2, "b-busy")
    nxt = RouteRequest("b", tokens(10, start=2_000))
    assert r.preview(nxt).worker_id == "w2"
    return aff.route(nxt).worker_id


def test_churn_cap_keeps_a_long_cold_prompt_off_an_engine_written_more_than_the_others():
    went = {cap: _churn_cap_run(AffinityParams(spread=0.001, churn_cap=cap)) for cap in (0, 0.1)}
    # w2's 10 written blocks are over the mean of 6 by more than a tenth: the spread may not
    # leave the prompt there and moves it to w1
    assert went == {0: "w2", 0.1: "w1"}


def test_churn_cap_over_a_generous_share_does_not_bind():
    assert _churn_cap_run(AffinityParams(spread=0.001, churn_cap=1.0)) == "w2"  # 10 < 2 x 6


def test_churn_half_life_forgets_the_written_blocks_it_weighs():
    went = {}
    for churn_half_life in (30.0, 1e9):
        params = AffinityParams(spread=0.001, churn_cap=0.1, churn_half_life=churn_half_life)
        went[churn_half_life] = _churn_cap_run(params, wait=600.0)
    # twenty half-lives on, w2's 10 blocks count nothing against w1's fresh 2: w1 is the one
    # over the mean and kv's pick w2 stands; without decay w2 is over it and the prompt moves
    assert went == {30.0: "w2", 1e9: "w1"}


def test_churn_cap_leaves_kvs_pick_when_every_candidate_turns_over_fast():
    r, _, aff = _churn_fleet(AffinityParams(spread=0.001, churn_cap=0.1))
    assert _run_cold(r, aff, "a", 10, 1_000, busy="w1") == "w2"  # 10 blocks written to w2
    _queue(r, "w1", 4, "w1-prefill")  # queued prefill on w1: the spread's only candidate is w2
    nxt = RouteRequest("b", tokens(10, start=2_000))
    assert r.preview(nxt).worker_id == "w2"
    # w2 is over the mean (10 against 5), and no candidate is left: kv's pick stands
    assert aff.route(nxt).worker_id == "w2"


def test_churn_keys_parse_are_in_the_default_and_a_negative_value_is_refused():
    from kvplug.affinity import parse_affinity

    default = parse_affinity("affinity-balance")
    assert (default.churn_cap, default.churn_half_life) == (0.1, 300.0)
    assert parse_affinity("affinity-protect").churn_cap == 0.0  # the earlier settings: off
    assert parse_affinity("affinity-balance:churn_cap=0").churn_cap == 0.0
    for key in ("churn_cap", "churn_half_life"):
        with pytest.raises(ValueError, match=key):
            parse_affinity(f"affinity-balance:{key}=-1")


# ---- the TTFT guard's prefill model, set to the engines' own


def test_the_guards_prefill_model_is_a_setting():
    from kvplug.affinity import chunked_prefill_seconds
    from kvplug.prefill_model import H200_LLAMA8B

    p = parse_affinity("affinity-balance")
    assert (p.prefill_linear_ms, p.prefill_quad_ms, p.prefill_ctx_ms) == H200_LLAMA8B
    mine = parse_affinity(
        "affinity-balance:prefill_linear_ms=0.0172,prefill_quad_ms=4.21e-7,prefill_ctx_ms=0"
    )
    assert (mine.prefill_linear_ms, mine.prefill_quad_ms, mine.prefill_ctx_ms) == (
        0.0172,
        4.21e-7,
        0.0,
    )
    assert parse_affinity(affinity_setting(mine)) == mine
    for bad in ("prefill_ctx_ms=-1", "prefill_linear_ms=0,prefill_quad_ms=0"):
        with pytest.raises(ValueError, match="prefill_"):
            parse_affinity(f"affinity-balance:{bad}")
    # the chunked prediction with another model: 20,000 tokens over 1,000 cached in 8,192-token
    # chunks, no cost for the context, 0.0172 ms a token plus 4.21e-7 per token squared
    model = (0.0172, 4.21e-7, 0.0)
    want = sum(0.0172 * n + 4.21e-7 * n * n for n in (8192, 8192, 3616)) / 1000
    assert chunked_prefill_seconds(20000, 1000, 8192, model) == pytest.approx(want)


@pytest.mark.parametrize("vector", [False, True], ids=["python", "compiled"])
def test_the_guard_predicts_with_the_prefill_model_it_is_given(vector, monkeypatch):
    """Both the per-engine loop and the compiled kernel (8 engines or more) take the setting:
    an idle engine's predicted TTFT is the prompt's prefill under that model."""
    from kvplug import affinity as affinity_module
    from kvplug.affinity import chunked_prefill_seconds

    workers = tuple(f"w{i}" for i in range(8))
    r = make_router(workers=workers)
    if not vector:
        monkeypatch.setattr(affinity_module, "VECTOR_FROM", 10**9)
    model = (0.0172, 4.21e-7, 0.0)
    params = AffinityParams(prefill_linear_ms=0.0172, prefill_quad_ms=4.21e-7, prefill_ctx_ms=0.0)
    aff = AffinityRouter(r, params)
    h200 = AffinityRouter(r, AffinityParams())
    aff.route(RouteRequest("busy", tokens(640)))  # 40 blocks queued on one engine
    overlap = np.zeros(len(workers))
    mine = aff._predicted_all(_trace(r), overlap, 100)
    theirs = h200._predicted_all(_trace(r), overlap, 100)
    budget = _budget(r)
    idle = [i for i, t in enumerate(mine) if t == min(mine)]
    assert len(idle) == len(workers) - 1
    for i in idle:
        assert mine[i] == pytest.approx(chunked_prefill_seconds(1600, 0, budget, model))
        assert theirs[i] == pytest.approx(chunked_prefill_seconds(1600, 0, budget))
    (busy,) = set(range(len(workers))) - set(idle)
    assert mine[busy] > mine[idle[0]] and mine[busy] != theirs[busy]


def test_two_guards_with_different_prefill_models_do_not_share_estimates():
    """A request in prefill keeps its predicted prefill for the next decisions; a guard with
    another prefill model over the same router's requests must compute its own."""
    mocker = AffinityParams(prefill_linear_ms=0.0172, prefill_quad_ms=4.21e-7, prefill_ctx_ms=0.0)

    def busy_prediction(first_h200: bool) -> float:
        r = make_router(workers=("w1", "w2"))
        h200, mine = AffinityRouter(r, AffinityParams()), AffinityRouter(r, mocker)
        h200.route(RouteRequest("busy", tokens(4000)))  # in prefill on one engine
        overlap = np.zeros(2)
        if first_h200:
            h200._predicted_all(_trace(r), overlap, 100)  # its estimate kept on the request
        return max(mine._predicted_all(_trace(r), overlap, 100))

    assert busy_prediction(first_h200=True) == busy_prediction(first_h200=False)

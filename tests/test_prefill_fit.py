"""The affinity guard's prefill model fitted online (kvplug.prefill_fit): it learns the
coefficients of engines unlike the shipped H200 fit from first tokens, holds the prior until it
has samples, stays non-negative, forgets, ignores what is not a measurement; and the router
feeds it only measured first tokens of requests that prefilled alone."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from test_router_helpers import BS, make_router, tokens

from kvplug.affinity import chunked_prefill_seconds, parse_affinity
from kvplug.prefill_fit import REFIT_EVERY, EngineSpeeds, OnlinePrefillFit, prefill_features
from kvplug.prefill_model import H200_LLAMA8B
from kvplug.request import RouteRequest
from kvplug.workers import Worker

CHUNK = 8192.0
# an engine unlike the prior: faster per token, a third of its attention cost over the context
ENGINE = (0.02, 3.0e-7, 8.0e-7)


def _prompts(n: int, seed: int = 0):
    """(new, cached) token counts as a conversation trace has them: cold prompts up to 100k
    tokens and follow-ups over long cached prefixes."""
    rng = random.Random(seed)
    for _ in range(n):
        cached = rng.choice([0.0, 0.0, rng.uniform(1_000, 60_000)])
        yield rng.uniform(200, 100_000 if not cached else 8_000), cached


def _train(fit: OnlinePrefillFit, model, n: int, seed: int = 0) -> None:
    for new, cached in _prompts(n, seed):
        fit.add(new, cached, CHUNK, chunked_prefill_seconds(new, cached, CHUNK, model))


def _worst_error(model, truth) -> float:
    """Largest relative error of ``model``'s predictions against ``truth``'s on fresh prompts."""
    return max(
        abs(chunked_prefill_seconds(n, p, CHUNK, model) / seconds - 1)
        for n, p in _prompts(300, seed=99)
        for seconds in [chunked_prefill_seconds(n, p, CHUNK, truth)]
    )


def test_the_features_are_what_the_chunked_prediction_multiplies():
    rng = random.Random(1)
    for _ in range(200):
        new, cached = rng.uniform(1, 120_000), rng.choice([0.0, rng.uniform(0, 80_000)])
        chunk = rng.choice([0.0, 512.0, 8192.0, 1e9])
        x = prefill_features(new, cached, chunk)
        by_features = sum(c * f for c, f in zip(ENGINE, x, strict=True)) / 1000.0
        assert by_features == pytest.approx(chunked_prefill_seconds(new, cached, chunk, ENGINE))


def test_it_learns_an_engine_unlike_the_prior():
    fit = OnlinePrefillFit(H200_LLAMA8B)
    assert _worst_error(fit.model, ENGINE) > 0.3  # the prior mispredicts this engine
    _train(fit, ENGINE, 2000)
    assert fit.solves == 2000 // REFIT_EVERY
    # within what the prior's 50 samples still pull (~2.7 % of the way back at 2,000)
    assert _worst_error(fit.model, ENGINE) < 0.06
    assert fit.model[2] == pytest.approx(ENGINE[2], rel=0.1)  # the attention over the context
    _train(fit, ENGINE, 8000, seed=2)
    assert _worst_error(fit.model, ENGINE) < 0.03


def test_a_constant_per_request_is_fitted_apart_and_left_out_of_the_model():
    # every first token 60 ms later than the prefill (the step it joins, the report's way
    # back): fitted as the overhead, not spread over the per-token cost
    fit = OnlinePrefillFit(H200_LLAMA8B)
    for new, cached in _prompts(4000):
        fit.add(new, cached, CHUNK, chunked_prefill_seconds(new, cached, CHUNK, ENGINE) + 0.06)
    assert fit.overhead_ms == pytest.approx(60.0, rel=0.1)
    assert _worst_error(fit.model, ENGINE) < 0.05


def test_the_prior_holds_until_samples_outweigh_it():
    fit = OnlinePrefillFit(H200_LLAMA8B)
    _train(fit, ENGINE, REFIT_EVERY - 1)
    assert fit.model == H200_LLAMA8B and fit.solves == 0  # nothing solved yet
    _train(fit, ENGINE, 1, seed=5)
    assert fit.solves == 1
    moved = _worst_error(fit.model, ENGINE)
    assert 0.1 < moved < _worst_error(H200_LLAMA8B, ENGINE)  # towards the engine, not there
    stronger = OnlinePrefillFit(H200_LLAMA8B, prior_weight=5000)
    _train(stronger, ENGINE, REFIT_EVERY)
    assert _worst_error(stronger.model, ENGINE) > moved  # a heavier prior moves less


def test_coefficients_stay_non_negative():
    # an engine with no cost over the cached context, timed with noise: unconstrained least
    # squares puts c below zero half the time
    rng = random.Random(3)
    for seed in range(6):
        fit = OnlinePrefillFit(H200_LLAMA8B, prior_weight=1e-6)
        for new, cached in _prompts(400, seed):
            s = chunked_prefill_seconds(new, cached, CHUNK, (0.03, 4e-7, 0.0))
            fit.add(new, cached, CHUNK, s * (1 + rng.gauss(0, 0.05)))
        assert min(fit.model) >= 0.0
        assert fit.model[0] + fit.model[1] > 0


def test_it_forgets_an_engine_that_was_replaced():
    # a light prior, so what is left of the first engine is the forgetting's doing
    fit = OnlinePrefillFit(H200_LLAMA8B, half_life=500, prior_weight=1)
    _train(fit, H200_LLAMA8B, 3000)
    _train(fit, ENGINE, 5000, seed=1)
    assert _worst_error(fit.model, ENGINE) < 0.03
    # no forgetting: an average of both
    keeps = OnlinePrefillFit(H200_LLAMA8B, half_life=0, prior_weight=1)
    _train(keeps, H200_LLAMA8B, 3000)
    _train(keeps, ENGINE, 5000, seed=1)
    assert _worst_error(keeps.model, ENGINE) > 2 * _worst_error(fit.model, ENGINE)


@pytest.mark.parametrize(
    "new, seconds", [(0.0, 1.0), (-5.0, 1.0), (1000.0, 0.0), (1000.0, -1.0), (1000.0, math.nan)]
)
def test_what_is_not_a_measurement_is_ignored(new, seconds):
    fit = OnlinePrefillFit(H200_LLAMA8B, refit_every=1)
    assert not fit.add(new, 0.0, CHUNK, seconds)
    assert fit.samples == 0 and fit.model == H200_LLAMA8B


def test_short_prompts_waiting_for_a_step_do_not_bend_the_long_prefills():
    """A prompt under a chunk waits for the step it joins, which the model does not price: such
    first tokens come 1-5x late. Weighed down by their share of a chunk, they leave long
    prefills (what the guard turns on) predicted within 6.5 and 9 % (cold, over a context);
    counted in full, 10 and 12 %."""
    rng = random.Random(0)
    fit = OnlinePrefillFit(H200_LLAMA8B)
    for new, cached in _prompts(2000, seed=0):
        seconds = chunked_prefill_seconds(new, cached, CHUNK, ENGINE)
        if new < CHUNK:
            seconds *= 1 + rng.expovariate(1.0) * (1 - new / CHUNK)
        fit.add(new, cached, CHUNK, seconds)

    def worst(prompts) -> float:
        return max(
            abs(chunked_prefill_seconds(n, c, CHUNK, fit.model) / truth - 1)
            for n, c in prompts
            for truth in [chunked_prefill_seconds(n, c, CHUNK, ENGINE)]
        )

    assert worst((n, 0) for n in range(40_000, 100_001, 4_000)) < 0.065
    assert worst((n, c) for n in range(8_192, 20_000, 2_000) for c in (20_000, 60_000)) < 0.09


def test_a_term_no_sample_has_exercised_keeps_the_prior():
    fit = OnlinePrefillFit(H200_LLAMA8B)
    rng = random.Random(4)
    for _ in range(500):  # cold one-chunk prompts: the context term is never exercised
        new = rng.uniform(200, CHUNK)
        fit.add(new, 0.0, CHUNK, chunked_prefill_seconds(new, 0.0, CHUNK, ENGINE))
    assert fit.model[2] == H200_LLAMA8B[2]
    assert fit.model[0] == pytest.approx(ENGINE[0], rel=0.1)


def _fitted_router():
    r = make_router(workers=("w1",), router_mode="affinity", router_affinity="affinity-fitted")
    return r, r._policy.affinity


def _serve(r, n: int, measured: bool = True) -> None:
    """n requests one after another on an idle engine, each first token after the prefill the
    ENGINE model gives it (the router's clock advanced by that much)."""
    rng = random.Random(7)
    chunk = r.chunk_tokens(0)
    for i in range(n):
        blocks = rng.randint(4, 400)
        r.route(RouteRequest(f"q{i}", tokens(blocks, start=1_000_000 * (i + 1))))
        r._clock.advance(chunked_prefill_seconds(blocks * BS, 0.0, chunk, ENGINE))
        r.on_first_token(f"q{i}", measured)
        r.on_finish(f"q{i}")


def test_the_router_teaches_the_fitted_setting_its_measured_first_tokens():
    r, aff = _fitted_router()
    assert aff.params == parse_affinity(
        "affinity-balance:fit_prefill=true,fit_speeds=1.1,protect_blocks_capped=96,rescue_idle=true,"
        "hold_share=0.1,hold_inflight=true"
    )
    _serve(r, 3 * REFIT_EVERY)
    fit = aff._prefill_fit
    assert fit.samples == 3 * REFIT_EVERY == aff.affinity_counters["prefill_samples"]
    assert aff.affinity_counters["prefill_fits"] == 3
    assert aff._prefill_model == fit.model != H200_LLAMA8B  # the guard predicts with it
    assert r.stats()["affinity"]["prefill_fits"] == 3

    # and it predicts the engine's cold prompts (what it was shown) far better than the prior
    # (150 samples: the prior's 50 still pull it a quarter of the way back)
    def cold_error(model) -> float:
        return max(
            abs(chunked_prefill_seconds(n, 0, CHUNK, model) / s - 1)
            for n in range(64, 6400, 64)
            for s in [chunked_prefill_seconds(n, 0, CHUNK, ENGINE)]
        )

    assert cold_error(aff._prefill_model) < 0.15 and cold_error(H200_LLAMA8B) > 0.3


def test_a_capped_engine_is_learnt_at_the_chunk_it_prefilled_in():
    """On an engine run with vLLM's --long-prefill-token-threshold, a request that prefills
    alone while another request decodes there takes steps of at most the threshold, and the
    decode's KV is read in each of them. The router predicts such a prompt in capped chunks;
    it must learn its first tokens at the same chunk. Learnt at the whole budget (one step
    where there were 25), the extra steps' reads are taken for a slower model, which every
    capped prediction then counts again."""
    cap = 256
    r = make_router(
        workers=(Worker("w1", max_batched_tokens=8192, long_prefill_token_threshold=cap),),
        router_mode="affinity",
        router_affinity="affinity-fitted",
    )
    aff = r._policy.affinity
    assert aff.params.read_ms > 0  # the default setting counts the decode reads
    # a long request decoding on the engine for the whole test: every later one shares its steps
    r.route(RouteRequest("decoding", tokens(6000, start=99_000_000)))
    r._clock.advance(1.0)
    r.on_first_token("decoding")
    rng = random.Random(7)
    for i in range(6 * REFIT_EVERY):
        blocks = rng.randint(4, 400)
        r.route(RouteRequest(f"q{i}", tokens(blocks, start=1_000_000 * (i + 1))))
        request = r.load.requests[f"q{i}"]
        assert request.alone and request.others_inflight == 1
        new = float(request.prefill_tokens)
        # the engine: its prefill in chunks of at most cap, and the reads of its steps as the
        # router models them
        r._clock.advance(
            chunked_prefill_seconds(new, 0.0, cap, ENGINE) + aff._read_seconds(0, new, cap)
        )
        r.on_first_token(f"q{i}")
        r.on_finish(f"q{i}")
    assert aff.affinity_counters["prefill_fits"] == 6

    def capped_error(model) -> float:
        return max(
            abs(chunked_prefill_seconds(n, 0, cap, model) / s - 1)
            for n in range(64, 6400, 64)
            for s in [chunked_prefill_seconds(n, 0, cap, ENGINE)]
        )

    # 0.08 off; learnt at the budget's 8,192 tokens a chunk, 0.51 (the other steps' reads
    # learnt as prefill)
    assert capped_error(aff._prefill_model) < 0.15


def test_whole_answers_and_queued_requests_teach_nothing():
    r, aff = _fitted_router()
    _serve(r, 2 * REFIT_EVERY, measured=False)  # first tokens that came with whole answers
    assert aff._prefill_fit.samples == 0 and aff._prefill_model == H200_LLAMA8B
    # a request queued behind another's prefill: its first token times both
    r.route(RouteRequest("first", tokens(50, start=7_000_000)))
    r.route(RouteRequest("second", tokens(50, start=8_000_000)))
    assert r.load.requests["first"].alone and not r.load.requests["second"].alone
    r._clock.advance(2.0)
    r.on_first_token("second")
    assert aff._prefill_fit.samples == 0
    r.on_first_token("first")
    assert aff._prefill_fit.samples == 1


def test_affinity_balance_keeps_the_shipped_model():
    r = make_router(workers=("w1",), router_mode="affinity", router_affinity="affinity-balance")
    aff = r._policy.affinity
    assert not r._policy.hears_first_tokens and aff._prefill_fit is None
    _serve(r, REFIT_EVERY)
    assert aff._prefill_model == H200_LLAMA8B


def test_the_tail_is_taken_over_predictions_of_the_model_now():
    """A refit rescales the TTFT window's predictions made with the older models: the guard's
    tau compares with what the model now predicts, not with the prior's slower figures."""
    r = make_router(workers=("w1", "w2"), router_mode="affinity", router_affinity="affinity-fitted")
    aff = r._policy.affinity
    chunk = r.chunk_tokens(0)
    blocks = 200  # one prompt length: the window's values all scale alike
    for i in range(3 * REFIT_EVERY):
        r.route(RouteRequest(f"q{i}", tokens(blocks, start=1_000_000 * (i + 1))))
        r._clock.advance(chunked_prefill_seconds(blocks * BS, 0.0, chunk, ENGINE))
        r.on_first_token(f"q{i}")
        r.on_finish(f"q{i}")
    assert aff.affinity_counters["prefill_fits"] == 3
    now = chunked_prefill_seconds(blocks * BS, 0.0, chunk, aff._prefill_model)
    prior = chunked_prefill_seconds(blocks * BS, 0.0, chunk, H200_LLAMA8B)
    assert prior > 1.2 * now  # the prior predicted these prompts much slower
    # every value in the window is this prompt's prediction, whichever model made it
    assert aff._tau() == pytest.approx(now, rel=1e-9)
    assert aff._kv_ttft.quantile(0.0) == pytest.approx(now, rel=1e-9)


def _long_prefill_error(model, truth) -> float:
    """Largest relative error on the prefills the guard turns on: long cold prompts and long
    follow-ups over a cached context."""
    prompts = [(n, 0.0) for n in range(40_000, 100_001, 10_000)]
    prompts += [(n, c) for n in (8_192, 16_384) for c in (20_000, 60_000)]
    return max(
        abs(
            chunked_prefill_seconds(n, c, CHUNK, model)
            / chunked_prefill_seconds(n, c, CHUNK, truth)
            - 1
        )
        for n, c in prompts
    )


def _with_unknown_cache_hits(fit: OnlinePrefillFit, share: float, n: int = 3000) -> int:
    """ENGINE's first tokens, a ``share`` of them 20-40 ms whatever the prompt: the engine had
    the prompt cached and the router did not know (lost events, the engine's own tiers)."""
    rng, hits = random.Random(5), 0
    for new, cached in _prompts(n, seed=3):
        seconds = chunked_prefill_seconds(new, cached, CHUNK, ENGINE)
        if rng.random() < share:
            seconds, hits = rng.uniform(0.02, 0.04), hits + 1
        fit.add(new, cached, CHUNK, seconds)
    return hits


def test_first_tokens_from_a_cache_the_router_did_not_know_do_not_collapse_the_fit(monkeypatch):
    """In relative errors a first token far faster than its prefill weighs 1 / y^2: counted as
    it came, 2 % of them bend every coefficient down until long prefills are predicted at a
    fraction of their time (and the guard lets follow-ups wait behind them). Counted at a
    quarter of the model's prediction and weighed as one sample, they move it by a few %."""
    fit = OnlinePrefillFit(H200_LLAMA8B)
    hits = _with_unknown_cache_hits(fit, 0.02)
    # counted, visibly (a short prompt answered in 20-40 ms is not too fast for its prefill)
    assert hits > 40 and 0.7 * hits < fit.fast_samples <= hits
    assert _long_prefill_error(fit.model, ENGINE) < 0.06
    monkeypatch.setattr("kvplug.prefill_fit.FAST_FLOOR", 0.0)  # as they came
    as_they_came = OnlinePrefillFit(H200_LLAMA8B)
    _with_unknown_cache_hits(as_they_came, 0.02)
    assert as_they_came.fast_samples == 0
    assert _long_prefill_error(as_they_came.model, ENGINE) > 0.5


def test_an_engine_far_faster_than_the_prior_is_still_learnt():
    """The floor follows the model: an engine eight times faster than the shipped fit is learnt
    as without it (its first tokens are under a quarter of the prior's predictions at first)."""
    faster = tuple(c / 8 for c in H200_LLAMA8B)
    fit = OnlinePrefillFit(H200_LLAMA8B)
    assert _long_prefill_error(fit.model, faster) > 6
    _train(fit, faster, 3000)
    assert fit.fast_samples > 0  # the floor was reached, and the fit went on down
    assert _long_prefill_error(fit.model, faster) < 0.2  # without the floor: 0.14 as well


def test_the_router_counts_first_tokens_too_fast_for_their_prefill():
    r, aff = _fitted_router()
    chunk = r.chunk_tokens(0)
    for i in range(20):
        blocks = 300 + i
        r.route(RouteRequest(f"c{i}", tokens(blocks, start=1_000_000 * (i + 1))))
        # the first half on time, the second at a hundredth of its prefill (a cache unknown)
        seconds = chunked_prefill_seconds(blocks * BS, 0.0, chunk, ENGINE)
        r._clock.advance(seconds if i < 10 else seconds / 100)
        r.on_first_token(f"c{i}")
        r.on_finish(f"c{i}")
    assert aff.affinity_counters["prefill_samples"] == 20
    assert r.stats()["affinity"]["prefill_fast_samples"] == 10


# ---- each engine's own speed (fit_speeds) ------------------------------------------------------


def _speeds_after(truth: dict[int, float], n: int, noise: float, seed: int = 0) -> EngineSpeeds:
    """EngineSpeeds fed ``n`` first tokens per engine, each engine ``truth[ep]`` times the
    model's prediction, times log-normal noise of ``noise``."""
    speeds = EngineSpeeds(1.1)
    rng = random.Random(seed)
    for _ in range(n):
        for ep, factor in truth.items():
            predicted = rng.uniform(0.5, 5.0)
            speeds.add(ep, predicted * factor * math.exp(rng.gauss(0.0, noise)), predicted, 1.0)
    return speeds


def test_engines_alike_keep_one_model():
    """Eight alike engines with 30 % noise on every first token: no engine leaves the band, so
    the predictions are the one model's, float for float."""
    speeds = _speeds_after(dict.fromkeys(range(8), 1.0), 2000, 0.3)
    assert [speeds.slowdown(ep) for ep in range(8)] == [1.0] * 8
    # an engine never heard from is at the model's speed
    assert speeds.slowdown(99) == 1.0


def test_a_mixed_fleet_is_learnt_engine_by_engine():
    """Half the engines twice as slow as the other half: each is learnt relative to the fleet
    (whose model, fitted to both, sits between them), to within 10 % of the true ratio."""
    speeds = _speeds_after({0: 1.0, 1: 2.0, 2: 1.0, 3: 2.0}, 300, 0.2)
    fast = [speeds.slowdown(ep) for ep in (0, 2)]
    slow = [speeds.slowdown(ep) for ep in (1, 3)]
    assert all(f < 1 / 1.1 for f in fast) and all(s > 1.1 for s in slow)
    for s in slow:
        for f in fast:
            assert s / f == pytest.approx(2.0, rel=0.1)


def test_one_wild_first_token_does_not_move_an_engine():
    """A first token 1,000x its prediction (a stall, a clock jump) counts as at most 4x: one of
    them among 30 ordinary ones leaves the engine at the model's speed (counted in full it
    would put it 15 % off, past the band)."""
    speeds = _speeds_after(dict.fromkeys(range(4), 1.0), 30, 0.0)
    speeds.add(0, 1000.0, 1.0, 1.0)
    assert speeds.slowdown(0) == 1.0
    unbounded = EngineSpeeds(1.1)
    unbounded.MAX_RATIO = 1e9
    for ep in range(4):
        for _ in range(30):
            unbounded.add(ep, 1.0, 1.0, 1.0)
    unbounded.add(0, 1000.0, 1.0, 1.0)
    assert unbounded.slowdown(0) > 1.1


def test_engine_speeds_refuse_a_band_that_is_no_band():
    with pytest.raises(ValueError, match="band"):
        EngineSpeeds(1.0)
    speeds = EngineSpeeds(1.1)
    for bad in ((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0), (math.nan, 1.0, 1.0)):
        speeds.add(0, *bad)
    assert speeds.slowdown(0) == 1.0 and speeds.endpoints() == []


def test_the_router_predicts_a_slower_engine_at_its_own_speed():
    """Two engines, the second twice as slow: the default learns it from the first tokens of
    requests that prefilled alone, and then predicts a cold prompt there at twice the time (the
    same prompt, the same model, no queue); engines_off_speed counts both."""
    r = make_router(workers=("w1", "w2"), router_mode="affinity", router_affinity="affinity-fitted")
    aff = r._policy.affinity
    chunk = r.chunk_tokens(0)
    rng = random.Random(3)
    factor = {"w1": 1.0, "w2": 2.0}
    for i in range(300):
        worker, other = ("w1", "w2") if i % 2 else ("w2", "w1")
        blocks = rng.randint(256, 1024)  # 4-16 k tokens: prompts under a chunk weigh less
        d = r.route(
            RouteRequest(
                f"q{i}",
                tokens(blocks, start=1_000_000 * (i + 1)),
                exclude_workers=frozenset({other}),
            )
        )
        assert d.worker_id == worker
        r._clock.advance(chunked_prefill_seconds(blocks * BS, 0.0, chunk, ENGINE) * factor[worker])
        r.on_first_token(f"q{i}")
        r.on_finish(f"q{i}")
    ep1, ep2 = (r.endpoint_of(w, 0) for w in ("w1", "w2"))
    assert aff.affinity_counters["engines_off_speed"] == 2
    assert aff._slow(ep2) / aff._slow(ep1) == pytest.approx(2.0, rel=0.1)
    assert r.stats()["affinity"]["engines_off_speed"] == 2
    # a cold 100-block prompt on each idle engine: twice the time on the slower one
    trace = SimpleNamespace(endpoints=np.array([ep1, ep2]))
    t1, t2 = aff._predicted_ttft(trace, [0.0, 0.0], 100, 0, 1)
    assert t2 / t1 == pytest.approx(aff._slow(ep2) / aff._slow(ep1), rel=1e-12)


def test_one_model_for_the_fleet_when_fit_speeds_is_off():
    r = make_router(
        workers=("w1", "w2"),
        router_mode="affinity",
        router_affinity="affinity-fitted:fit_speeds=0",
    )
    aff = r._policy.affinity
    assert aff._speeds is None and "engines_off_speed" not in aff.affinity_counters

"""Active-load accounting: lifecycle, output blocks with/without OSL, prefill-duration model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_router_helpers import BS, FakeClock, core_backend, make_router, store_prefix, tokens

from kvplug.load import LoadTracker
from kvplug.prefill_model import (
    H200_LLAMA8B,
    CalibratedPrefillModel,
    calibration_points,
    fit_from_calibration,
)
from kvplug.request import RouteRequest, RoutingHints

# the H200 calibration numbers (/work/shared/calibration/prefill_calib_h200.json)
CALIB = {
    "prefill_cold_ms": {
        "128": 35.029,
        "512": 33.519,
        "1024": 37.369,
        "2048": 60.662,
        "4096": 121.469,
        "8192": 255.735,
        "16384": 586.383,
        "32768": 1390.924,
    },
    "prefill_cached_ms": {
        "P2048_N128": 47.038,
        "P2048_N512": 46.519,
        "P2048_N2048": 76.037,
        "P8192_N128": 46.402,
        "P8192_N512": 46.021,
        "P8192_N2048": 104.896,
        "P16384_N128": 46.579,
        "P16384_N512": 56.565,
        "P16384_N2048": 138.817,
    },
}

pytestmark = pytest.mark.usefixtures("core_backend")
# core_backend: imported fixture, parametrised over the core backends
assert core_backend


def loads(r, w):
    return r.active_load(w)[0]


def test_lifecycle_accounting_returns_to_zero():
    r = make_router(workers=("a", "b"), router_track_output_blocks=True)
    rng = np.random.default_rng(0)
    ids = []
    for i in range(200):
        rid = f"r{i}"
        r.route(
            RouteRequest(
                rid,
                tokens(int(rng.integers(1, 20)), start=int(rng.integers(0, 5)) * 999),
                hints=RoutingHints(expected_osl=int(rng.integers(0, 3)) * 50 or None),
            )
        )
        ids.append(rid)
        if i % 3 == 0:
            r.on_first_token(ids[len(ids) // 2])
        if i % 4 == 0:
            r.on_output_progress(ids[len(ids) // 3], int(rng.integers(1, 120)))
        if i % 5 == 0:
            r.on_finish(ids.pop(0))
    for rid in ids:
        r.on_output_progress(rid, 77)
        r.on_finish(rid)
    for w in ("a", "b"):
        assert loads(r, w) == {"prefill_tokens": 0, "decode_blocks": 0, "inflight": 0}
    assert r.stats()["active_requests"] == 0


def test_finish_without_first_token_releases_prefill_too():
    r = make_router(workers=("a",))
    r.route(RouteRequest("x", tokens(5)))
    assert loads(r, "a") == {"prefill_tokens": 5 * BS, "decode_blocks": 5, "inflight": 1}
    r.on_finish("x")  # failed before the first token
    assert loads(r, "a") == {"prefill_tokens": 0, "decode_blocks": 0, "inflight": 0}
    r.on_finish("x")
    r.on_first_token("never-seen")
    assert r.stats()["load_unknown_request_updates"] == 2


def test_cached_prefix_is_not_prefill_load():
    r = make_router(workers=("a",))
    toks = tokens(8)
    store_prefix(r, "a", toks, 6)
    r.route(RouteRequest("x", toks))
    assert loads(r, "a")["prefill_tokens"] == 2 * BS  # only the uncached part
    # tracked decode load is what is in flight: all 8 distinct blocks (the resident-prefix
    # credit applies when scoring the next request, not to the tracked load)
    assert loads(r, "a")["decode_blocks"] == 8


def test_output_blocks_off_by_default():
    r = make_router(workers=("a",))
    r.route(RouteRequest("x", tokens(2)))
    r.on_output_progress("x", 5 * BS)
    assert loads(r, "a")["decode_blocks"] == 2


def test_output_blocks_full_weight_without_osl():
    r = make_router(workers=("a",), router_track_output_blocks=True)
    r.route(RouteRequest("x", tokens(2)[:-4]))  # 28 tokens: 4 short of a block boundary
    r.on_output_progress("x", 3)
    assert loads(r, "a")["decode_blocks"] == 2  # no boundary crossed yet
    r.on_output_progress("x", 4)  # 32 tokens -> crossed one boundary
    assert loads(r, "a")["decode_blocks"] == 3
    r.on_output_progress("x", 4 + 2 * BS)
    assert loads(r, "a")["decode_blocks"] == 5


def test_output_blocks_weighted_by_progress_toward_osl():
    r = make_router(workers=("a",), router_track_output_blocks=True)
    r.route(RouteRequest("x", tokens(2), hints=RoutingHints(expected_osl=4 * BS)))
    r.on_output_progress("x", BS)  # 1 block crossed, progress 1/4 -> weight 3/4
    assert loads(r, "a")["decode_blocks"] == pytest.approx(2 + 0.75)
    r.on_output_progress("x", 2 * BS)  # 2 blocks, progress 1/2
    assert loads(r, "a")["decode_blocks"] == pytest.approx(2 + 1.0)
    r.on_output_progress("x", 4 * BS)  # at the expected length -> weight 0
    assert loads(r, "a")["decode_blocks"] == pytest.approx(2)
    r.on_output_progress("x", 6 * BS)  # past it: stays 0
    assert loads(r, "a")["decode_blocks"] == pytest.approx(2)
    r.on_finish("x")
    assert loads(r, "a")["decode_blocks"] == 0


def test_output_progress_implies_first_token():
    r = make_router(workers=("a",))
    r.route(RouteRequest("x", tokens(3)))
    r.on_output_progress("x", 1)
    assert loads(r, "a")["prefill_tokens"] == 0


def test_prefill_duration_model_decays_oldest_linearly():
    clock = FakeClock(0.0)

    class TwoSeconds:
        def predict(self, new_tokens, cached_tokens):
            return 2.0

    import random

    from kvplug.config import RouterConfig
    from kvplug.router import Router
    from kvplug.workers import Worker

    r = Router(
        RouterConfig(kv_block_size=BS),
        clock=clock,
        rng=random.Random(0),
        prefill_predictor=TwoSeconds(),
    )
    r.add_worker(Worker("a"))
    r.route(RouteRequest("first", tokens(10)))  # 160 tokens, head from t=0
    r.route(RouteRequest("second", tokens(5, start=5000)))  # 80 tokens, queued behind
    assert loads(r, "a")["prefill_tokens"] == 240
    clock.advance(1.0)  # head half done
    assert loads(r, "a")["prefill_tokens"] == pytest.approx(160)
    clock.advance(5.0)  # head fully decayed (clamped), second not started
    assert loads(r, "a")["prefill_tokens"] == pytest.approx(80)
    r.on_first_token("first")  # second becomes the head now (t=6)
    assert loads(r, "a")["prefill_tokens"] == pytest.approx(80)
    clock.advance(0.5)
    assert loads(r, "a")["prefill_tokens"] == pytest.approx(60)
    r.on_finish("second")
    assert loads(r, "a")["prefill_tokens"] == 0


def test_prefill_model_flag_uses_calibrated_predictor():
    r = make_router(workers=("a",), router_prefill_load_model="calibrated")
    assert isinstance(r.load.predictor, CalibratedPrefillModel)


def test_calibrated_model_is_the_fit_of_the_calibration_data():
    m = fit_from_calibration(CALIB)
    assert (m.a, m.b, m.c) == pytest.approx(H200_LLAMA8B, rel=1e-5)
    default = CalibratedPrefillModel()
    for n, p, ms in calibration_points(CALIB):
        assert default.predict(n, p) * 1000 == pytest.approx(ms, rel=0.08)
    assert default.predict(8192, 0) == pytest.approx(0.2625, rel=0.01)
    assert default.predict(0, 1000) == 0.0
    shared = "/work/shared/calibration/prefill_calib_h200.json"
    if os.path.exists(shared):
        with open(shared) as f:
            assert calibration_points(json.load(f)) == calibration_points(CALIB)


def test_tracker_duplicate_request_id_replaces_old_attempt():
    t = LoadTracker(BS)
    t.ensure(2)
    kw = dict(track_prefill=True, track_decode=True, expected_osl=None, track_output=False, now=0.0)
    t.add("x", 0, 32, 0, decode_blocks=2, **kw)
    t.add("x", 1, 48, 0, decode_blocks=3, **kw)
    assert t.inflight.tolist()[:2] == [0, 1]
    assert t.decode_blocks[0] == 0 and t.decode_blocks[1] == 3
    assert t.counters["duplicate_request_ids"] == 1


def _tracker_view(t: LoadTracker, ep: int) -> tuple[int, list[str]]:
    """What the tracker's per-endpoint state must equal: a walk over every request in flight."""
    mine = [r for r in t.requests.values() if r.endpoint == ep]
    return (
        sum(r.prompt_tokens + r.output_tokens for r in mine),
        [r.request_id for r in mine if not r.prefill_done],
    )


def test_context_tokens_and_prefilling_follow_every_lifecycle_step():
    """The affinity policy reads these per endpoint instead of walking every request: after any
    mix of adds (retried ids included), first tokens, output reports, finishes and a dropped
    endpoint they equal the walk."""
    t = LoadTracker(BS)
    t.ensure(3)
    rng = np.random.default_rng(7)
    live: list[str] = []
    seen: dict[int, tuple[list[int], int | None]] = {}  # ep -> (its prefills, their version)
    for step in range(600):
        op = int(rng.integers(0, 10))
        if op < 4 or not live:
            rid = live[int(rng.integers(len(live)))] if live and op == 0 else f"r{step}"
            t.add(
                rid,
                int(rng.integers(0, 3)),
                int(rng.integers(1, 400)),
                int(rng.integers(0, 400)),  # cached: some prompts entirely, so no prefill
                track_prefill=True,
                track_decode=True,
                decode_blocks=1.0,
                expected_osl=None,
                track_output=bool(rng.integers(0, 2)),
                now=float(step),
            )
            if rid not in live:
                live.append(rid)
        elif op < 6:
            t.first_token(live[int(rng.integers(len(live)))], float(step))
        elif op < 8:
            t.output_progress(live[int(rng.integers(len(live)))], int(rng.integers(0, 90)), 0.0)
        else:
            t.finish(live.pop(int(rng.integers(len(live)))))
        if step == 450:
            for rid in t.drop_endpoint(1):
                live.remove(rid)
        for ep in range(3):
            context, prefilling = _tracker_view(t, ep)
            assert t.context_tokens[ep] == context, (step, ep)
            assert list(t.prefilling.get(ep, {})) == prefilling, (step, ep)
            # a reader's summary of an endpoint's prefills is reused while the version stays:
            # the same requests (the same objects: a retried id is a new one) in the same order
            now = (
                [id(r) for r in t.prefilling.get(ep, {}).values()],
                t.prefilling_versions.item(ep),
            )
            if ep in seen and seen[ep][1] == now[1]:
                assert seen[ep][0] == now[0], (step, ep)
            seen[ep] = now
    for rid in live:
        t.finish(rid)
    assert t.context_tokens[:3].tolist() == [0, 0, 0] and not t.prefilling

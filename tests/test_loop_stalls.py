"""A stall of the router's own event loop is not the engines' metrics going stale
(kvplug/stalls.py): attributes observed just before a stall longer than the max age still route
the requests queued behind it, before any poller has run again; without a stall they go stale
as before."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from test_frontend_harness import prompt, serving
from test_router_helpers import make_router, tokens

from kvplug.config import AttributeThreshold
from kvplug.errors import AllWorkersOverloaded
from kvplug.request import RouteRequest
from kvplug.stalls import LoopStalls

pytestmark = pytest.mark.timeout(60)

GPU = AttributeThreshold("gpu_utilization", "<=", 0.9, "exclude", True)  # max age 2 s


def gpu_router():
    return make_router(workers=("a", "b"), clock=time.monotonic, router_attribute_thresholds=[GPU])


async def test_attributes_from_before_a_stall_route_the_requests_behind_it():
    watched, unwatched = gpu_router(), gpu_router()
    stalls = LoopStalls()
    watched.attrs.stalls = stalls
    stalls.start()
    try:
        await asyncio.sleep(0.1)
        for r in (watched, unwatched):
            for w in "ab":
                r.set_attributes(w, {"gpu_utilization": 0.5})
        time.sleep(2.3)  # the loop stalls past the 2 s max age: no poller could have run
        # routed before the beat that notes the stall has run (the request's callback first)
        assert stalls.stalls == 0
        assert not watched.route(RouteRequest("x", tokens(1))).excluded
        with pytest.raises(AllWorkersOverloaded, match="stale"):
            unwatched.route(RouteRequest("x", tokens(1)))  # what every request got before
        await asyncio.sleep(0.2)  # the beat runs and notes it
        assert stalls.stalls == 1 and 2.2 < stalls.stalled_s < 3.5
        assert not watched.route(RouteRequest("y", tokens(1))).excluded
        await asyncio.sleep(2.0)  # the loop runs and nothing new is observed: stale
        with pytest.raises(AllWorkersOverloaded, match="stale"):
            watched.route(RouteRequest("z", tokens(1)))
    finally:
        stalls.stop()


def test_credit_is_each_observations_overlap_with_the_stalls():
    stalls = LoopStalls()
    stalls.spans.extend([(10.0, 12.0), (20.0, 20.5)])
    got = stalls.credit(np.array([5.0, 11.0, 15.0, 20.25, 30.0, np.nan]), now=31.0)
    assert got[:5].tolist() == [2.5, 1.5, 0.5, 0.25, 0.0]
    assert np.isnan(got[5])  # never observed stays missing
    assert LoopStalls().credit(np.array([1.0]), now=2.0) is None  # no stalls: no work


async def test_kvplug_serve_routes_after_its_loop_stalled_past_the_max_age():
    """Through the frontend: the engines' attributes as a poller left them, the event loop
    blocked 2.3 s, then a request: 200, not 503 all_workers_overloaded."""
    config = {"router_attribute_thresholds": [GPU], "router_mode": "kv"}
    async with serving(2, router_config=config) as h:
        for w in ("w0", "w1"):
            h.router.set_attributes(w, {"gpu_utilization": 0.5})
        resp, body = await h.complete(prompt(2, 1))
        assert resp.status == 200, body
        for w in ("w0", "w1"):  # as a poller would leave them, right before the stall
            h.router.set_attributes(w, {"gpu_utilization": 0.5})
        time.sleep(2.3)  # the frontend's loop (this test's) stalls
        resp, body = await h.complete(prompt(2, 2))
        assert resp.status == 200, body
        stats = h.frontend._router_stats()["loop_stalls"]
        assert stats["count"] >= 1 and stats["seconds"] >= 2.2

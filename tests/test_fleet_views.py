"""The fleet's per-request views (served models, workers per model, whether P/D is on) are
kept between changes, and every change that moves them is seen."""

from __future__ import annotations

import asyncio

from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.fleet import Fleet
from kvplug.router import Router, RouterConfig


def _spec(wid: str, **extra):
    return spec_from_mapping({"id": wid, "url": f"http://127.0.0.1:9/{wid}", **extra}, wid)


def test_views_follow_every_change():
    async def run():
        fleet = Fleet(Router(RouterConfig(kv_block_size=16)))
        a = fleet._register(_spec("a", engine="openai"))
        b = fleet._register(_spec("b", engine="openai"))
        assert fleet.models() == frozenset() and fleet.workers_for_model("m") is None
        assert fleet.models() is fleet.models()  # kept, not rebuilt per call
        a.models = {"m"}  # what a health probe does when it reads /v1/models
        assert fleet.models() == {"m"}
        assert fleet.workers_for_model("m") is None  # b knows nothing: it may serve it
        b.models = {"n"}
        assert fleet.workers_for_model("m") == {"a"} and fleet.workers_for_model("n") == {"b"}
        fleet.configured_models = {"alias"}
        assert fleet.models() == {"alias", "m", "n"}
        c = fleet._register(_spec("c", engine="vllm", role="prefill"))
        assert fleet.disaggregated and fleet.workers_for_model("m") == {"a", "c"}
        c.draining = True
        assert not fleet.disaggregated
        c.draining = False
        assert fleet.disaggregated
        fleet._unregister(c)
        assert not fleet.disaggregated and fleet.workers_for_model("m") == {"a"}
        await fleet.remove("b")
        assert fleet.models() == {"alias", "m"} and fleet.workers_for_model("m") is None

    asyncio.run(run())

"""Conditional disaggregation (--router-conditional-disagg): when the remote prefill stage is
skipped, on Dynamo's predicates, with a real Router; and end to end through the frontend."""

from __future__ import annotations

import asyncio
import random

import pytest
from test_frontend_harness import prompt, serving

from kvplug.config import RouterConfig
from kvplug.disagg import ConditionalDisagg, decide_bypass, isl_bounding, plan_two_stage
from kvplug.errors import ConfigError
from kvplug.events import BlockStored
from kvplug.request import RouteRequest, RoutingHints
from kvplug.router import Router
from kvplug.workers import Role, Stage, Worker

BS = 16


# -- Dynamo's isl_bounding predicate (its unit cases, block size 64) -------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "want"),
    [
        (1000, 14 * 64, True),  # eff 104 < 2048, ratio 0.104 < 0.7
        (100_000, 1000 * 64, False),  # eff 36k >= 2048 (even with ratio 0.36)
        (200, 0, False),  # small but ratio 1.0
        (2048, 0, False),  # eff == threshold: strict <
        (0, 0, True),  # empty prompt: eff 0, ratio 0
        (500, 10 * 64, True),  # cached > prompt: eff clamps to 0
        (1000, 300, False),  # eff 700, ratio exactly 0.7: strict <
    ],
)
def test_isl_bounding_predicate(prompt_tokens, cached, want):
    bypass, eff, _ = isl_bounding(prompt_tokens, cached, 2048, 0.7)
    assert bypass is want and eff == max(prompt_tokens - cached, 0)


# -- decide_bypass over a real Router -------------------------------------------------------


class Backend:
    """The StageBackend surface conditional disaggregation uses, over a real Router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.routed: list[Stage] = []

    def decode_capable(self) -> frozenset[str]:
        return frozenset(w for w, x in self.router.workers.items() if x.role is not Role.PREFILL)

    def preview_stage(self, ctx, stage, allowed=None):
        hints = RoutingHints(allowed_worker_ids=allowed) if allowed is not None else RoutingHints()
        return self.router.preview(
            RouteRequest(f"{ctx}.{stage.value}", ctx, stage=stage, hints=hints)
        )

    def route_stage(self, ctx, stage, attempt, exclude, allowed=None):
        self.routed.append(stage)
        raise AssertionError("the prefill stage must not be routed when it is skipped")


def pd_router(**cfg) -> Router:
    cfg.setdefault("kv_block_size", BS)
    r = Router(RouterConfig(**cfg), rng=random.Random(0))
    r.add_worker(Worker("p0", role=Role.PREFILL, max_batched_tokens=100))
    r.add_worker(Worker("d0", role=Role.DECODE, kv_capacity_blocks=20))
    r.add_worker(Worker("d1", role=Role.DECODE, kv_capacity_blocks=20))
    return r


def cache(r: Router, worker: str, toks: list[int], n_blocks: int) -> None:
    h = r.index.request_hashes(toks)[:n_blocks].tolist()
    r.apply_event(BlockStored(worker_id=worker, engine_hashes=h, block_hashes=h))


TOKS = list(range(12 * BS))  # 192 tokens


def test_small_mostly_cached_request_skips_the_prefill_stage():
    r = pd_router(router_conditional_disagg="isl_bounding")
    cache(r, "d1", TOKS, 10)  # 160 of 192 tokens cached on d1
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert v is not None and v.bypass and v.decode_worker == "d1"
    assert (v.prompt_tokens, v.cached_tokens, v.effective_isl, v.isl_ok) == (192, 160, 32, True)
    assert v.reason == (
        "prefill on the decode worker: effective ISL 32 < 2048 and 32/192 = 0.17 < 0.7 on d1"
    )
    # previews book nothing
    assert r.stats()["active_requests"] == 0 and r.stats()["decisions"] == 0
    assert r.stats()["previews"] == 1


def test_uncached_or_large_requests_keep_the_prefill_stage():
    r = pd_router(router_conditional_disagg="isl_bounding")
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert not v.bypass and v.effective_isl == 192 and v.isl_ok is False
    assert v.reason.startswith("remote prefill: effective ISL 192 < 2048 and 192/192 = 1.00 >= 0.7")
    r2 = pd_router(
        router_conditional_disagg="isl_bounding", router_conditional_disagg_eff_isl_threshold=32
    )
    cache(r2, "d1", TOKS, 10)
    v2 = decide_bypass(Backend(r2), TOKS, ConditionalDisagg.from_config(r2.config))
    assert not v2.bypass and "effective ISL 32 >= 32" in v2.reason


def busy_prefill(r: Router, tokens: int) -> None:
    r.route(
        RouteRequest(
            "busy",
            list(range(10**6, 10**6 + tokens)),
            stage=Stage.PREFILL,
            hints=RoutingHints(pinned_worker_id="p0"),
        )
    )


def test_prefill_load_policy_and_its_threshold_inheritance():
    # no threshold anywhere: no load signal, never busy
    r = pd_router(router_conditional_disagg="prefill_load")
    busy_prefill(r, 200)
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert not v.bypass and v.prefill_busy is None and "no busy threshold" in v.reason
    # explicit threshold: 200 active > 1.5 x 100 -> busy -> bypass (ISL not consulted)
    r = pd_router(
        router_conditional_disagg="prefill_load",
        router_conditional_disagg_prefill_busy_threshold=1.5,
    )
    busy_prefill(r, 200)
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert v.bypass and v.prefill_busy and v.prefill_worker == "p0" and v.isl_ok is None
    assert "p0 active prefill 200 tokens > 1.5 x 100" in v.reason
    # inherited from the admission queue threshold: 200 <= 3 x 100 -> calm
    r = pd_router(router_conditional_disagg="prefill_load", router_queue_threshold=3.0)
    busy_prefill(r, 200)
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert not v.bypass and v.prefill_busy is False


@pytest.mark.parametrize(
    ("cached_blocks", "prefill_tokens", "want"),
    [(10, 0, True), (10, 200, True), (0, 0, False), (0, 200, True)],
)
def test_isl_or_load_truth_table(cached_blocks, prefill_tokens, want):
    r = pd_router(
        router_conditional_disagg="isl_or_load",
        router_conditional_disagg_prefill_busy_threshold=1.0,
    )
    if cached_blocks:
        cache(r, "d0", TOKS, cached_blocks)
    if prefill_tokens:
        busy_prefill(r, prefill_tokens)
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert v.bypass is want


def test_decode_busy_guard_vetoes_a_bypass():
    cfg = {
        "router_conditional_disagg": "isl_bounding",
        "router_conditional_disagg_decode_busy_threshold": 0.5,
    }
    r = pd_router(**cfg)
    cache(r, "d1", TOKS, 10)
    # projected decode on d1: 12 incoming - 10 resident = 2 <= 0.5 x 20
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert v.bypass and v.decode_busy is False and "decode blocks 2 <= 0.5 x 20" in v.reason
    # 9 unrelated blocks in flight on d1: 11 > 10 -> no bypass
    r.route(
        RouteRequest(
            "load",
            list(range(5 * 10**6, 5 * 10**6 + 9 * BS)),
            stage=Stage.DECODE,
            hints=RoutingHints(pinned_worker_id="d1"),
        )
    )
    v = decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config))
    assert v.decode_worker == "d1" and v.isl_ok and v.decode_busy and not v.bypass
    # unknown capacity: no bypass (Dynamo denies when the decode-busy signal is missing)
    r2 = Router(RouterConfig(kv_block_size=BS, **cfg), rng=random.Random(0))
    r2.add_worker(Worker("p0", role=Role.PREFILL))
    r2.add_worker(Worker("d0", role=Role.DECODE))
    cache(r2, "d0", TOKS, 10)
    v = decide_bypass(Backend(r2), TOKS, ConditionalDisagg.from_config(r2.config))
    assert v.isl_ok and not v.bypass and "KV capacity unknown" in v.reason


def test_off_and_non_kv_modes_do_not_apply():
    r = pd_router()
    assert decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config)) is None
    r = pd_router(router_conditional_disagg="isl_bounding", router_mode="round-robin")
    assert decide_bypass(Backend(r), TOKS, ConditionalDisagg.from_config(r.config)) is None
    assert r.stats()["previews"] == 0


def test_plan_skips_the_prefill_stage():
    r = pd_router(router_conditional_disagg="isl_bounding")
    cache(r, "d1", TOKS, 10)
    backend = Backend(r)
    plan = asyncio.run(
        plan_two_stage(
            backend,
            TOKS,
            {"prompt": TOKS},
            "req",
            "/v1/completions",
            TOKS,
            1,
            ConditionalDisagg.from_config(r.config),
        )
    )
    assert plan.stage is Stage.AGGREGATED and plan.allowed == frozenset({"d0", "d1"})
    assert plan.conditional.bypass and plan.fallback_reason is None and plan.prefill is None
    assert backend.routed == []


def test_config_validation():
    with pytest.raises(ConfigError, match="conditional-disagg"):
        RouterConfig(router_conditional_disagg="always")
    with pytest.raises(ConfigError, match="ratio"):
        RouterConfig(router_conditional_disagg_eff_isl_ratio_threshold=1.5)
    with pytest.raises(ConfigError, match="decode-busy"):
        RouterConfig(router_conditional_disagg_decode_busy_threshold=-1)


# -- end to end through the frontend (stub engines publish their cache as events) -----------

PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "d1", "role": "decode"},
]


@pytest.mark.timeout(60)
async def test_frontend_skips_the_prefill_stage_for_a_cached_follow_up():
    async with serving(PD, router_config={"router_conditional_disagg": "isl_bounding"}) as h:
        first = prompt(12, 3)
        resp, raw = await h.complete(first)
        assert resp.status == 200, raw
        decode_worker = resp.headers["x-kvplug-worker"]
        assert resp.headers["x-kvplug-prefill-worker"] == "p0"  # nothing cached: two stages
        pre = await h.trace(resp.headers["x-kvplug-prefill-decision-id"])
        verdict = pre["router"]["conditional_disagg"]
        assert verdict["bypass"] is False and verdict["effective_isl"] == 12 * 16
        h.assert_idle()
        # the same conversation one turn later: its prefix is on the decode worker now
        hop_count = len(h.engines["p0"].requests)
        resp, raw = await h.complete(first + prompt(1, 4))
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == decode_worker
        assert "x-kvplug-prefill-worker" not in resp.headers
        assert len(h.engines["p0"].requests) == hop_count  # no prefill hop
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "aggregated" and trace["fallback_reason"] is None
        verdict = trace["router"]["conditional_disagg"]
        assert verdict["bypass"] is True and verdict["cached_tokens"] == 12 * 16
        assert "conditional disagg: prefill on the decode worker" in trace["router"]["explain"]
        async with h.session.get(h.url + "/metrics") as m:
            assert 'outcome="prefill_skipped"} 1.0' in await m.text()
        h.assert_idle()

"""The routing pipeline: named stages, policies as objects registered by name, and what each
stage reports ending up in the decision (and staying as it was)."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest

from kvplug import (
    CandidateTrace,
    ConfigError,
    Router,
    RouterConfig,
    RouteRequest,
    RoutingHints,
    Worker,
)
from kvplug.config import MODES
from kvplug.pipeline import RouteContext
from kvplug.policies import RoutingPolicy, policy_names, register_policy

BS = 16


def tokens(n_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * BS, dtype=np.uint32)


def fleet(n: int = 2, **cfg) -> Router:
    r = Router(RouterConfig(kv_block_size=BS, **cfg), rng=random.Random(0))
    for i in range(n):
        r.add_worker(Worker(f"w{i}"))
    return r


def test_a_stored_trace_does_not_change_after_later_decisions():
    # issue 9 §6: with no filter, the active-prefix depths were a view of a buffer shared by
    # every decision, so a trace fetched later showed another request's in-flight blocks
    r = fleet()
    p = tokens(4, 1)
    r.route(RouteRequest("a", p))  # in flight: its chain is active on one worker
    d = r.route(RouteRequest("b", p))
    assert d.chosen_input("active_prefix") is not None  # the dedup walked a live chain
    before = d.to_dict()
    r.on_finish("a")
    r.on_finish("b")
    r.route(RouteRequest("x", p[: 2 * BS]))
    r.route(RouteRequest("y", p[: 2 * BS]))  # its own walk: 2 active blocks somewhere
    assert d.to_dict() == before


def test_an_unhealthy_worker_is_excluded_for_its_real_reason():
    # issue 9 §6: a worker left out for failing its health checks read "excluded by the
    # caller (retry)"
    r = fleet(3)
    d = r.route(
        RouteRequest(
            "a",
            tokens(2, 1),
            exclude_workers=frozenset({"w0", "w1"}),
            exclusion_reasons={"w1": "unhealthy: connection refused"},
        )
    )
    reasons = {e.worker_id: (e.filter, e.reason) for e in d.excluded}
    assert reasons == {
        "w0": ("exclude-workers", "excluded by the caller (retry)"),
        "w1": ("exclude-workers", "unhealthy: connection refused"),
    }
    assert d.worker_id == "w2"


def test_every_built_in_mode_is_a_registered_policy():
    assert set(MODES) <= set(policy_names())
    for mode in MODES:
        if mode == "profile":
            continue
        r = fleet(2, router_mode=mode)
        hints = RoutingHints(pinned_worker_id="w1") if mode == "direct" else RoutingHints()
        d = r.route(RouteRequest("a", tokens(2, 1), hints=hints))
        assert d.mode == mode and r.policy.name == mode
    with pytest.raises(ConfigError, match="not one of"):
        RouterConfig(router_mode="no-such-mode")


@register_policy
class LongestPrefix(RoutingPolicy):
    """A policy defined outside kvplug: the most device-cached blocks, ties to the first."""

    name = "test-longest-prefix"
    uses_overlap = True

    def score(self, ctx: RouteContext) -> CandidateTrace:
        assert ctx.device is not None
        r = self.router
        return CandidateTrace(
            r.ep_worker, r.ep_rank, ctx.cands, "score", ctx.device, {"device": ctx.device}
        )

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        return int(np.argmax(trace.values))


def test_a_new_policy_is_a_class_registered_by_name():
    from kvplug import BlockStored

    r = fleet(3, router_mode="test-longest-prefix")
    p = tokens(4, 3)
    hashes = r.index.request_hashes(p)
    r.apply_event(BlockStored(worker_id="w2", engine_hashes=[1, 2, 3], block_hashes=hashes[:3]))
    d = r.route(RouteRequest("a", p))
    assert (d.worker_id, d.mode, d.overlap_blocks) == ("w2", "test-longest-prefix", 3)
    assert d.candidates[2]["score"] == 3 and d.candidates[2]["chosen"]
    with pytest.raises(ConfigError, match="already registered"):

        @register_policy
        class Clash(LongestPrefix):
            pass


def test_the_pipeline_reads_top_to_bottom():
    # the request's path is a short list of named stages; none longer than a screen
    src = inspect.getsource(Router._route)
    stages = ["_candidates", "_filters", "_overlap", "_load", ".score(", ".pick(", "_book"]
    positions = [src.index(s) for s in [*stages, "_explain"]]
    assert positions == sorted(positions)
    for name in ("_route", "_candidates", "_filters", "_overlap", "_load", "_book", "_explain"):
        lines = inspect.getsource(getattr(Router, name)).count("\n")
        assert lines <= 75, f"Router.{name} is {lines} lines"


def test_a_preview_books_nothing_and_reports_the_same_pick():
    r = fleet(2)
    p = tokens(3, 5)
    seen = r.preview(RouteRequest("a", p))
    assert seen.decision_id == 0 and r.load.active_count() == 0
    d = r.route(RouteRequest("a", p))
    assert (d.worker_id, d.overlap_blocks) == (seen.worker_id, seen.overlap_blocks)
    assert d.decision_id == 1 and r.stats()["previews"] == 1


@pytest.mark.parametrize(
    "cfg", [{}, {"active_decode_blocks_threshold": 0.5}, {"router_attribute_thresholds": ["x<=1"]}]
)
def test_no_worker_for_the_stage_is_no_compatible_worker_whatever_the_filters(cfg):
    from kvplug import NoCompatibleWorker, Role, Stage

    r = Router(RouterConfig(kv_block_size=BS, **cfg), rng=random.Random(0))
    r.add_worker(Worker("p", role=Role.PREFILL))
    with pytest.raises(NoCompatibleWorker, match="no decode-capable worker"):
        r.route(RouteRequest("a", tokens(1, 1), stage=Stage.DECODE))

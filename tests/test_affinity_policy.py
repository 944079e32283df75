"""``--router-mode affinity``: the affinity decision inside the router's pick stage, as
``kvplug serve`` runs it (and the simulator, since issue 14's fourth pass). It must decide what
the wrapper (AffinityRouter around a kv-mode router, which docs/sim.md measured before) decides,
in one pass."""

from __future__ import annotations

import argparse
import random

import pytest
from test_affinity import PARAMS, _queue, _setup
from test_router_helpers import make_router, store_prefix, tokens

from kvplug.affinity import (
    AFFINITY_PRESETS,
    AffinityParams,
    AffinityRouter,
    affinity_setting,
    parse_affinity,
)
from kvplug.config import RouterConfig, add_router_arguments
from kvplug.errors import ConfigError
from kvplug.request import RouteRequest, RoutingHints
from kvplug.router import Router
from kvplug.sim.engine import EngineConfig
from kvplug.sim.policies import parse_policy
from kvplug.sim.traces import parse_workload
from kvplug.sim.virtual import ReplayConfig, replay


class FirstTie(random.Random):
    def random(self) -> float:
        return 0.0


BLOCK_GUARD = "affinity:guard=8,memory=0.25,cap=128"  # test_affinity's PARAMS


def _held(setting: str = BLOCK_GUARD, queued: int = 20):
    """test_affinity's state on an affinity-mode router: w1 holds 8 of the prompt's 10 blocks
    and has ``queued`` blocks of prefill pending; kv alone picks the idle w2."""
    r = make_router(workers=("w1", "w2"), router_mode="affinity", router_affinity=setting)
    toks = tokens(10)
    store_prefix(r, "w1", toks, 8)
    _queue(r, "w1", queued, "busy")
    return r, toks


def test_the_policy_keeps_the_request_on_its_prefix_where_kv_moves_it():
    kv, toks = _setup(20)
    assert kv.preview(RouteRequest("x", toks)).worker_id == "w2"  # kv: the idle engine
    r, toks = _held()
    d = r.route(RouteRequest("x", toks))
    assert (d.worker_id, d.overlap_blocks) == ("w1", 8)
    assert r.stats()["affinity"]["affinity"] == 1  # kvplug serve's /metrics shows it
    # the decision's explanation says where kv would have sent it
    assert d.trace is not None and r.ep_worker[d.trace.params["affinity_moved_from"]] == "w2"


def test_a_long_queue_on_the_prefix_engine_still_moves_the_request():
    r, toks = _held(queued=400)
    assert r.route(RouteRequest("x", toks)).worker_id == "w2"
    assert r._policy.affinity.affinity_counters["guarded"] == 1


def _state(r) -> tuple:
    a = r._policy.affinity
    return dict(a.affinity_counters), len(a._kv_ttft), dict(a._followups)


def test_a_preview_shows_kv_s_pick_and_changes_nothing_the_policy_remembers():
    r, toks = _held("affinity-soonest")
    before = _state(r)
    for _ in range(3):
        assert r.preview(RouteRequest("x", toks)).worker_id == "w2"
    assert _state(r) == before
    r.route(RouteRequest("x", toks))
    assert _state(r) != before  # a booked route is remembered


def test_pins_and_exclusions_are_not_redirected():
    r, toks = _held(queued=0)
    d = r.route(RouteRequest("p", toks, hints=RoutingHints(pinned_worker_id="w2")))
    assert d.worker_id == "w2"
    d = r.route(RouteRequest("e", toks, exclude_workers=frozenset({"w1"})))
    assert d.worker_id == "w2"
    assert r._policy.affinity.affinity_counters["affinity"] == 0


def test_affinity_acts_within_an_allow_list_and_never_outside_it():
    """The frontend sends a per-model allow-list with every request when the fleet serves
    several models: affinity must still act among the allowed workers (the simulator's wrapper
    kept kv's pick for any hint, since its pinned re-route would have dropped the list)."""
    r, toks = _held()  # kv alone picks the idle w2; affinity keeps the request on w1
    both = RoutingHints(allowed_worker_ids=frozenset({"w1", "w2"}))
    assert r.route(RouteRequest("a", toks, hints=both)).worker_id == "w1"
    only_w2 = RoutingHints(allowed_worker_ids=frozenset({"w2"}))
    assert r.route(RouteRequest("b", toks, hints=only_w2)).worker_id == "w2"
    assert r._policy.affinity.affinity_counters["affinity"] == 1


@pytest.mark.parametrize(
    "setting",
    [
        "affinity",
        "affinity-rescue",
        "affinity-soonest",
        # the third pass's option, with a tail that arms within the replay (protects twice)
        "affinity-soonest:tail=0.9,half_life=120,protect_blocks=24,protect_below=0.97",
    ],
)
def test_the_policy_routes_a_replay_exactly_as_the_measured_wrapper(setting):
    """The conversation-shaped multi-turn workload on 4 engines: every request lands on the
    same engine with the same first-token time through the policy as through AffinityRouter
    (what bench_routing_quality.py measured)."""
    records = parse_workload("multi-turn:session_rate=2,duration=60")[:300]
    cfg = ReplayConfig(n_engines=4, engine=EngineConfig(capacity_blocks=400))
    wrapped = parse_policy(setting)
    params = AffinityParams(**wrapped.affinity)

    # ties go to the first candidate on both sides: the wrapper draws twice per request
    # (its preview, then the route), the policy once, so random tie-breaks would part them
    def wrapper_first_tie(config, clock, rng):
        return AffinityRouter(Router(config, clock=clock, rng=FirstTie()), params)

    def policy_first_tie(config, clock, rng):
        return Router(config, clock=clock, rng=FirstTie())

    via_wrapper = replay(records, wrapped.router_config(512), cfg, router_factory=wrapper_first_tie)
    config = RouterConfig(kv_block_size=512, router_mode="affinity", router_affinity=setting)
    via_policy = replay(records, config, cfg, router_factory=policy_first_tie)

    def placements(res):
        return [(q.request_id, q.worker_id, round(q.first_token, 9)) for q in res.requests]

    assert placements(via_policy) == placements(via_wrapper)
    # the workload exercises the affinity path, not only kv's picks
    kv_config = RouterConfig(kv_block_size=512, router_mode="kv")
    via_kv = replay(records, kv_config, cfg, router_factory=policy_first_tie)
    assert placements(via_kv) != placements(via_policy)


@pytest.mark.parametrize("setting", [*AFFINITY_PRESETS, "affinity-soonest:tail=0.97,pool=cold"])
def test_the_simulator_replays_the_mode_serve_runs_with_the_same_setting(setting):
    """``kvplug bench``'s affinity policies build ``--router-mode affinity`` routers (one pass,
    as ``kvplug serve``), whose policy holds exactly the setting's parameters."""
    policy = parse_policy(setting)
    config = policy.router_config(512)
    router = policy.router_factory()(config, None, random.Random(0))
    assert router.config.router_mode == "affinity"
    assert router._policy.affinity.params == parse_affinity(setting)
    assert parse_affinity(affinity_setting(parse_affinity(setting))) == parse_affinity(setting)


def test_settings_parse_and_bad_ones_are_config_errors():
    assert parse_affinity("affinity-rescue").tail == AFFINITY_PRESETS["affinity-rescue"]["tail"]
    p = parse_affinity("affinity-soonest:tail=0.97,weigh_followups=off,spread-by=followups")
    assert (p.tail, p.weigh_followups, p.spread_by) == (0.97, False, "followups")
    for bad, why in (
        ("nope", "is not one of"),
        ("affinity:tail", "KEY=VALUE"),
        ("affinity:colour=red", "KEY=VALUE"),
        ("affinity:window=lots", "takes a int"),
        ("affinity:weigh_followups=maybe", "takes a bool"),
        ("affinity:tail=1.5", "tail must be"),
    ):
        with pytest.raises(ConfigError, match=why):
            RouterConfig(router_mode="affinity", router_affinity=bad)
    # another mode ignores the setting (it is only read by mode affinity)
    assert RouterConfig(router_mode="kv", router_affinity="nope").router_mode == "kv"


def test_the_command_line_selects_it():
    parser = add_router_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--router-mode", "affinity", "--router-affinity", "affinity-rescue:rescue=0.2"]
    )
    cfg = RouterConfig.from_args(args)
    assert (cfg.router_mode, cfg.router_affinity) == ("affinity", "affinity-rescue:rescue=0.2")
    r = make_router(router_mode="affinity", router_affinity=cfg.router_affinity)
    assert r._policy.affinity.params.rescue == 0.2


def test_the_wrapper_still_wraps_only_kv_routers():
    with pytest.raises(ValueError):
        AffinityRouter(make_router(router_mode="affinity"), PARAMS)

"""--router-selection-policy: linear (the seed's sum, default) or lmetric
(``scale*adjusted_prefill * (decode + 1)``), end to end, in explanations, flags, profiles, sim."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import yaml
from test_router_helpers import core_backend, make_router, store_prefix, tokens
from test_router_kv import seed_example_router

from kvplug.config import RouterConfig, add_router_arguments
from kvplug.errors import ConfigError
from kvplug.profiles import load_profile
from kvplug.request import RouteRequest, RoutingHints

pytestmark = pytest.mark.usefixtures("core_backend")
assert core_backend


def test_lmetric_on_the_seed_example_changes_the_pick():
    # seed state: adjusted prefill 8, 5, 2; decode 10, 5, 9 (linear: 18, 10, 11 -> w2)
    r, toks = seed_example_router(router_selection_policy="lmetric")
    d = r.route(RouteRequest("x", toks))
    assert d.scores == {"w1": 8 * 11, "w2": 5 * 6, "w3": 2 * 10}
    assert d.worker_id == "w3"
    assert d.explain() == (
        "kv: w3 <- cost(w3)=20.0 = 1.0*2 x (9 + 1) (device 8/10; prefill 10 - 1.0*8)"
    )
    doc = json.loads(d.to_json())
    assert doc["params"]["lmetric"] == 1.0
    assert doc["candidates"][0]["formula"].startswith("cost(w1)=88.0 = 1.0*8 x (10 + 1)")


def test_linear_is_the_default_and_unchanged():
    r, toks = seed_example_router()
    d = r.route(RouteRequest("x", toks))
    assert d.scores == {"w1": 18.0, "w2": 10.0, "w3": 11.0}
    assert " x (" not in d.explain()


def test_lmetric_with_scale_credit_and_a_zero_prefill():
    r = make_router(
        workers=("a", "b"),
        router_selection_policy="lmetric",
        router_prefill_load_scale=2.0,
    )
    toks = tokens(6)
    store_prefix(r, "a", toks, 6)  # everything cached on a: adjusted prefill 0
    # b carries 4 unrelated in-flight blocks
    r.route(RouteRequest("busy", tokens(4, 9000), hints=RoutingHints(pinned_worker_id="b")))
    r.on_first_token("busy")
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    # a: 2*0 * (0 + 6 - 6 + 1) = 0; b: 2*6 * (4 + 6 + 1) = 132
    assert rows["a"]["cost"] == 0 and rows["b"]["cost"] == pytest.approx(132)
    assert d.worker_id == "a"


def test_lmetric_softmax_probabilities_follow_its_costs():
    from kvplug.pickers import softmax_cost_probs

    r, toks = seed_example_router(router_selection_policy="lmetric", router_temperature=0.5)
    d = r.route(RouteRequest("x", toks))
    probs = [c["probability"] for c in d.candidates]
    assert probs == pytest.approx(list(softmax_cost_probs(np.array([88.0, 30.0, 20.0]), 0.5)))


def test_profile_kv_cost_scorer_uses_the_policy():
    profile = load_profile(yaml.safe_load("plugins: [{type: kv-cost-scorer}]"))
    picks = {}
    for policy in ("linear", "lmetric"):
        r, toks = seed_example_router(
            router_mode="profile", router_selection_policy=policy, profile=profile
        )
        picks[policy] = r.route(RouteRequest("x", toks)).worker_id
    assert picks == {"linear": "w2", "lmetric": "w3"}


def test_flag_file_and_validation(tmp_path):
    parser = add_router_arguments(argparse.ArgumentParser())
    c = RouterConfig.from_args(parser.parse_args(["--router-selection-policy", "lmetric"]))
    assert c.router_selection_policy == "lmetric"
    assert RouterConfig.from_args(parser.parse_args([])).router_selection_policy == "linear"
    f = tmp_path / "r.yaml"
    f.write_text("router-selection-policy: lmetric\n")
    assert RouterConfig.from_file(f).router_selection_policy == "lmetric"
    with pytest.raises(ConfigError, match="selection-policy"):
        RouterConfig(router_selection_policy="quadratic")
    with pytest.raises(SystemExit):
        parser.parse_args(["--router-selection-policy", "quadratic"])


def test_sim_policy_names():
    from kvplug.sim.policies import parse_policy

    p = parse_policy("lmetric")
    assert p.mode == "kv" and p.feed_events
    assert p.router_config(16).router_selection_policy == "lmetric"
    q = parse_policy("kv:selection=lmetric,temperature=0.1")
    assert q.router_config(16).router_selection_policy == "lmetric"
    assert parse_policy("kv").router_config(16).router_selection_policy == "linear"

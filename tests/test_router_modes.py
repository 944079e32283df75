"""Non-kv modes, llm-d style profiles (scorers, pickers, YAML), and configuration."""

from __future__ import annotations

import argparse
import collections

import numpy as np
import pytest
import yaml
from test_router_helpers import FakeClock, make_router, store_prefix, tokens

from kvplug.config import RouterConfig, add_router_arguments
from kvplug.errors import ConfigError, InvalidRequest
from kvplug.profiles import load_profile
from kvplug.request import RouteRequest, RoutingHints
from kvplug.workers import Worker


def route_many(r, n, start=0):
    return [
        r.route(RouteRequest(f"r{start + i}", tokens(2, start=i * 100))).worker_id for i in range(n)
    ]


def test_round_robin_cycles():
    r = make_router(router_mode="round-robin")
    assert route_many(r, 6) == ["w1", "w2", "w3", "w1", "w2", "w3"]


def test_random_is_seeded_and_covers():
    a = route_many(make_router(router_mode="random", seed=5), 30)
    b = route_many(make_router(router_mode="random", seed=5), 30)
    assert a == b and set(a) == {"w1", "w2", "w3"}


def test_direct_needs_a_pin():
    r = make_router(router_mode="direct", workers=(Worker("a", dp_size=2), Worker("b")))
    d = r.route(
        RouteRequest("x", tokens(1), hints=RoutingHints(pinned_worker_id="a", pinned_dp_rank=1))
    )
    assert (d.worker_id, d.dp_rank) == ("a", 1)
    with pytest.raises(InvalidRequest, match="direct"):
        r.route(RouteRequest("y", tokens(1)))


def test_least_loaded_uses_inflight():
    r = make_router(router_mode="least-loaded")
    picks = route_many(r, 3)
    assert sorted(picks) == ["w1", "w2", "w3"]
    r.on_finish("r1")
    assert r.route(RouteRequest("n", tokens(1))).worker_id == picks[1]


def test_power_of_two_prefers_the_less_loaded_of_two():
    r = make_router(router_mode="power-of-two", workers=("a", "b", "c"), seed=2)
    for i in range(10):
        r.route(RouteRequest(f"a{i}", tokens(1), hints=RoutingHints(pinned_worker_id="a")))
    picks = collections.Counter()
    for i in range(40):
        picks[r.route(RouteRequest(f"n{i}", tokens(1))).worker_id] += 1
        r.on_finish(f"n{i}")
    # "a" carries 10 in flight, b and c none: a loses every pair it is drawn into
    assert picks["a"] == 0 and picks["b"] > 5 and picks["c"] > 5


def test_device_aware_weighted():
    ws = [Worker("cpu1", device="cpu"), Worker("gpu1"), Worker("gpu2")]
    r = make_router(router_mode="device-aware-weighted", workers=ws, router_accelerator_weight=8)
    picks = collections.Counter(route_many(r, 40))
    # group load: cpu = n_cpu/1 vs gpu = n_gpu/(2*8), ties to the accelerators: the cpu
    # takes request 2 (0 < 1/16), 19 (1 < 17/16) and 36 (2 < 33/16)
    assert picks["cpu1"] == 3 and picks["gpu1"] + picks["gpu2"] == 37
    assert abs(picks["gpu1"] - picks["gpu2"]) <= 1
    d = r.route(RouteRequest("x", tokens(1)))
    assert "accelerator_group_load" in d.trace.params


def test_device_aware_single_class_is_least_loaded():
    r = make_router(router_mode="device-aware-weighted")
    assert sorted(route_many(r, 3)) == ["w1", "w2", "w3"]


def test_busy_workers_are_excluded_in_non_kv_modes():
    ws = [Worker("a", max_batched_tokens=100), Worker("b", max_batched_tokens=100)]
    r = make_router(router_mode="round-robin", workers=ws, active_prefill_tokens_threshold_frac=1.0)
    r.route(RouteRequest("big", tokens(10), hints=RoutingHints(pinned_worker_id="a")))
    assert route_many(r, 4, start=10) == ["b"] * 4


PROFILE = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: kv-cost-scorer}
- {type: queue-scorer}
- name: gpu-headroom
  type: endpoint-attribute-scorer
  parameters:
    attributeKey: gpu_utilization
    algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0, max: 1}}}
- name: gpu-filter
  type: endpoint-attribute-filter
  parameters: {attribute: gpu_utilization, operator: LessThanOrEqual, threshold: 0.9,
               onMissing: worst, fallbackOnEmpty: true}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: kv-cost-scorer, weight: 2}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: gpu-headroom, weight: 1}
  - {pluginRef: gpu-filter}
  - {pluginRef: max-score-picker}
"""


def profile_router(text=PROFILE, **kw):
    clock = FakeClock()
    r = make_router(
        router_mode="profile",
        clock=clock,
        seed=1,
        workers=("a", "b", "c"),
        profile=load_profile(yaml.safe_load(text)),
        **kw,
    )
    return r, clock


def test_profile_scores_are_clamped_weighted_and_summed():
    r, _ = profile_router()
    toks = tokens(8)
    store_prefix(r, "a", toks, 8)
    r.set_attributes("a", {"queue_depth": 4, "gpu_utilization": 0.5})
    r.set_attributes("b", {"queue_depth": 0, "gpu_utilization": 0.2})
    r.set_attributes("c", {"queue_depth": 2, "gpu_utilization": 0.3})
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert rows["a"]["scores"] == pytest.approx(
        {"kv-cost-scorer": 2.0, "queue-scorer": 0.0, "gpu-headroom": 0.5}
    )
    assert rows["b"]["scores"] == pytest.approx(
        {"kv-cost-scorer": 0.0, "queue-scorer": 1.0, "gpu-headroom": 0.8}
    )
    assert rows["c"]["scores"]["queue-scorer"] == pytest.approx(0.5)
    assert d.worker_id == "a" and rows["a"]["score"] == pytest.approx(2.5)
    assert d.explain().startswith("profile: a <- score(a)=2.5 = kv-cost-scorer=2")
    assert set(d.attribute_ages) == {"a", "b", "c"}


def test_profile_attribute_filter_and_missing_scores_zero():
    r, clock = profile_router()
    r.set_attributes("a", {"gpu_utilization": 0.95})
    r.set_attributes("b", {"gpu_utilization": 0.4})
    d = r.route(RouteRequest("x", tokens(2)))
    assert {(e.worker_id, e.filter) for e in d.excluded} == {
        ("a", "attribute:gpu_utilization"),
        ("c", "attribute:gpu_utilization"),
    }
    assert d.worker_id == "b"
    # b goes stale: every worker fails -> fallback to the least bad (a at 0.95)
    clock.advance(3)
    r.set_attributes("a", {"gpu_utilization": 0.95})
    d = r.route(RouteRequest("y", tokens(2)))
    assert d.worker_id == "a" and d.fallback


def test_profile_weighted_random_and_softmax_pickers():
    text = PROFILE.replace("{type: max-score-picker}", "{type: weighted-random-picker}")
    text = text.replace("pluginRef: max-score-picker", "pluginRef: weighted-random-picker")
    r, _ = profile_router(text)
    for w, q in (("a", 0), ("b", 5), ("c", 10)):
        r.set_attributes(w, {"queue_depth": q, "gpu_utilization": 0.5})
    n = 6000
    counts = collections.Counter()
    probs = None
    for i in range(n):
        d = r.route(RouteRequest(f"r{i}", tokens(2)))
        counts[d.worker_id] += 1
        probs = {c["worker_id"]: c["probability"] for c in d.candidates}
        r.on_finish(f"r{i}")
    # scores a: 2+1+0.5, b: 2+0.5+0.5, c: 2+0+0.5 -> p = score / sum
    assert probs == pytest.approx({"a": 3.5 / 9, "b": 3.0 / 9, "c": 2.5 / 9})
    chi2 = sum((counts[w] - n * p) ** 2 / (n * p) for w, p in probs.items())
    assert chi2 < 13.82  # chi-square df=2, alpha=0.001
    soft = load_profile(
        {
            "plugins": [
                {"type": "running-requests-scorer"},
                {"type": "softmax-picker", "parameters": {"temperature": 0.5}},
            ]
        }
    )
    assert soft.profiles["default"].picker == "softmax-picker"
    total = np.array([0.0, 1.0])
    idx, p = soft.profiles["default"].pick(total, __import__("random").Random(0))
    assert p == pytest.approx([1 / (1 + np.e**2), np.e**2 / (1 + np.e**2)])


def test_adaptive_range_attribute_scorer_and_kv_utilisation():
    text = """
plugins:
- {name: q, type: endpoint-attribute-scorer,
   parameters: {attributeKey: queue_depth, algorithm: {type: linear_higher_is_better,
                normalization: adaptiveRange}}}
- {type: kv-cache-utilization-scorer}
- {type: prefix-cache-scorer}
"""
    r, _ = profile_router(text)
    r.set_attributes("a", {"queue_depth": 10, "kv_usage": 0.25})
    r.set_attributes("b", {"queue_depth": 20})
    toks = tokens(4)
    store_prefix(r, "c", toks, 2)
    d = r.route(RouteRequest("x", toks))
    rows = {c["worker_id"]: c["scores"] for c in d.candidates}
    assert rows["a"] == pytest.approx(
        {"q": 0.0, "kv-cache-utilization-scorer": 0.75, "prefix-cache-scorer": 0.0}
    )
    assert rows["b"]["q"] == 1.0 and rows["b"]["kv-cache-utilization-scorer"] == 0.0
    assert rows["c"] == pytest.approx(
        {"q": 0.0, "kv-cache-utilization-scorer": 0.0, "prefix-cache-scorer": 0.5}
    )


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"plugins": [{"type": "nope"}]}, "unknown plugin type"),
        ({"plugins": [{"type": "max-score-picker"}]}, "at least one scorer"),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "missing"}]}],
            },
            "not defined",
        ),
        ({"plugins": "x"}, "plugins"),
        ({"plugins": [{"type": "endpoint-attribute-scorer"}]}, "attributeKey"),
    ],
)
def test_bad_profiles_are_config_errors(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        load_profile(bad)


def test_profile_mode_without_profile_is_config_error():
    with pytest.raises(ConfigError, match="profile"):
        make_router(router_mode="profile")


def test_profile_from_file_via_flag(tmp_path):
    p = tmp_path / "profile.yaml"
    p.write_text(PROFILE)
    r = make_router(router_mode="profile", router_profile=str(p))
    assert r.route(RouteRequest("x", tokens(2))).mode == "profile"


def test_config_defaults_are_dynamos():
    c = RouterConfig()
    assert (
        c.router_kv_overlap_score_credit,
        c.router_prefill_load_scale,
        c.router_host_cache_hit_weight,
        c.router_disk_cache_hit_weight,
        c.shared_cache_multiplier,
        c.router_temperature,
        c.router_ttl_secs,
    ) == (1.0, 1.0, 0.75, 0.25, 0.5, 0.0, 120.0)
    assert c.router_track_output_blocks is False and c.router_prefill_load_model == "none"
    assert c.active_decode_blocks_threshold is None and c.router_max_tree_size == 2**20


def test_flags_and_file_use_the_same_names(tmp_path):
    parser = add_router_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--router-mode",
            "kv",
            "--kv-block-size",
            "32",
            "--router-temperature",
            "0.3",
            "--router-kv-overlap-score-credit",
            "0.8",
            "--no-router-kv-events",
            "--router-track-output-blocks",
            "--active-prefill-tokens-threshold-frac",
            "1.5",
            "--router-attribute-threshold",
            "gpu_utilization<=0.9",
            "--router-attribute-missing",
            "gpu_utilization=penalise",
            "--router-label-selector",
            "tier=large",
        ]
    )
    c = RouterConfig.from_args(args)
    assert c.kv_block_size == 32 and c.router_temperature == 0.3 and not c.router_kv_events
    assert c.router_track_output_blocks and c.active_prefill_tokens_threshold_frac == 1.5
    (th,) = c.router_attribute_thresholds
    assert (th.attribute, th.op, th.value, th.on_missing) == (
        "gpu_utilization",
        "<=",
        0.9,
        "penalise",
    )
    assert c.router_label_selector == {"tier": "large"}
    f = tmp_path / "router.yaml"
    f.write_text(
        "router-mode: least-loaded\n--kv-block-size: 64\nrouter_ttl_secs: 5\n"
        "router-attribute-thresholds: ['kv_usage<0.8']\n"
    )
    c2 = RouterConfig.from_file(f)
    assert (c2.router_mode, c2.kv_block_size, c2.router_ttl_secs) == ("least-loaded", 64, 5)
    assert c2.router_attribute_thresholds[0].op == "<"
    # flags override the file
    args = parser.parse_args(["--router-config", str(f), "--router-mode", "random"])
    c3 = RouterConfig.from_args(args)
    assert (c3.router_mode, c3.kv_block_size) == ("random", 64)


@pytest.mark.parametrize(
    "kw",
    [
        {"router_mode": "best"},
        {"kv_block_size": 0},
        {"router_temperature": -1},
        {"router_host_cache_hit_weight": -0.1},
        {"active_decode_blocks_threshold": -1},
        {"router_prefill_load_model": "aic"},
        {"router_label_selector": "novalue"},
        {"router_attribute_thresholds": ["gpu~1"]},
    ],
)
def test_invalid_config_is_config_error(kw):
    with pytest.raises(ConfigError):
        RouterConfig(**kw)


def test_unknown_file_key_is_config_error(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("router-mood: kv\n")
    with pytest.raises(ConfigError, match="router-mood"):
        RouterConfig.from_file(f)


def test_index_block_size_must_match():
    from kvplug.index import KvIndex
    from kvplug.router import Router

    with pytest.raises(ConfigError, match="block size"):
        Router(RouterConfig(kv_block_size=16), index=KvIndex(32))
    assert np.float64(1.0) == 1.0


def test_profile_per_stage_and_penalised_missing_attribute():
    from kvplug.workers import Stage

    prof = load_profile(
        {
            "plugins": [
                {"type": "running-requests-scorer"},
                {"type": "kv-cost-scorer"},
                {
                    "name": "gpu",
                    "type": "endpoint-attribute-filter",
                    "parameters": {
                        "attribute": "gpu_utilization",
                        "op": "<=",
                        "value": 0.9,
                        "onMissing": "penalise",
                    },
                },
            ],
            "schedulingProfiles": [
                {"name": "default", "plugins": ["running-requests-scorer", "gpu"]},
                {"name": "prefill", "plugins": [{"pluginRef": "kv-cost-scorer", "weight": 3}]},
            ],
        }
    )
    clock = FakeClock()
    r = make_router(router_mode="profile", clock=clock, workers=("a", "b"), profile=prof)
    r.set_attributes("a", {"gpu_utilization": 0.5})
    d = r.route(RouteRequest("x", tokens(2)))
    rows = {c["worker_id"]: c for c in d.candidates}
    # both score 1.0 on running requests; b has no gpu_utilization: 1.0 - 0.5 penalty
    assert rows["a"]["score"] == 1.0 and rows["b"]["score"] == 0.5
    assert rows["b"]["missing_attribute_penalty"] is True and d.worker_id == "a"
    d = r.route(RouteRequest("y", tokens(2), stage=Stage.PREFILL))
    assert set(d.candidates[0]["scores"]) == {"kv-cost-scorer"}


def test_load_aware_scorer():
    prof = load_profile({"plugins": [{"type": "load-aware-scorer"}]})
    r = make_router(router_mode="profile", workers=("a", "b", "c", "d"), profile=prof)
    for w, q in (("a", 0), ("b", 64), ("c", 500)):
        r.set_attributes(w, {"queue_depth": q})
    d = r.route(RouteRequest("x", tokens(1)))
    assert d.scores == {"a": 0.5, "b": 0.25, "c": 0.0, "d": 0.0}
    assert d.worker_id == "a"


ARTICLE_SHORT_FORM = """
filters:
  - type: label-selector-filter
    selector: "llm-d.ai/model-family=qwen,llm-d.ai/serving-role=decode"
  - type: gpu-utilization-filter
    maxPercent: 90
    fallbackOnEmpty: true
scorers:
  - name: gpu-headroom
    attributeKey: gpu_utilization
    algorithm:
      type: linear_lower_is_better
      normalization:
        fixedRange: {min: 0, max: 1}
  - name: queue-pressure
    attributeKey: queue_depth
    algorithm:
      type: linear_lower_is_better
      normalization: adaptiveRange
"""


def test_short_form_profile_from_the_llm_d_article():
    prof = load_profile(yaml.safe_load(ARTICLE_SHORT_FORM))
    qwen = {"llm-d.ai/model-family": "qwen", "llm-d.ai/serving-role": "decode"}
    ws = [
        Worker("a", labels=qwen),
        Worker("b", labels=qwen),
        Worker("c", labels=qwen),
        Worker("llama", labels={"llm-d.ai/model-family": "llama"}),
    ]
    r = make_router(router_mode="profile", workers=ws, profile=prof)
    r.set_attributes("a", {"gpu_utilization": 0.95, "queue_depth": 0})  # over 90 %
    r.set_attributes("b", {"gpu_utilization": 0.30, "queue_depth": 8})
    r.set_attributes("c", {"gpu_utilization": 0.60, "queue_depth": 2})
    d = r.route(RouteRequest("x", tokens(2)))
    rows = {c["worker_id"]: c for c in d.candidates}
    assert set(rows) == {"b", "c"}
    # b: headroom 0.7 + queue 0 ; c: headroom 0.4 + queue 1
    assert rows["b"]["score"] == pytest.approx(0.7) and rows["c"]["score"] == pytest.approx(1.4)
    assert d.worker_id == "c"
    assert {(e.worker_id, e.filter) for e in d.excluded} == {
        ("llama", "label-selector"),
        ("a", "attribute:gpu_utilization"),
    }
    # every qwen endpoint over 90 %: fallback keeps the least loaded instead of failing
    for w in "bc":
        r.set_attributes(w, {"gpu_utilization": 0.99})
    d = r.route(RouteRequest("y", tokens(2)))
    assert d.worker_id == "a" and d.fallback

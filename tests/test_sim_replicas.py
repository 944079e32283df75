"""Router replicas in the virtual-time replay (``kvplug bench --replicas``): requests spread over
N real Routers, each hearing every engine's events, with or without kvplug.replica_sync's load
folding. With sync and no delay the replicas decide as one router does; without sync they herd;
with a realistic delay they stay within a tolerance of one router."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvplug.cli import main
from kvplug.sim.engine import EngineConfig
from kvplug.sim.policies import parse_policy
from kvplug.sim.traces import load_trace, spread_arrivals
from kvplug.sim.transport import PRESETS
from kvplug.sim.virtual import ReplayConfig, replay, summarize

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_replicas_trace.py"


@pytest.fixture(scope="module")
def slice_10min():
    return load_trace(duration_s=600)  # 1,750 requests


def _run(records, policy, **cfg):
    pol = parse_policy(policy)
    config = ReplayConfig(feed_events=pol.feed_events, pick_stats=True, **cfg)
    return replay(
        records, pol.router_config(512), config, policy=policy, router_factory=pol.router_factory()
    )


def test_with_sync_and_no_delay_replicas_decide_exactly_as_one_router(slice_10min):
    """least-loaded reads only in-flight counts, which the folding carries exactly: three
    replicas whose lifecycle reaches the others at once make one router's every decision. The
    same replicas without sync, each seeing a third of the load, do not."""
    one = _run(slice_10min, "least-loaded")
    synced = _run(slice_10min, "least-loaded", replicas=3, sync_delay_s=0.0)
    alone = _run(slice_10min, "least-loaded", replicas=3, replica_sync=False)
    picks = [r.worker_id for r in one.requests]
    assert [r.worker_id for r in synced.requests] == picks
    assert [r.first_token for r in synced.requests] == [r.first_token for r in one.requests]
    assert [r.worker_id for r in alone.requests] != picks
    s_one, s_alone = summarize(one), summarize(alone)
    assert s_one["pick_least_loaded"] > 0.99
    assert s_alone["pick_least_loaded"] < 0.7  # herding: a third of the picture
    assert s_alone["ttft_p50_s"] > s_one["ttft_p50_s"]
    # every lifecycle was shared and closed: each replica folded its two peers' events, and
    # nothing, its own or folded, is still tracked after the drain
    stats = synced.replica_stats
    assert len(stats) == 3
    published = sum(st["published_events"] for st in stats)
    assert published == 3 * len(slice_10min)  # added, first token, finished per request
    assert sum(st["applied_events"] for st in stats) == 2 * published
    assert all(st["active_requests"] == 0 and st["remote_inflight"] == 0 for st in stats)
    assert all(st["dropped_malformed"] == st["dropped_unknown_worker"] == 0 for st in stats)
    assert [st["active_requests"] for st in alone.replica_stats] == [0, 0, 0]


def test_kv_replicas_with_sync_stay_within_tolerance_of_one_router(slice_10min):
    """kv's cost also reads deduplicated prompt blocks, which a peer's request approximates
    (counted in full), so replicas are close to one router rather than equal. On arrivals
    spread over the trace's 3-second buckets, 3 replicas syncing 3 ms late keep one router's
    hit rate within 2 % (measured +1.0 %), its TTFT p99 and its least-loaded picks; without
    sync the least-loaded picks drop by a third and TTFT p99 grows (measured +22 %)."""
    recs = spread_arrivals(slice_10min)
    one = summarize(_run(recs, "kv"))
    at_once = summarize(_run(recs, "kv", replicas=3, sync_delay_s=0.0))
    synced = summarize(_run(recs, "kv", replicas=3, sync_delay_s=0.003))
    alone = summarize(_run(recs, "kv", replicas=3, replica_sync=False))
    for s in (at_once, synced):
        assert s["hit_rate"] == pytest.approx(one["hit_rate"], rel=0.02)
        assert s["ttft_p99_s"] <= one["ttft_p99_s"] * 1.05
        assert s["ttft_p50_s"] <= one["ttft_p50_s"] * 1.05
        assert s["pick_least_loaded"] >= one["pick_least_loaded"] - 0.02
        assert s["imbalance_busy"] <= one["imbalance_busy"] * 1.01
    assert alone["pick_least_loaded"] < one["pick_least_loaded"] - 0.2
    assert alone["ttft_p99_s"] > one["ttft_p99_s"] * 1.1


def test_every_replica_subscribes_to_every_engine(slice_10min):
    """Each replica has its own event link per engine, with the loss model applied per link:
    every replica receives every batch the engines publish, and loses and replays its own."""
    recs = slice_10min[:400]
    three = _run(recs, "kv", link=PRESETS["realistic"], replicas=3, replica_sync=False)
    per_replica = three.replica_stats
    batches = [st["event_batches"] for st in per_replica]
    assert batches[0] > 0 and batches == [batches[0]] * 3
    assert three.link_stats["batches"] == 3 * batches[0]
    lost = [st["event_lost"] for st in per_replica]
    assert all(n > 0 for n in lost) and len(set(lost)) > 1  # independent losses
    assert all(st["event_gaps"] > 0 and st["event_unrecovered"] == 0 for st in per_replica)


def test_disaggregated_replicas_route_both_hops_and_drain(slice_10min):
    recs = slice_10min[:300]
    res = _run(
        recs,
        "kv",
        n_prefill=4,
        replicas=3,
        sync_delay_s=0.003,
        engine=EngineConfig(),
    )
    s = summarize(res)
    assert s["completed"] == len(recs) and s["route_errors"] == 0
    assert all(
        st["active_requests"] == 0 and st["remote_inflight"] == 0 for st in res.replica_stats
    )


def test_spread_arrivals_keeps_order_counts_and_buckets():
    recs = load_trace(duration_s=60)
    spread = spread_arrivals(recs, seed=1)
    assert [r.hash_ids for r in spread] == [r.hash_ids for r in recs]
    times = [r.arrival_s for r in spread]
    assert times == sorted(times)
    buckets = sorted({r.arrival_s for r in recs})
    nxt = dict(zip(buckets, buckets[1:], strict=False))
    for before, after in zip(recs, spread, strict=True):
        assert before.arrival_s <= after.arrival_s
        if before.arrival_s in nxt:
            assert after.arrival_s < nxt[before.arrival_s]
    assert len(set(times)) > len(buckets)  # the bursts are spread
    assert spread_arrivals(recs, seed=1) == spread


def test_bench_command_runs_replicas_and_rejects_bad_options(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "--limit", "200", "--jobs", "1", "--no-progress", "--policies", "kv"]
    assert main([*argv, "--replicas", "3", "--replica-sync", "off", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kv (3 replicas, no sync)" in text and "least-loaded pick" in text
    row = json.loads(out.read_text())["results"][0]
    assert row["replicas"] == 3 and row["replica_sync"] is False
    assert main([*argv, "--replicas", "3", "--sync-delay", "0.01", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["sync_delay_s"] == 0.01 and row["replica_label"] == "3 replicas, sync 10 ms"
    assert sum(st["applied_events"] for st in row["replica_stats"]) == 2 * 3 * 200
    for bad, msg in (
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--sync-delay", "-1", "--replicas", "2"], "--sync-delay must be >= 0"),
        (["--replicas", "2", "--policies", "sglang-cache-aware"], "needs a kvplug policy"),
    ):
        assert main([*argv, *bad]) == 2
        assert msg in capsys.readouterr().err


def test_benchmark_smoke_run_writes_the_tables_and_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_replicas_trace", SCRIPT)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rt.json"
    argv = ["--duration", "120", "--delays", "0,1", "--jobs", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "### arrivals: spread" in text and "| 3 replicas, no sync |" in text
    data = json.loads(out.read_text())
    rows = data["results"]["spread"]
    assert list(rows) == [
        "one router",
        "3 replicas, no sync",
        "3 replicas, sync 0 ms",
        "3 replicas, sync 3 ms",
        "3 replicas, sync 1000 ms",
    ]
    assert "verdict" not in rows["one router"]
    verdict = rows["3 replicas, sync 0 ms"]["verdict"]
    assert set(verdict) == {
        "hit_rate_rel",
        "hit_within_2pct",
        "imbalance_no_worse",
        "ttft_p99_x",
        "ttft_p99_no_worse",
    }
    assert verdict["hit_within_2pct"] == (abs(verdict["hit_rate_rel"]) <= 0.02)

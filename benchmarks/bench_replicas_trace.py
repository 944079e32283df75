"""Router replicas replaying the conversation trace: 1 router vs N replicas with and without
load sync, and a sweep of the sync delay, in virtual time (kvplug.sim, the real Router).

Each configuration replays the whole bundled Mooncake conversation trace on 8 simulated engines:
one router (the reference), N replicas without load sync (each knows only its own requests),
and N replicas with load sync (each folds the others' added / first token / finished events,
kvplug.replica_sync's folding, ``--sync-delay`` late) at every delay of the sweep. Every replica
hears every engine's KV events through its own event link; requests go to the replicas in turn.
Two arrival patterns: the trace as stamped (~10 requests at the same millisecond every 3 s: a
burst is decided by all replicas at once) and ``spread`` (each burst spread over its 3 s).

Reported per configuration: hit rate, TTFT p50/p99, load imbalance (max/mean over engines of
routed requests and of busy time, as ``kvplug bench`` reports it) and herding: at each decision,
did the chosen engine have the fewest running + waiting requests of the fleet (how many more);
in a burst, how often two requests that different replicas route within 10 ms of each other
land on the same engine.
Verdicts against one router in the same run: hit rate within 2 % (relative), imbalance no
worse (1 % slack), TTFT p99 no worse (5 % slack).

    python benchmarks/bench_replicas_trace.py                       # ~2 min on 2 cores
    python benchmarks/bench_replicas_trace.py --policy affinity --realism realistic
    python benchmarks/bench_replicas_trace.py --smoke                # seconds: a small slice
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.sim.bench import BenchSpec  # noqa: E402
from kvplug.sim.policies import parse_policy  # noqa: E402
from kvplug.sim.steptime import capacity_blocks  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402
from kvplug.sim.virtual import replay, summarize  # noqa: E402

OUT = Path(__file__).parent / "results" / "bench_replicas_trace.json"
REALISTIC_DELAY_S = 0.003  # LoadSync's 1 ms batching + a NATS hop inside a datacenter
SWEEP_S = (0.0, 0.001, 0.01, 0.1, 1.0)
HIT_TOLERANCE = 0.02  # relative
IMBALANCE_SLACK = 0.01
P99_SLACK = 0.05
CO_PICK_WINDOW_S = 0.01
MIN_CO_PICK_PAIRS = 200
KEYS = (
    "hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "imbalance_requests",
    "imbalance_busy",
    "pick_least_loaded",
    "pick_excess_mean",
    "pick_excess_p99",
    "co_pick_same_engine",
    "co_pick_pairs",
    "completed",
    "wall_s",
)


def configurations(base: BenchSpec, replicas: int, delays: list[float]) -> list[BenchSpec]:
    """One router, replicas without sync, then with sync at every delay (the realistic one
    included), shortest first."""
    specs = [replace(base, replicas=1), replace(base, replicas=replicas, replica_sync=False)]
    specs += [
        replace(base, replicas=replicas, replica_sync=True, sync_delay_s=d)
        for d in sorted({*delays, REALISTIC_DELAY_S})
    ]
    return specs


def label(spec: BenchSpec) -> str:
    return spec.replica_label() or "one router"


def co_picks(requests: list, partition: int, window_s: float = CO_PICK_WINDOW_S) -> dict:
    """Herding inside a burst: of the pairs of requests arriving within ``window_s`` of each
    other that different replicas route (request i goes to replica i mod ``partition``; for one
    router the same split), the share sent to the same engine (1/engines if placed at random)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    same = pairs = 0
    start = 0
    for b, j in enumerate(order):
        rj = requests[j]
        while requests[order[start]].arrival < rj.arrival - window_s:
            start += 1
        for i in order[start:b]:
            if i % partition != j % partition and not requests[i].rejected and not rj.rejected:
                pairs += 1
                same += requests[i].worker_id == rj.worker_id
    return {"co_pick_pairs": pairs, "co_pick_same_engine": same / pairs if pairs else 0.0}


def _run(job: tuple[str, BenchSpec, str, int]) -> tuple[str, str, dict]:
    arrivals, spec, policy, partition = job
    pol = parse_policy(policy)
    res = replay(
        spec.records(),
        pol.router_config(spec.block_tokens),
        spec.replay_config(pol.feed_events),
        policy=policy,
        router_factory=pol.router_factory(),
    )
    out = summarize(res) | co_picks(res.requests, partition)
    return arrivals, label(spec), {k: out[k] for k in KEYS} | {"replica_stats": res.replica_stats}


def verdicts(row: dict, ref: dict) -> dict:
    hit_rel = row["hit_rate"] / ref["hit_rate"] - 1 if ref["hit_rate"] else 0.0
    return {
        "hit_rate_rel": hit_rel,
        "hit_within_2pct": abs(hit_rel) <= HIT_TOLERANCE,
        "imbalance_no_worse": row["imbalance_requests"]
        <= ref["imbalance_requests"] * (1 + IMBALANCE_SLACK)
        and row["imbalance_busy"] <= ref["imbalance_busy"] * (1 + IMBALANCE_SLACK),
        "ttft_p99_x": row["ttft_p99_s"] / ref["ttft_p99_s"] if ref["ttft_p99_s"] else None,
        "ttft_p99_no_worse": row["ttft_p99_s"] <= ref["ttft_p99_s"] * (1 + P99_SLACK),
    }


def co_pick_cell(row: dict) -> str:
    if row["co_pick_pairs"] < MIN_CO_PICK_PAIRS:  # spread arrivals: hardly any bursts left
        return f"– ({row['co_pick_pairs']} pairs)"
    return f"{row['co_pick_same_engine']:.1%}"


def table(rows: dict[str, dict]) -> str:
    head = (
        "| configuration | hit % | vs one router | TTFT p50 s | TTFT p99 s | imb req | imb busy "
        "| least-loaded pick % | excess mean | same engine in a burst % |"
    )
    lines = [head, "|---|" + "---:|" * 9]
    for name, r in rows.items():
        v = r.get("verdict")
        vs = "reference" if v is None else f"{v['hit_rate_rel']:+.1%}"
        lines.append(
            f"| {name} | {r['hit_rate']:.1%} | {vs} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p99_s']:.2f} | {r['imbalance_requests']:.3f} | {r['imbalance_busy']:.3f} | "
            f"{r['pick_least_loaded']:.1%} | {r['pick_excess_mean']:.2f} | "
            f"{co_pick_cell(r)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="kv", help="kvplug policy (kvplug bench syntax)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument(
        "--delays",
        default=",".join(f"{d:g}" for d in SWEEP_S),
        help="sync delays swept, seconds (the realistic 0.003 always runs)",
    )
    ap.add_argument("--arrivals", default="trace,spread", help="trace, spread or both")
    ap.add_argument("--realism", choices=sorted(PRESETS), default="ideal")
    ap.add_argument("--duration", type=float, default=None, help="trace slice, seconds")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a 10-minute slice")
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    if args.smoke and args.duration is None:
        args.duration = 600.0
    delays = [float(x) for x in args.delays.split(",") if x]
    patterns = [a for a in args.arrivals.split(",") if a]
    if not set(patterns) <= {"trace", "spread"} or not patterns:
        ap.error("--arrivals: trace, spread or trace,spread")
    base = BenchSpec(
        policies=[args.policy],
        n_engines=args.engines,
        duration_s=args.duration,
        capacity_blocks=capacity_blocks(512),
        link=PRESETS[args.realism],
        pick_stats=True,
    )
    jobs = [
        (arrivals, spec, args.policy, args.replicas)
        for arrivals in patterns
        for spec in configurations(
            replace(base, spread_arrivals=arrivals == "spread"), args.replicas, delays
        )
    ]
    n_requests = len(base.records())
    print(
        f"{len(jobs)} replays of {n_requests} requests ({args.policy}, {args.engines} engines, "
        f"{args.realism} view), {args.jobs} process(es)",
        flush=True,
    )
    t0 = time.perf_counter()
    results: dict[str, dict[str, dict]] = {a: {} for a in patterns}
    pool = mp.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        done = pool.imap_unordered(_run, jobs) if pool is not None else map(_run, jobs)
        for n, (arrivals, name, row) in enumerate(done, 1):
            results[arrivals][name] = row
            print(
                f"[{n}/{len(jobs)} {time.perf_counter() - t0:5.0f} s] {arrivals:6s} {name:28s} "
                f"hit {row['hit_rate']:.2%}  TTFT p50 {row['ttft_p50_s']:.3f} p99 "
                f"{row['ttft_p99_s']:.2f}  imb {row['imbalance_requests']:.3f}",
                flush=True,
            )
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    ordered: dict[str, dict[str, dict]] = {}
    for arrivals in patterns:  # table order: reference, no sync, realistic, then the sweep
        names = [label(s) for s in configurations(base, args.replicas, delays)]
        rows = {name: results[arrivals][name] for name in names}
        ref = rows["one router"]
        for name, row in rows.items():
            if name != "one router":
                row["verdict"] = verdicts(row, ref)
        ordered[arrivals] = rows
        print(f"\n### arrivals: {arrivals}\n\n{table(rows)}")
        print(
            f"\nsame engine in a burst: over the {ref['co_pick_pairs']} pairs of requests "
            f"arriving within {CO_PICK_WINDOW_S * 1000:g} ms of each other that different "
            f"replicas route (1 in {args.engines} at random)"
        )
    report = {
        "spec": asdict(base) | {"replicas": args.replicas, "delays_s": delays},
        "policy": args.policy,
        "realism": args.realism,
        "requests": n_requests,
        "tolerances": {
            "hit_rate_rel": HIT_TOLERANCE,
            "imbalance_slack": IMBALANCE_SLACK,
            "ttft_p99_slack": P99_SLACK,
        },
        "results": ordered,
        "wall_s": time.perf_counter() - t0,
        "host": {"python": platform.python_version(), "cpus": mp.cpu_count()},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=float) + "\n")
        print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Routing as the load nears what the fleet can serve: does a policy keep the fleet out of overload?

A fleet that serves a load only by keeping its caches (tool loops whose prompts grow by long tool
results: most of each prompt is the session's own history) has two states near saturation:
cache hits keep the work low and the queues short, or requests moved to balance the queues
recompute their histories, the work grows, the queues lengthen and more requests are moved. This
replays a generated agentic workload (``agentic:user=3000,systems=32``: 20 turns of ~3,000
tokens of tool results a session on average, 32 tool sets of 8,192 tokens) at rising session
rates on ``kvplug bench``'s fleet (8 engines of 1,640 blocks), every policy on the same
requests, and prints each one's hit rate as a share of the one-shared-LRU bound and its TTFT
p99 per rate. Beside the default run three earlier ones:

* before issue 14's forty-fourth pass, ``affinity-fitted:hold_inflight=false`` (a follow-up
  whose last turn still waited in an engine's queue looked cold to it);
* before its forty-third, ``...:hold_share=0,hold_inflight=false`` (no saturation hold: requests
  still moved off their caches for shorter queues when the whole fleet was behind);
* before its forty-second, ``...:rescue_idle=false,hold_share=0,hold_inflight=false`` (its tail
  rescue also went to engines with prefills queued).

    python benchmarks/bench_saturation.py                           # ~10 min on 2 cores
    python benchmarks/bench_saturation.py --view ideal --rates 0.9 1.0 1.1
    python benchmarks/bench_saturation.py --workload-seeds 0 1 2    # the workload drawn again

Prints a Markdown table per rate; writes ``benchmarks/results/saturation.json`` and plots hit
rate and TTFT p99 against the rate (``docs/img/saturation.png``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_routing_quality import beaten_by  # noqa: E402

from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402

DEFAULT = "affinity-fitted"
BEFORE = "affinity-fitted:hold_inflight=false"  # the default before issue 14's forty-fourth pass
# ... before its forty-third, and before its forty-second
BEFORE_43 = "affinity-fitted:hold_share=0,hold_inflight=false"
BEFORE_42 = "affinity-fitted:rescue_idle=false,hold_share=0,hold_inflight=false"
POLICIES = [
    DEFAULT,
    BEFORE,
    BEFORE_43,
    BEFORE_42,
    "affinity-balance",
    "kv",
    "sglang-cache-aware",
    "smg-cache-aware",
    "vllm-kv-aware",
    "round-robin",
]
WORKLOAD = "agentic:user=3000,systems=32"
RATES = [0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5]


def run_rate(workload: str, rate: float, wseed: int, view: str, steptime: str, policies) -> dict:
    spec = BenchSpec(
        policies=list(policies),
        workload=f"{workload},session_rate={rate},seed={wseed}",
        link=PRESETS[view],
        steptime=steptime,
    )
    t0 = time.perf_counter()
    report = run_bench(spec, jobs=2, progress=False)
    bound = report["trace"]["fleet_lru_hit_rate"]
    rows = [
        {
            "policy": r["policy"],
            "hit_rate": r["hit_rate"],
            "share_of_bound": r["hit_rate"] / bound,
            "ttft_p50_s": r["ttft_p50_s"],
            "ttft_p99_s": r["ttft_p99_s"],
            "prefill_tokens": r["prefill_tokens"],
        }
        for r in report["results"]
    ]
    return {
        # named as the routing-quality runs are, so frontier_lead.py reads them alike
        "workload": f"{workload},session_rate={rate:g} workload seed {wseed}",
        "view": view,
        "steptime": steptime,
        "session_rate": rate,
        "workload_seed": wseed,
        "requests": report["trace"]["requests"],
        "bound": bound,
        "results": rows,
        "beaten_by": beaten_by(report["results"], DEFAULT),
        "wall_s": time.perf_counter() - t0,
    }


def table(run: dict) -> str:
    lines = [
        f"\n### session rate {run['session_rate']:g}/s, workload seed {run['workload_seed']}: "
        f"{run['requests']:,} requests, one-shared-LRU bound {run['bound']:.1%}",
        "| policy | hit % (of the bound) | TTFT p50 s | TTFT p99 s | prefilled M tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in run["results"]:
        lines.append(
            f"| {r['policy']} | {r['hit_rate']:.1%} ({r['share_of_bound']:.1%}) "
            f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['prefill_tokens'] / 1e6:.1f} |"
        )
    beaten = ", ".join(run["beaten_by"]) or "none"
    lines.append(f"the default beaten on both axes by: {beaten}")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if r["workload_seed"] == doc["workload_seeds"][0]]
    rates = [r["session_rate"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    by_policy = [{row["policy"]: row for row in r["results"]} for r in runs]
    for p in doc["policies"]:
        style = (
            {"lw": 2.6}
            if p == DEFAULT
            else {
                "lw": 1.2,
                "ls": "--" if p == BEFORE else ":" if p in (BEFORE_43, BEFORE_42) else "-",
            }
        )
        share = [by[p]["share_of_bound"] * 100 for by in by_policy]
        left.plot(rates, share, marker="o", label=p, **style)
        right.plot(rates, [by[p]["ttft_p99_s"] for by in by_policy], marker="o", label=p, **style)
    left.set_xlabel("new sessions per second")
    left.set_ylabel("hit rate, % of the one-shared-LRU bound")
    right.set_xlabel("new sessions per second")
    right.set_ylabel("TTFT p99, s (log)")
    right.set_yscale("log")
    right.legend(fontsize=7)
    fig.suptitle(
        f"{doc['workload']} on 8 engines, {doc['view']} view, {doc['steptime']} end "
        f"(workload seed {doc['workload_seeds'][0]})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--rates", nargs="+", type=float, default=RATES)
    ap.add_argument("--workload-seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--view", default="realistic", choices=list(PRESETS))
    ap.add_argument("--steptime", default="causal")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--json", default="benchmarks/results/saturation.json")
    ap.add_argument("--plot", default="docs/img/saturation.png", help="'' = none")
    ap.add_argument(
        "--plot-only", action="store_true", help="replay nothing: draw --plot from --json"
    )
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.json).read_text()), Path(args.plot))
        print(f"plot: {args.plot}")
        return 0
    if DEFAULT not in args.policies:
        ap.error(f"--policies: the default ({DEFAULT}) is what the benchmark judges")
    t0 = time.perf_counter()
    runs = []
    total = len(args.rates) * len(args.workload_seeds)
    for wseed in args.workload_seeds:
        for rate in args.rates:
            print(f"[{len(runs) + 1}/{total}] session rate {rate:g}, seed {wseed} ...", flush=True)
            run = run_rate(args.workload, rate, wseed, args.view, args.steptime, args.policies)
            print(table(run), flush=True)
            runs.append(run)
    doc = {
        "workload": args.workload,
        "view": args.view,
        "steptime": args.steptime,
        "engines": 8,
        "policies": args.policies,
        "workload_seeds": args.workload_seeds,
        "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json} ({doc['wall_s'] / 60:.1f} min)")
    if args.plot:
        plot(doc, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

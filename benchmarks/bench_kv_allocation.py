"""How much the simulator's KV reservation moves the routing figures: the replay as it runs
(``kv_allocation="reserve"``: a request's prompt and requested output reserved at admission,
nothing preempted) against engines that allocate KV as vLLM 0.32.0 does (``"vllm"``: admitted
when the whole prompt fits, blocks allocated as computed, the latest admitted request preempted
and recomputed when a running one cannot grow; checked against a real engine in
``tests/test_sim_scheduler_real_vllm.py``).

The conversation trace on ``kvplug bench``'s fleet, on a fleet with less KV per engine and at
1.5x the load, both router views, both prefill-cost ends; the two allocations replay the same
requests with the same seed, one after the other. Per run: the default's share of the
one-shared-LRU bound and TTFT p99 against kv's under each, whether it meets issue 14's bar,
the preemptions, and the policy whose hit rate moved most.

    python benchmarks/bench_kv_allocation.py            # ~8 min on 2 cores
    python benchmarks/bench_kv_allocation.py --conditions bench --views ideal

Prints a Markdown table; writes ``benchmarks/results/kv_allocation.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_fleet_conditions import DEFAULT, verdicts  # noqa: E402

from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.policies import DEFAULT_POLICIES  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402

CONDITIONS = {
    "bench": ("as kvplug bench runs it", {}),
    "small": ("1,000 blocks per engine", {"capacity_blocks": 1000}),
    "busy": ("load 1.5x", {"speedup": 1.5}),
}
ALLOCATIONS = ("reserve", "vllm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=list(CONDITIONS))
    ap.add_argument("--views", nargs="+", choices=list(PRESETS), default=["ideal", "realistic"])
    ap.add_argument("--steptime", nargs="+", default=["causal", "cached"])
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/kv_allocation.json")
    args = ap.parse_args(argv)
    todo = [(c, v, s) for c in args.conditions for v in args.views for s in args.steptime]
    runs = []
    t0 = time.perf_counter()
    for i, (cond, view, st) in enumerate(todo, 1):
        label, fields = CONDITIONS[cond]
        by_alloc = {}
        for alloc in ALLOCATIONS:
            print(f"[{i}/{len(todo)}] {label}, {view}, {st}, {alloc} ...", flush=True)
            spec = BenchSpec(
                policies=list(args.policies),
                link=PRESETS[view],
                steptime=st,
                kv_allocation=alloc,
                **fields,
            )
            report = run_bench(spec, jobs=args.jobs, progress=False)
            by_alloc[alloc] = {
                **verdicts(report, [DEFAULT]),
                "results": [
                    {k: v for k, v in r.items() if k not in ("series", "router_index")}
                    for r in report["results"]
                ],
            }
        runs.append({"condition": label, "view": view, "steptime": st, **by_alloc})
    wall = time.perf_counter() - t0
    print()
    print(table(runs))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "wall_s": wall}, indent=1) + "\n")
    print(f"\nJSON: {out}; {wall:.0f} s")
    return 0


def moved_most(run: dict) -> tuple[str, float]:
    """The policy whose hit rate changed most from reserve to vllm, and by how many points."""
    before = {r["policy"]: r["hit_rate"] for r in run["reserve"]["results"]}
    after = {r["policy"]: r["hit_rate"] for r in run["vllm"]["results"]}
    policy = max(after, key=lambda p: abs(after[p] - before[p]))
    return policy, 100 * (after[policy] - before[policy])


def table(runs: list[dict]) -> str:
    lines = [
        f"| condition | view | steptime | {DEFAULT}, reserve | {DEFAULT}, vllm "
        "| preemptions (default / kv) | hit rate moved most |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for run in runs:
        cells = []
        for alloc in ALLOCATIONS:
            v = run[alloc]["verdicts"][DEFAULT]
            text = f"{100 * v['share_of_bound']:.1f}% / {v['ttft_p99_vs_kv']:.4f}×"
            cells.append(f"**{text}**" if run[alloc]["meets_bar"] else text)
        pre = {r["policy"]: r["preemptions"] for r in run["vllm"]["results"]}
        policy, points = moved_most(run)
        lines.append(
            f"| {run['condition']} | {run['view']} | {run['steptime']} | {cells[0]} | {cells[1]} "
            f"| {pre[DEFAULT]} / {pre['kv']} | {policy} {points:+.2f} points |"
        )
    for alloc in ALLOCATIONS:
        met = sum(r[alloc]["meets_bar"] for r in runs)
        lines.append(f"\n{alloc}: {DEFAULT} meets the bar (bold) in {met} of {len(runs)} runs.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

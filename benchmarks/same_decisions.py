"""Do two routing settings decide alike on the replays behind the README's routing figures?

A change meant to be inert where its condition does not arise (``fit_speeds`` on a fleet whose
engines are alike, the fit's floor on first tokens no cache explains) is checked here: both
settings replay every homogeneous run the README's routing figures come from, in the same
process and with the same seeds, and a run counts as the same when hit rate, TTFT p50 and p99,
E2E p99 and prefilled tokens agree to the last digit. The runs: the whole trace with six replay
seeds in the ideal and the realistic view, the host tier with four, the trace shapes
(bench_routing_quality.py's five, the conversation trace with four arrival seeds, both views,
both prefill-cost ends), Mooncake's synthetic trace with eight arrival seeds (both views, both
ends), the fleet conditions with four replay seeds (bench_fleet_conditions.py's), the decisions
bench_dynamo_replay.py judges (the conversation trace on 8, 4 and 6 engines, the synthetic
trace, the realistic view; at the mocker's timing and both H200 ends), and the demo.

    python benchmarks/same_decisions.py                    # ~9 min on 2 cores
    python benchmarks/same_decisions.py --only whole       # runs whose name contains "whole"

Prints one line per run; writes ``benchmarks/results/same_decisions_fit_speeds.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout
sys.path.insert(0, str(HERE))

import bench_fleet_conditions as fleet  # noqa: E402
import bench_routing_quality as shapes  # noqa: E402

from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402

SYNTHETIC = "benchmarks/data/mooncake_synthetic_trace.jsonl.gz"
COMPARED = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "prefill_tokens")


def runs() -> list[tuple[str, dict]]:
    """(name, BenchSpec fields) of every run compared."""
    out: list[tuple[str, dict]] = []
    for view in ("ideal", "realistic"):
        out += [
            (f"whole trace, {view}, seed {s}", {"link": PRESETS[view], "seed": s}) for s in range(6)
        ]
    out += [(f"host tier, seed {s}", {"host_capacity_blocks": 3280, "seed": s}) for s in range(4)]
    for st in ("causal", "cached"):
        for view in ("ideal", "realistic"):
            named = [("conversation", s) for s in range(4)]
            named += [(w, 0) for w in ("multi-turn", "agentic", "shared-prefix", "doc-qa")]
            for name, seed in named:
                spec = {"workload": shapes.WORKLOADS.get(name), "link": PRESETS[view]}
                spec |= {"steptime": st, "spread_arrivals": seed > 0, "seed": seed}
                out.append((f"shape {name}, arrival seed {seed}, {view}, {st}", spec))
            for seed in range(8):
                spec = {"trace": SYNTHETIC, "link": PRESETS[view], "steptime": st}
                spec |= {"spread_arrivals": seed > 0, "seed": seed}
                out.append((f"synthetic, arrival seed {seed}, {view}, {st}", spec))
    for seed in range(4):
        for label, cond in fleet.CONDITIONS:
            for st in ("causal", "cached"):
                spec = {"link": PRESETS["realistic"], "steptime": st, "seed": seed, **cond}
                out.append((f"fleet: {label}, {st}, seed {seed}", spec))
    for st in ("mocker", "causal", "cached"):
        for n in (8, 4, 6):
            out.append((f"dynamo replay: {n} engines, {st}", {"n_engines": n, "steptime": st}))
        out.append((f"dynamo replay: synthetic, {st}", {"trace": SYNTHETIC, "steptime": st}))
        realistic = {"steptime": st, "link": PRESETS["realistic"]}
        out.append((f"dynamo replay: realistic view, {st}", realistic))
    out.append(("demo", {"n_engines": 4, "duration_s": 1200.0}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--policies", nargs=2, default=["affinity-fitted", "affinity-fitted:fit_speeds=0"]
    )
    ap.add_argument("--only", default="", help="runs whose name contains this")
    ap.add_argument("--json", default=str(HERE / "results" / "same_decisions_fit_speeds.json"))
    args = ap.parse_args(argv)
    todo = [(name, spec) for name, spec in runs() if args.only in name]
    t0 = time.perf_counter()
    out = []
    for i, (name, spec) in enumerate(todo, 1):
        report = run_bench(BenchSpec(policies=list(args.policies), **spec), jobs=2, progress=False)
        a, b = report["results"]
        differ = {k: [a[k], b[k]] for k in COMPARED if a[k] != b[k]}
        out.append({"run": name, "same": not differ, "differ": differ})
        said = "same" if not differ else f"DIFFERENT {differ}"
        print(f"[{i}/{len(todo)} {time.perf_counter() - t0:.0f} s] {name}: {said}", flush=True)
    same = sum(r["same"] for r in out)
    print(f"{args.policies[0]} and {args.policies[1]}: the same in {same} of {len(out)} runs")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "policies": args.policies,
                    "compared": COMPARED,
                    "same": same,
                    "runs": out,
                    "wall_s": time.perf_counter() - t0,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

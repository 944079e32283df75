"""The default routing under fleet conditions nothing was tuned on, beside the baselines.

The conversation trace replayed with one condition changed at a time from ``kvplug bench``'s
(8 engines of 1,640 blocks, 8,192 batched tokens, the trace's own arrival rate): the load
(arrivals compressed or stretched), the KV capacity per engine, the fleet size and the
scheduler's token budget, at both ends of the prefill cost, in one router view. Per run: each
policy's hit rate as a share of the one-shared-LRU bound and its TTFT p99 against kv's, whether
the default meets issue 14's bar (>= 95 % of the bound, p99 <= kv's) and which policies, if
any, beat it on both axes at once (more hits and a TTFT p99 no higher).

    python benchmarks/bench_fleet_conditions.py                       # ~2.5 min on 2 cores
    python benchmarks/bench_fleet_conditions.py --view ideal --steptime causal
    python benchmarks/bench_fleet_conditions.py --seeds 1 2 3   # each run at three replay seeds
    python benchmarks/bench_fleet_conditions.py --conditions mixed    # engines of mixed speeds

Prints a Markdown table; writes ``benchmarks/results/fleet_conditions{,_mixed}.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_routing_quality import add_engine_options, beaten_by  # noqa: E402

from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402

DEFAULT = "affinity-fitted"
PREVIOUS_DEFAULT = "affinity-balance"  # the default before issue 14's twenty-fourth pass
POLICIES = [
    DEFAULT,
    PREVIOUS_DEFAULT,
    "kv",
    "sglang-cache-aware",
    "smg-cache-aware",
    "vllm-kv-aware",
]
# (label, BenchSpec fields): one change at a time from kvplug bench's fleet
CONDITIONS: list[tuple[str, dict]] = [
    ("as kvplug bench runs it", {}),
    ("load 0.8x (arrivals stretched)", {"speedup": 0.8}),
    ("load 1.25x", {"speedup": 1.25}),
    ("load 1.5x", {"speedup": 1.5}),
    ("1,000 blocks per engine", {"capacity_blocks": 1000}),
    ("2,500 blocks per engine", {"capacity_blocks": 2500}),
    ("4 engines", {"n_engines": 4}),
    ("6 engines", {"n_engines": 6}),
    ("12 engines", {"n_engines": 12}),
    ("16 engines", {"n_engines": 16}),
    ("4,096 batched tokens", {"max_batched_tokens": 4096}),
    ("16,384 batched tokens", {"max_batched_tokens": 16384}),
]
# --conditions mixed: engines of different speeds (other GPUs, other parallelism), each one's
# step times the H200 model's times a factor; and every engine slower alike, where the default
# must route as one model does
ONE_MODEL = "affinity-fitted:fit_speeds=0"  # the default with one prefill model for all engines
MIXED_CONDITIONS: list[tuple[str, dict]] = [
    ("every engine at 2x step time (alike)", {"slowdowns": (2.0,)}),
    ("half the engines at 1.25x step time", {"slowdowns": (1.0, 1.25)}),
    ("half the engines at 1.5x", {"slowdowns": (1.0, 1.5)}),
    ("half the engines at 2x", {"slowdowns": (1.0, 2.0)}),
    ("one engine in eight at 2x", {"slowdowns": (1.0,) * 7 + (2.0,)}),
    ("a quarter of the engines at 3x", {"slowdowns": (1.0, 1.0, 1.0, 3.0)}),
    ("eight speeds, 0.7x to 1.5x", {"slowdowns": (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5)}),
]
CONDITION_SETS = {"standard": CONDITIONS, "mixed": MIXED_CONDITIONS}


def verdicts(report: dict, policies: list[str]) -> dict:
    bound = report["trace"]["fleet_lru_hit_rate"]
    by = {r["policy"]: r for r in report["results"]}
    kv_p99 = by["kv"]["ttft_p99_s"]
    out = {
        p: {
            "share_of_bound": by[p]["hit_rate"] / bound,
            "ttft_p99_vs_kv": by[p]["ttft_p99_s"] / kv_p99,
        }
        for p in policies
    }
    return {
        "bound": bound,
        "verdicts": out,
        "meets_bar": out[DEFAULT]["share_of_bound"] >= 0.95
        and out[DEFAULT]["ttft_p99_vs_kv"] <= 1.0,
        "beaten_by": [p for p in beaten_by(report["results"], DEFAULT) if p in policies],
    }


def table(runs: list[dict], policies: list[str]) -> str:
    head = "| condition | steptime | " + " | ".join(policies) + " | beaten by |"
    lines = [head, "|---|---|" + "---:|" * len(policies) + "---|"]
    for run in runs:
        cells = []
        for p in policies:
            v = run["verdicts"][p]
            text = f"{100 * v['share_of_bound']:.1f}% / {v['ttft_p99_vs_kv']:.3f}×"
            cells.append(f"**{text}**" if p == DEFAULT and run["meets_bar"] else text)
        beaten = ", ".join(run["beaten_by"]) or "none"
        lines.append(
            f"| {run['condition']} | {run['steptime']} | " + " | ".join(cells) + f" | {beaten} |"
        )
    met = sum(r["meets_bar"] for r in runs)
    lines.append(
        f"\n{DEFAULT} meets the bar (bold) in {met} of {len(runs)} runs; beaten on both "
        f"axes in {sum(bool(r['beaten_by']) for r in runs)}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--view", default="realistic", choices=list(PRESETS))
    ap.add_argument("--steptime", nargs="+", default=["causal", "cached"])
    ap.add_argument(
        "--conditions",
        default="standard",
        choices=list(CONDITION_SETS),
        help="standard: one fleet change at a time; mixed: engines of different speeds (with "
        f"{ONE_MODEL} beside the default)",
    )
    ap.add_argument("--policies", nargs="+", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="replay seeds (the tie-breaks between equally priced engines): each condition is "
        "run once per seed",
    )
    ap.add_argument(
        "--json", default=None, help="default benchmarks/results/fleet_conditions{,_mixed}.json"
    )
    add_engine_options(ap)
    args = ap.parse_args(argv)
    if args.policies is None:
        args.policies = list(POLICIES)
        if args.conditions == "mixed":
            args.policies.insert(1, ONE_MODEL)
    if args.json is None:
        suffix = "" if args.conditions == "standard" else f"_{args.conditions}"
        args.json = f"benchmarks/results/fleet_conditions{suffix}.json"
    for needed in (DEFAULT, "kv"):
        if needed not in args.policies:
            ap.error(f"--policies must include {needed}")
    t0 = time.perf_counter()
    runs = []
    todo = [
        (label, c, st, seed)
        for seed in args.seeds
        for label, c in CONDITION_SETS[args.conditions]
        for st in args.steptime
    ]
    for i, (label, cond, st, seed) in enumerate(todo, 1):
        named = label if seed == 0 else f"{label}, replay seed {seed}"
        print(f"[{i}/{len(todo)}] {named}, {st} ...", flush=True)
        spec = BenchSpec(
            policies=list(args.policies),
            link=PRESETS[args.view],
            steptime=st,
            seed=seed,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
            kv_allocation=args.kv_allocation,
            **cond,
        )
        report = run_bench(spec, jobs=args.jobs, progress=False)
        runs.append(
            {
                "condition": named,
                "fleet": cond,
                "steptime": st,
                "view": args.view,
                "seed": seed,
                **verdicts(report, args.policies),
            }
        )
    print()
    print(table(runs, args.policies))
    wall = time.perf_counter() - t0
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"args": vars(args), "runs": runs, "wall_s": wall}, indent=1) + "\n"
        )
        print(f"JSON: {out}")
    print(f"total wall time {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Routed prompts as a side index, two source trees side by side: the same replays, route time.

The side index (approximate mode, and ``--router-predicted-ttl-secs`` beside the events) records
every routed prompt and drops it when its TTL runs out. This replays the whole conversation
trace in the realistic router view with ``approx`` and with the default routing plus a 2 s
predicted TTL, once per tree and round, the trees taking turns (the order flips every round),
each in a fresh process; it checks the two trees decide alike (hit rate and TTFT p99 equal) and
reports each tree's mean ``Router.route`` time (wall, µs) and their ratio per round.

    python benchmarks/ab_approx_record.py --base /path/to/previous/tree --new . [--rounds 4]

Each tree must be built in place (``python setup.py build_ext --inplace``). Prints a table;
writes JSON (default ``benchmarks/results/ab_approx_record.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

POLICIES = ["approx", "affinity-fitted:router_predicted_ttl_secs=2"]
ONE_TREE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import kvplug.approx
assert kvplug.approx.__file__.startswith(sys.argv[1]), kvplug.approx.__file__
from kvplug.sim.bench import BenchSpec, run_policy
from kvplug.sim.transport import PRESETS
out = {}
for policy in sys.argv[2:]:
    spec = BenchSpec(policies=[policy], link=PRESETS["realistic"], steptime="causal")
    r = run_policy(spec, policy)
    out[policy] = {k: r[k] for k in ("hit_rate", "ttft_p99_s", "route_us_mean")}
print(json.dumps(out))
"""


def run_tree(tree: str) -> dict:
    text = subprocess.check_output(
        [sys.executable, "-c", ONE_TREE, str(Path(tree).resolve()), *POLICIES],
        cwd="/",  # nothing on the path but the tree given
        text=True,
    )
    return json.loads(text.strip().splitlines()[-1])


def span(values: list[float], digits: int) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the previous source tree, built in place")
    ap.add_argument("--new", default=".", help="the tree to compare, built in place")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results" / "ab_approx_record.json"),
    )
    args = ap.parse_args(argv)
    trees = {"base": args.base, "new": args.new}
    res: dict[str, list[dict]] = {"base": [], "new": []}
    for rnd in range(args.rounds):
        for name in list(trees) if rnd % 2 == 0 else list(trees)[::-1]:
            res[name].append(run_tree(trees[name]))
            times = {p: round(v["route_us_mean"], 1) for p, v in res[name][-1].items()}
            print(f"round {rnd + 1}/{args.rounds} {name}: route µs {times}", flush=True)
    print("\n| policy | same decisions | base µs | new µs | base/new by round |")
    print("|---|---|---|---|---|")
    summary = {}
    for p in POLICIES:
        base = [r[p] for r in res["base"]]
        new = [r[p] for r in res["new"]]
        same = all(
            b["hit_rate"] == n["hit_rate"] and b["ttft_p99_s"] == n["ttft_p99_s"]
            for b, n in zip(base, new, strict=True)
        )
        ratios = [b["route_us_mean"] / n["route_us_mean"] for b, n in zip(base, new, strict=True)]
        summary[p] = {"same_decisions": same, "ratios": ratios}
        print(
            f"| {p} | {'yes' if same else 'NO'} | {span([b['route_us_mean'] for b in base], 1)} "
            f"| {span([n['route_us_mean'] for n in new], 1)} | {span(ratios, 2)} |"
        )
    Path(args.out).write_text(
        json.dumps({"trees": trees, "rounds": res, "summary": summary}, indent=1) + "\n"
    )
    print(f"JSON: {args.out}")
    return 0 if all(s["same_decisions"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

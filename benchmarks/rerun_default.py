"""Replay the default routing (or a setting of it) again in a results file, in place of its rows.

Every replay is deterministic and each policy replays on its own (``run_policy``: its own
router, engines and event links), so a change to the default routing changes only the default's
rows of the routing results the README, ``docs/results.md`` and ``frontier_lead.py`` read. This
runs the benchmark that wrote FILE again with ``--policies <default> kv`` into a scratch file
and, run by run, puts the default's new figures in place of its old ones and derives again what
depends on them (the verdicts, who beats the default, whether it meets the bar). kv runs beside
it as the check that the two files line up: its figures must come out exactly as stored (the
same runs, replayed alike), or nothing is written. The file keeps a record of each such rerun
(``default_reruns``: the build, the command, the time).

    # bench_routing_quality.py results: the command that wrote FILE (without --policies,
    # --json and --plots), after --
    python benchmarks/rerun_default.py benchmarks/results/routing_quality_aiperf.json -- \\
        python benchmarks/bench_routing_quality.py --trace prefix-x2=... --spread-seeds 0 1 2 3
    # bench_fleet_conditions.py results record their arguments: no command needed
    python benchmarks/rerun_default.py benchmarks/results/fleet_conditions_fitted_seeds.json

Prints what changed per run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # run from a checkout

from bench_routing_quality import beaten_by, verdict  # noqa: E402

from kvplug.sim.bench import add_vs_round_robin  # noqa: E402

DEFAULT = "affinity-fitted"
CHECK = "kv"  # unchanged by a change to the default: must replay exactly as stored
# run fields that name a run (both files must have the same runs in the same order)
RUN_KEYS = (
    "workload",
    "spread_seed",
    "view",
    "steptime",
    "workload_seed",
    "long_prefill_token_threshold",
    "kv_allocation",
    "condition",
    "seed",
)


def git_head() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def fleet_command(doc: dict, policy: str, scratch: str) -> list[str]:
    """bench_fleet_conditions.py's command line from the arguments its file records."""
    a = doc["args"]
    cmd = [sys.executable, str(HERE / "bench_fleet_conditions.py"), "--view", a["view"]]
    cmd += ["--steptime", *a["steptime"], "--conditions", a.get("conditions", "standard")]
    policies = [policy, CHECK] + ([DEFAULT] if policy != DEFAULT else [])  # the script judges it
    cmd += ["--seeds", *map(str, a["seeds"]), "--policies", *policies, "--json", scratch]
    if a.get("long_prefill_token_threshold"):
        cmd += ["--long-prefill-token-threshold", str(a["long_prefill_token_threshold"])]
    if a.get("long_prefill_token_threshold_adaptive"):
        cmd += ["--long-prefill-token-threshold-adaptive"]
    if a.get("kv_allocation", "reserve") != "reserve":
        cmd += ["--kv-allocation", a["kv_allocation"]]
    return cmd


def same_run(old: dict, new: dict) -> bool:
    """The same run, by the fields both record (older files lack some later options')."""
    return all(old[k] == new[k] for k in RUN_KEYS if k in old and k in new)


def merge_quality(old: dict, new: dict, policy: str) -> list[str]:
    """bench_routing_quality.py's runs: results rows and verdicts."""
    changed = []
    for i, (o, n) in enumerate(zip(old["runs"], new["runs"], strict=True)):
        if not same_run(o, n):
            raise SystemExit(f"run {i}: {[o.get(k) for k in RUN_KEYS]} is not the rerun's")
        by_old = {r["policy"]: r for r in o["results"]}
        by_new = {r["policy"]: r for r in n["results"]}
        for f in ("hit_rate", "ttft_p99_s", "prefill_tokens"):
            if by_old[CHECK][f] != by_new[CHECK][f]:
                raise SystemExit(f"run {i}: {CHECK}'s {f} replays differently; nothing written")
        before = by_old[policy]
        o["results"] = [by_new[policy] if r["policy"] == policy else r for r in o["results"]]
        add_vs_round_robin(o["results"])  # against the run's round-robin, as run_bench adds it
        o["verdicts"][policy] = verdict(o, policy)
        if (before["hit_rate"], before["ttft_p99_s"]) != (
            by_new[policy]["hit_rate"],
            by_new[policy]["ttft_p99_s"],
        ):
            changed.append(
                f"run {i} ({o['workload']}, {o['view']}, {o['steptime']}): hit "
                f"{before['hit_rate']:.4%} -> {by_new[policy]['hit_rate']:.4%}, TTFT p99 "
                f"{before['ttft_p99_s']:.3f} -> {by_new[policy]['ttft_p99_s']:.3f} s; beaten by "
                f"{beaten_by(o['results'], policy) or 'none'}"
            )
    return changed


def merge_fleet(old: dict, new: dict, policy: str) -> list[str]:
    """bench_fleet_conditions.py's runs: verdicts, the bar and who beats the default."""
    changed = []
    for i, (o, n) in enumerate(zip(old["runs"], new["runs"], strict=True)):
        if not same_run(o, n) or o["bound"] != n["bound"]:
            raise SystemExit(f"run {i}: {o['condition']} is not the rerun's")
        if o["verdicts"][CHECK] != n["verdicts"][CHECK]:
            raise SystemExit(f"run {i}: {CHECK} replays differently; nothing written")
        before = o["verdicts"][policy]
        v = o["verdicts"][policy] = n["verdicts"][policy]
        if policy == DEFAULT:
            o["meets_bar"] = n["meets_bar"]
        # who beats the default on both axes: more hits at a TTFT p99 no higher
        # (bench_routing_quality.beaten_by on the verdicts: the bound and kv's p99 are the run's,
        # the same for every policy)
        d = o["verdicts"][DEFAULT]
        o["beaten_by"] = [
            p
            for p, w in o["verdicts"].items()
            if p != DEFAULT
            and w["share_of_bound"] > d["share_of_bound"]
            and w["ttft_p99_vs_kv"] <= d["ttft_p99_vs_kv"]
        ]
        if before != v:
            changed.append(
                f"run {i} ({o['condition']}, {o['steptime']}): "
                f"{before['share_of_bound']:.2%} / {before['ttft_p99_vs_kv']:.3f}x -> "
                f"{v['share_of_bound']:.2%} / {v['ttft_p99_vs_kv']:.3f}x; bar "
                f"{o['meets_bar']}; beaten by {o['beaten_by'] or 'none'}"
            )
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "file", help="a results file of bench_routing_quality.py or ..._fleet_conditions"
    )
    ap.add_argument("--policy", default=DEFAULT)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command that wrote FILE")
    args = ap.parse_args(argv)
    path = Path(args.file)
    doc = json.loads(path.read_text())
    command = [c for c in args.command if c != "--"]
    fleet = "args" in doc and bool(doc["runs"]) and "condition" in doc["runs"][0]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = str(Path(tmp) / "rerun.json")
        if fleet:
            cmd = fleet_command(doc, args.policy, scratch)
        else:
            if not command:
                ap.error("give the command that wrote the file after --")
            if any(c in ("--policies", "--json", "--plots") for c in command):
                ap.error("leave --policies, --json and --plots out of the command")
            cmd = [*command, "--policies", args.policy, CHECK, "--json", scratch, "--plots", ""]
            if cmd[0] == "python":
                cmd[0] = sys.executable
        print("running:", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        new = json.loads(Path(scratch).read_text())
    changed = (merge_fleet if fleet else merge_quality)(doc, new, args.policy)
    doc.setdefault("default_reruns", []).append(
        {
            "policy": args.policy,
            "build": git_head(),
            "command": " ".join(cmd[1:] if cmd[0] == sys.executable else cmd),
            "wall_s": round(wall, 1),
            "runs_changed": len(changed),
        }
    )
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(changed) or "no run changed")
    print(f"{len(changed)} of {len(doc['runs'])} runs changed; wrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

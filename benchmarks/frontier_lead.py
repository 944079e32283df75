"""Does the default routing lead the frontier? Every replay behind the README's routing figures.

Issue 14's "done when": the default policy leads the frontier plot (hit rate against TTFT p99) on
every trace the README reports, under the realistic settings. In one run a policy *beats* the
default when it hits more at a TTFT p99 no higher (``bench_routing_quality.beaten_by``); the
default *leads* that run when none does. This reads the results the README and
``docs/results.md`` quote (no replay is run: each source names the command that wrote it) and
counts, per source and router view, the runs the default leads and who beats it where it does
not, in three groups: other projects' routers (sglang-router's and smg's ``cache_aware`` and
vllm-router's ``kv_aware`` replayed, Dynamo's KV-router cost as ``kv``, and in the mocker
replays Dynamo's own router), plain baselines (round-robin and the like), and kvplug's own modes
and settings (the previous defaults, sweep points), with the largest margin by which one of
those hits more.

One run's verdict turns on margins as small as a few blocks in 100,000, and the same replay
with another seed (the arrivals spread another way, the router's and the event links' random
draws, a generated workload drawn again) moves every policy by more than that. So the runs
that differ only by seed are also judged together: per condition (source, view, workload,
step-time end, fleet condition), each policy's hit rate and TTFT p99 averaged over the seeds
the condition was run with, the default judged on those means, and each policy that beats it
there given the paired difference of its hit rate from the default's, run by run: its mean and
standard error, and whether a paired t-test finds it at 95 % (larger than what the seeds move).

    python benchmarks/frontier_lead.py [--out benchmarks/results/frontier_lead.json]
                                       [--plot docs/img/frontier_lead.png]

Prints the table; writes JSON and a plot of every condition's rivals against the default.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_routing_quality import beaten_by  # noqa: E402

RESULTS = HERE / "results"
DEFAULT = "affinity-fitted"
OTHER_PROJECTS = {"kv", "sglang-cache-aware", "smg-cache-aware", "vllm-kv-aware"}
# a run judges the default only against the routers in it: where no other project's router ran,
# it "leads" by default. So every run must have all of these (the mocker replays Dynamo's own
# router too), and the count names the runs that miss one
EVERY_OTHER_PROJECT = sorted(OTHER_PROJECTS)
DYNAMO_ROUTER = "Dynamo kv_router"
BASELINES = {"round-robin", "random", "least-loaded", "power-of-two"}

# (label, files) in the README's order; each file as a bench or routing-quality benchmark wrote it
SOURCES = [
    (
        "whole conversation trace, 8 engines, six replay seeds (kvplug bench --seeds 6 [--realism "
        "realistic])",
        [
            "sim_bench.json",
            "sim_bench_realistic.json",
        ],
    ),
    (
        "the same with a host tier (victim cache; copies), four replay seeds (kvplug bench "
        "--host-blocks 3280 [--host-offload stored] --seeds 4 [--realism realistic])",
        [
            "sim_bench_host_tier.json",
            "sim_bench_host_tier_stored.json",
            "sim_bench_host_tier_realistic.json",
            "sim_bench_host_tier_stored_realistic.json",
        ],
    ),
    (
        "five trace shapes (bench_routing_quality.py), the generated ones drawn four times",
        ["routing_quality_default.json", "routing_quality_workload_seeds.json"],
    ),
    ("Mooncake's synthetic trace", ["routing_quality_synthetic.json"]),
    ("Mooncake's synthetic trace, eight arrival seeds", ["routing_quality_synthetic_seeds.json"]),
    ("AIPerf-synthesized variants", ["routing_quality_aiperf.json"]),
    (
        "fleet conditions (bench_fleet_conditions.py), four replay seeds",
        [
            "fleet_conditions.json",
            "fleet_conditions_fitted_seeds.json",
        ],
    ),
    ("mixed fleets", ["fleet_conditions_mixed.json"]),
    (
        "with vLLM's --long-prefill-token-threshold: trace shapes, AIPerf, fleets",
        [
            "routing_quality_long_prefill.json",
            "routing_quality_workload_seeds_long_prefill.json",
            "routing_quality_aiperf_long_prefill.json",
            "fleet_conditions_long_prefill.json",
        ],
    ),
    (
        "generated tool loops at rising load, up to overload (bench_saturation.py)",
        ["saturation.json", "saturation_seed1.json"],
    ),
    (
        "judged by Dynamo's mocker (bench_dynamo_replay.py)",
        [
            "dynamo_replay.json",
            "dynamo_replay_realistic.json",
            "dynamo_replay_synthetic.json",
            "dynamo_replay_4engines.json",
            "dynamo_replay_6engines.json",
            "dynamo_replay_aiperf_prefix-x2.json",
        ],
    ),
]


def group(policy: str) -> str:
    name = policy.split(" #")[0]  # a Dynamo router's round in the mocker replays
    if name in BASELINES or name == "Dynamo round_robin":
        return "baseline"
    if name in OTHER_PROJECTS or name.startswith("Dynamo"):
        return "other"
    return "own"


def view_of(run: dict, doc: dict) -> str:
    if "view" in run:
        return run["view"]
    # kvplug bench's report: the ideal view's link is lossless, its gauges fresh
    link = doc.get("spec", {}).get("link") or {}
    lossy = link.get("event_loss", 0) > 0 or link.get("metrics_delay_s", 0) > 0
    return "realistic" if lossy else "ideal"


def verdict_rows(run: dict) -> list[dict]:
    """A fleet-conditions run keeps each policy's share of the run's bound (hit rate over it)
    and TTFT p99 over kv's: the hit rate back, and the p99 in the same order within the run."""
    return [
        {
            "policy": p,
            "hit_rate": v["share_of_bound"] * run["bound"],
            "ttft_p99_s": v["ttft_p99_vs_kv"],
        }
        for p, v in run["verdicts"].items()
    ]


def mocker_rows(doc: dict) -> list[list[dict]]:
    """A Dynamo-mocker replay, judged by the mocker: every kvplug-side placement decided at the
    mocker's timing (rows "NAME (mocker)": the default, kv, the replayed routers) beside every
    round of Dynamo's own router and of its round-robin."""
    out = []
    for r in doc["rows"]:
        name = r["row"]
        if name.endswith(" (mocker)"):
            policy = name[: -len(" (mocker)")]
        elif name.startswith("Dynamo"):
            policy = f"{name} #{r.get('round', 0)}"
        else:
            continue  # placements decided at kvplug's H200 timing: another decision clock
        out.append({"policy": policy, "hit_rate": r["hit_rate"], "ttft_p99_s": r["ttft_p99_s"]})
    return [out] if any(r["policy"] == DEFAULT for r in out) else []


def runs_of(path: Path) -> list[tuple[str, str, list[dict]]]:
    """(run label, view, per-policy rows) of every run in one results file."""
    doc = json.loads(path.read_text())
    if "rows" in doc and "mocker_engine" in doc:
        view = doc.get("view", "ideal")
        return [(path.stem, view, rows) for rows in mocker_rows(doc)]
    if "runs" in doc:
        out = []
        for r in doc["runs"]:
            rows = r["results"] if "results" in r else verdict_rows(r)
            label = " ".join(
                str(r.get(k))
                for k in ("workload", "condition", "steptime", "spread_seed", "seed")
                if r.get(k) is not None
            )
            out.append((f"{path.stem}: {label}", view_of(r, doc), rows))
        return out
    if "seed_runs" in doc:  # kvplug bench --seeds: every seed's run, not their means
        return [
            (f"{path.stem}/seed{r['seed']}", view_of(doc, doc), r["results"])
            for r in doc["seed_runs"]
        ]
    return [(path.stem, view_of(doc, doc), doc["results"])]


def judge(rows: list[dict]) -> dict | None:
    """Who beats the default in one run (None: the run has no default), by group, and the
    largest margin in points of hit rate within the own and other-project groups."""
    by = {r["policy"]: r for r in rows}
    if DEFAULT not in by:
        return None
    beaten = beaten_by(rows, DEFAULT)
    names = {r["policy"].split(" #")[0] for r in rows}
    missing = [p for p in EVERY_OTHER_PROJECT if p not in names]
    if any(n.startswith("Dynamo") for n in names) and not any(
        n.startswith(DYNAMO_ROUTER) for n in names
    ):
        missing.append(DYNAMO_ROUTER)
    grouped = {g: [p for p in beaten if group(p) == g] for g in ("other", "baseline", "own")}

    def margin(policies: list[str]) -> float:
        return max(
            (100 * (by[p]["hit_rate"] - by[DEFAULT]["hit_rate"]) for p in policies), default=0.0
        )

    return {
        "policies": len(rows),
        "beaten_by": beaten,
        "beaten_by_other_project": grouped["other"],
        "beaten_by_baseline": grouped["baseline"],
        "beaten_by_own": grouped["own"],
        "own_margin_points": margin(grouped["own"]),
        "other_margin_points": margin(grouped["other"]),
        # how much lower the winners' TTFT p99 is than the default's, at most (percent)
        "other_p99_lower_percent": max(
            (100 * (1 - by[p]["ttft_p99_s"] / by[DEFAULT]["ttft_p99_s"]) for p in grouped["other"]),
            default=0.0,
        ),
        "other_projects_missing": missing,
        # the other side of the head to head: the policies the default beats on both axes
        "default_beats": [r["policy"] for r in rows if DEFAULT in beaten_by(rows, r["policy"])],
        "policies_in_run": [r["policy"] for r in rows if r["policy"] != DEFAULT],
    }


# the parts of a run's label that name its seed: a trace's arrival seed ("conversation seed 2"),
# a fleet condition's replay seed (", replay seed 2"), a generated workload's draw ("shared-prefix
# workload seed 2") and the seed fields appended to every label (" causal 2"); kvplug bench
# --seeds runs (sim_bench/seed2) and the files below are condition_of's
SEED_PARTS = re.compile(
    r"(,? replay seed \d+| workload seed \d+| seed \d+|(?<=causal|cached) \d+$)"
)
# a condition whose first run and other seeds were written apart: the name they share
SEEDS_OF = {
    "fleet_conditions_fitted_seeds": "fleet_conditions",
    "routing_quality_workload_seeds": "routing_quality_default",
    "routing_quality_workload_seeds_long_prefill": "routing_quality_long_prefill",
    "saturation_seed1": "saturation",
}


def condition_of(run_label: str) -> str:
    """A run's label without its seed: the runs of one condition share it."""
    stem, sep, rest = run_label.partition(": ")
    if not sep:
        stem, rest = run_label, ""
    stem = re.sub(r"/seed\d+$", "", SEEDS_OF.get(stem, stem))  # kvplug bench --seeds: a run
    return f"{stem}: {SEED_PARTS.sub('', rest)}".strip()


# Student's t, two-sided 95 %, by degrees of freedom (past 10: 10's, which is conservative)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
       10: 2.228}  # fmt: skip


def judge_seeds(runs: list[list[dict]]) -> dict:
    """The default judged on the means over one condition's seeds (each policy's hit rate and
    TTFT p99; the policies every run has), and for each policy that beats it there the paired
    difference of hit rates, in points: mean, standard error and the run count."""
    common = set.intersection(*({r["policy"] for r in rows} for rows in runs))
    by_run = [{r["policy"]: r for r in rows if r["policy"] in common} for rows in runs]
    means = [
        {
            "policy": p,
            "hit_rate": statistics.fmean(b[p]["hit_rate"] for b in by_run),
            "ttft_p99_s": statistics.fmean(b[p]["ttft_p99_s"] for b in by_run),
        }
        for p in sorted(common)
    ]
    verdict = judge(means)
    assert verdict is not None
    paired = {}
    for p in verdict["beaten_by"]:
        diffs = [100 * (b[p]["hit_rate"] - b[DEFAULT]["hit_rate"]) for b in by_run]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        paired[p] = {"mean_points": statistics.fmean(diffs), "standard_error": se}
    verdict["runs"] = len(runs)
    verdict["means"] = {m["policy"]: [m["hit_rate"], m["ttft_p99_s"]] for m in means}
    verdict["paired_hit_difference"] = paired
    # a paired t-test at 95 %, two-sided: a lead the seeds do not explain
    t95 = T95.get(len(runs) - 1, T95[max(T95)])
    verdict["beaten_beyond_noise_by"] = [
        p for p, d in paired.items() if d["mean_points"] > t95 * d["standard_error"]
    ]
    return verdict


def counted(verdicts: list[dict]) -> dict[str, int]:
    """How many verdicts (runs, or conditions on their means) the default leads, and how many
    another project's router, a baseline, or only kvplug's own settings beat it in."""
    return {
        "led": sum(not v["beaten_by"] for v in verdicts),
        "beaten_by_other_project": sum(bool(v["beaten_by_other_project"]) for v in verdicts),
        "beaten_by_baseline": sum(bool(v["beaten_by_baseline"]) for v in verdicts),
        "beaten_only_by_own": sum(
            bool(v["beaten_by"]) and v["beaten_by"] == v["beaten_by_own"] for v in verdicts
        ),
    }


def summarise_seeds(label: str, view: str, judged: list[tuple[str, list[dict]]]) -> dict | None:
    """One source's conditions run with two seeds or more, in one view, judged on the means."""
    by_condition: dict[str, list[list[dict]]] = {}
    for run_label, rows in judged:
        by_condition.setdefault(condition_of(run_label), []).append(rows)
    conditions = [
        {"condition": c, **judge_seeds(runs)} for c, runs in by_condition.items() if len(runs) > 1
    ]
    if not conditions:
        return None
    return {
        "source": label,
        "view": view,
        "conditions": len(conditions),
        "runs": sum(c["runs"] for c in conditions),
        **counted(conditions),
        "beaten_beyond_noise": sum(bool(c["beaten_beyond_noise_by"]) for c in conditions),
        "per_condition": conditions,
    }


def summarise(label: str, files: list[Path], view: str, runs: list[dict]) -> dict:
    """One source's runs in one router view: the table's row, every run's verdict kept."""
    return {
        "source": label,
        "files": [str(f.relative_to(HERE.parent)) for f in files],
        "view": view,
        "runs": len(runs),
        **counted(runs),
        "missing_other_projects": sum(bool(r["other_projects_missing"]) for r in runs),
        "own_margin_points_max": max(r["own_margin_points"] for r in runs),
        "other_margins_points": [
            r["other_margin_points"] for r in runs if r["beaten_by_other_project"]
        ],
        "per_run": runs,
    }


# the rivals the plot shows, each against the default, and their colours
PLOTTED = {
    "sglang-cache-aware": "tab:orange",
    "smg-cache-aware": "tab:red",
    "vllm-kv-aware": "tab:purple",
    "kv": "tab:blue",
    "affinity-balance": "tab:gray",
}


def plot_conditions(seed_table: list[dict], view: str, path: Path) -> None:
    """One dot per condition and rival: the rival's mean hit rate minus the default's (points)
    against its mean TTFT p99 over the default's; a dot in the shaded corner (more hits at a p99
    no higher) beats the default on the means."""
    from kvplug.sim.plots import _plt  # matplotlib on its Agg backend, as kvplug bench's plots

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    conditions = [c for t in seed_table if t["view"] == view for c in t["per_condition"]]
    for rival, colour in PLOTTED.items():
        points = [
            (
                100 * (c["means"][rival][0] - c["means"][DEFAULT][0]),
                100 * (c["means"][rival][1] / c["means"][DEFAULT][1] - 1),
            )
            for c in conditions
            if rival in c["means"]
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            wins = sum(x > 0 and y <= 0 for x, y in points)
            label = f"{rival} ({len(points)} conditions, beats the default in {wins})"
            ax.scatter(xs, ys, s=14, color=colour, alpha=0.75, label=label)
    # both axes symlog: most conditions sit within a few points and percent, a few far out
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="black", lw=0.8)
    ax.axvline(0, color="black", lw=0.8)
    (x_lo, x_hi), (y_lo, _) = ax.get_xlim(), ax.get_ylim()
    x_hi = max(x_hi, 2.0)
    ax.fill_between([0, x_hi], [y_lo, y_lo], [0, 0], color="tab:red", alpha=0.1, lw=0)
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(bottom=y_lo)
    ax.set_xlabel("rival's hit rate minus the default's (points, mean over seeds; symlog)")
    ax.set_ylabel("rival's TTFT p99 over the default's (%, symlog)")
    runs = sum(c["runs"] for c in conditions)
    ax.set_title(
        f"Each rival against {DEFAULT}, {view} view: {len(conditions)} conditions, each averaged "
        f"over its seeds ({runs} runs)\nshaded: more hits at a TTFT p99 no higher, the rival beats "
        "the default",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


COUNTED = tuple(counted([]))  # the counts both tables keep


def totals(rows: list[dict], keys: tuple[str, ...]) -> dict:
    """Per router view, each key summed over the sources' rows."""
    return {
        view: {k: sum(t[k] for t in rows if t["view"] == view) for k in keys}
        for view in ("realistic", "ideal")
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "frontier_lead.json"))
    ap.add_argument(
        "--plot",
        default=str(HERE.parent / "docs" / "img" / "frontier_lead.png"),
        help="the realistic view's conditions, each rival against the default ('' = none)",
    )
    args = ap.parse_args(argv)
    table = []
    seed_table: list[dict] = []
    for label, patterns in SOURCES:
        files = sorted({p for pat in patterns for p in RESULTS.glob(pat)})
        assert files, f"{label}: none of {patterns} under {RESULTS}"
        judged = [  # each file read once, its runs then split by view
            (view, {"run": run_label, **verdict}, rows)
            for f in files
            for run_label, view, rows in runs_of(f)
            if (verdict := judge(rows)) is not None
        ]
        for view in ("realistic", "ideal"):
            runs = [run for v, run, _ in judged if v == view]
            if runs:
                table.append(summarise(label, files, view, runs))
            seeded = summarise_seeds(
                label, view, [(run["run"], rows) for v, run, rows in judged if v == view]
            )
            if seeded:
                seed_table.append(seeded)
    print(
        "| source | view | runs | default leads | beaten by another project's router or kv "
        "| by a baseline | only by kvplug's own settings (largest margin, points) "
        "| runs without every other project's router |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for t in table:
        print(
            f"| {t['source']} | {t['view']} | {t['runs']} | {t['led']} | "
            f"{t['beaten_by_other_project']} | {t['beaten_by_baseline']} | "
            f"{t['beaten_only_by_own']} ({t['own_margin_points_max']:.2f}) | "
            f"{t['missing_other_projects']} |"
        )
    # head to head over every run a policy shares with the default: how often each beats the
    # other on both axes (a policy that wins some runs may lose more). Dynamo's own router runs
    # several rounds in one mocker replay ("NAME #k"): those are the per-run table's alone
    head: dict[str, dict[str, dict[str, int]]] = {}
    for t in table:
        for r in t["per_run"]:
            for p in r["policies_in_run"]:
                if " #" in p:
                    continue
                h = head.setdefault(t["view"], {}).setdefault(
                    p, {"runs": 0, "beats_default": 0, "default_beats": 0}
                )
                h["runs"] += 1
                h["beats_default"] += p in r["beaten_by"]
                h["default_beats"] += p in r["default_beats"]
    for view, rivals in head.items():
        print(f"\nhead to head, {view} view (policies in 20 runs or more):")
        print("| policy | runs with the default | beats the default | the default beats it |")
        print("|---|---:|---:|---:|")
        for name, h in sorted(rivals.items(), key=lambda kv: -kv[1]["runs"]):
            if h["runs"] >= 20:
                print(f"| {name} | {h['runs']} | {h['beats_default']} | {h['default_beats']} |")
    total = totals(table, ("runs", *COUNTED, "missing_other_projects"))
    for view, s in total.items():
        print(
            f"{view}: {s['runs']} runs, the default leads {s['led']}; beaten by another "
            f"project's router or kv in {s['beaten_by_other_project']}, by a baseline in "
            f"{s['beaten_by_baseline']}, only by kvplug's own settings in "
            f"{s['beaten_only_by_own']}; runs without every other project's router: "
            f"{s['missing_other_projects']}"
        )
    print(
        "\nthe same runs, each condition's seeds averaged (conditions run with two seeds or "
        "more; beaten beyond noise: the winner's paired hit difference significant at 95 %, t-test)"
    )
    print(
        "| source | view | conditions (runs) | default leads | beaten by another project's "
        "router or kv | by a baseline | only by kvplug's own settings | beaten beyond noise |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for t in seed_table:
        print(
            f"| {t['source']} | {t['view']} | {t['conditions']} ({t['runs']}) | {t['led']} | "
            f"{t['beaten_by_other_project']} | {t['beaten_by_baseline']} | "
            f"{t['beaten_only_by_own']} | {t['beaten_beyond_noise']} |"
        )
    seed_total = totals(seed_table, ("conditions", "runs", *COUNTED, "beaten_beyond_noise"))
    for view, s in seed_total.items():
        print(
            f"{view}, seeds averaged: {s['conditions']} conditions ({s['runs']} runs), the "
            f"default leads {s['led']}; beaten by another project's router or kv in "
            f"{s['beaten_by_other_project']}, by a baseline in {s['beaten_by_baseline']}, only "
            f"by kvplug's own settings in {s['beaten_only_by_own']}; beyond noise in "
            f"{s['beaten_beyond_noise']}"
        )
        for t in seed_table:
            for c in t["per_condition"] if t["view"] == view else ():
                for p, d in c["paired_hit_difference"].items():
                    if group(p) != "own":
                        print(
                            f"  {c['condition']}: {p} +{d['mean_points']:.3f} points "
                            f"(s.e. {d['standard_error']:.3f}, {c['runs']} runs)"
                        )
    Path(args.out).write_text(
        json.dumps(
            {
                "default": DEFAULT,
                "total": total,
                "head_to_head": head,
                "sources": table,
                "seeds_averaged": {"total": seed_total, "sources": seed_table},
            },
            indent=1,
        )
        + "\n"
    )
    print(f"JSON: {args.out}")
    if args.plot:
        plot_conditions(seed_table, "realistic", Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

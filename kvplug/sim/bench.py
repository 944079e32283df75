"""``kvplug bench``: replay a trace under several routing policies and compare them.

Each policy gets a fresh fleet and a fresh Router; policies run in parallel worker processes
(``jobs``). Reported per policy: KV hit rate (reused prompt blocks / prompt blocks), TTFT,
end-to-end latency, output throughput, load imbalance. Two reference bounds are computed from
the trace alone: the *oracle* (an infinite cache shared by all engines) and the *fleet LRU* (one
LRU cache with the fleet's total capacity, shared by all engines: what perfect placement with
this much memory could reach).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvplug.sim.engine import EngineConfig
from kvplug.sim.policies import parse_policy
from kvplug.sim.steptime import parse_steptime
from kvplug.sim.traces import (
    TRACE_BLOCK_TOKENS,
    TraceRecord,
    load_trace,
    oracle_hit_rate,
    parse_workload,
    spread_arrivals,
)
from kvplug.sim.transport import LinkConfig
from kvplug.sim.virtual import ReplayConfig, replay, summarize


@dataclass
class BenchSpec:
    policies: list[str]
    n_engines: int = 8
    trace: str | None = None  # None = bundled conversation trace
    start_s: float = 0.0
    duration_s: float | None = None
    limit: int | None = None
    speedup: float = 1.0
    capacity_blocks: int = 1640
    host_capacity_blocks: int = 0
    max_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # the engines' (vLLM's flag); 0 = off
    long_prefill_token_threshold_adaptive: bool = False  # vLLM's flag: the cap's floor
    kv_allocation: str = "reserve"  # the engines' KV allocation (EngineConfig.kv_allocation)
    host_offload: str = "evicted"  # with host_capacity_blocks: EngineConfig.host_offload
    link: LinkConfig = field(default_factory=LinkConfig)  # the router's view (ideal default)
    steptime: str = "causal"  # step-time preset (kvplug.sim.steptime.parse_steptime)
    mode: str = "hashes"
    seed: int = 0
    workload: str | None = None  # e.g. "shared-prefix:groups=32" instead of the trace
    n_prefill: int = 0  # > 0: disaggregated fleet, this many prefill engines, the rest decode
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens per trace hash id = engine/router block size
    replicas: int = 1  # router replicas, requests spread over them in turn
    replica_sync: bool = True  # replicas share in-flight load (kvplug.replica_sync's folding)
    sync_delay_s: float = 0.003  # lifecycle event -> the other replicas
    spread_arrivals: bool = False  # requests sharing a timestamp spread to the next one
    pick_stats: bool = False  # per-decision herding figures (pick_excess_*)
    slowdowns: tuple[float, ...] = ()  # a mixed fleet: engine i's step times x slowdowns[i % len]
    extra: dict[str, Any] = field(default_factory=dict)

    def records(self) -> list[TraceRecord]:
        if self.workload:
            recs = parse_workload(self.workload, self.block_tokens)
            if self.limit is not None:
                recs = recs[: self.limit]
            return recs
        recs = load_trace(
            self.trace,
            start_s=self.start_s,
            duration_s=self.duration_s,
            limit=self.limit,
            speedup=self.speedup,
        )
        return spread_arrivals(recs, self.seed) if self.spread_arrivals else recs

    def replay_config(self, feed_events: bool) -> ReplayConfig:
        return ReplayConfig(
            n_engines=self.n_engines,
            engine=EngineConfig(
                block_size=self.block_tokens,
                capacity_blocks=self.capacity_blocks,
                host_capacity_blocks=self.host_capacity_blocks,
                max_batched_tokens=self.max_batched_tokens,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
                kv_allocation=self.kv_allocation,
                host_offload=self.host_offload,
                events_with_tokens=self.mode == "tokens",
                model=parse_steptime(self.steptime),
            ),
            mode=self.mode,
            link=self.link,
            feed_events=feed_events,
            seed=self.seed,
            n_prefill=self.n_prefill,
            replicas=self.replicas,
            replica_sync=self.replica_sync,
            sync_delay_s=self.sync_delay_s,
            pick_stats=self.pick_stats,
            slowdowns=tuple(self.slowdowns),
        )

    def replica_label(self) -> str:
        """'' for one router; e.g. '3 replicas, sync 3 ms' / '3 replicas, no sync'."""
        if self.replicas == 1:
            return ""
        if not self.replica_sync:
            return f"{self.replicas} replicas, no sync"
        return f"{self.replicas} replicas, sync {self.sync_delay_s * 1000:g} ms"


def fleet_lru_hits(
    records: list[TraceRecord], capacity_blocks: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[int]:
    """Per request, its leading prompt blocks found in one LRU cache of ``capacity_blocks``
    shared by every request (each request's blocks enter it at its arrival)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = []
    for r in records:
        ids = r.hash_ids[: r.input_length // block_tokens]
        n = 0
        for h in ids:
            if h not in lru:
                break
            n += 1
        hits.append(n)
        for h in ids:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits


def fleet_lru_hit_rate(
    records: list[TraceRecord], capacity_blocks: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> float:
    """Prefix hit rate of one LRU cache of ``capacity_blocks`` shared by every request."""
    total = sum(len(r.hash_ids[: r.input_length // block_tokens]) for r in records)
    hit = sum(fleet_lru_hits(records, capacity_blocks, block_tokens))
    return hit / total if total else 0.0


def run_policy(spec: BenchSpec, policy_text: str, counter=None) -> dict:
    """One replay; returns the summary plus the series the plots need (picklable)."""
    pol = parse_policy(policy_text)
    records = spec.records()
    cfg = spec.replay_config(pol.feed_events)
    pending = [0]

    def tick(n: int) -> None:
        if counter is None:
            return
        pending[0] += n
        if pending[0] >= 100:
            with counter.get_lock():
                counter.value += pending[0]
            pending[0] = 0

    res = replay(
        records,
        pol.router_config(spec.block_tokens),
        cfg,
        policy=pol.name,
        progress=tick,
        router_factory=pol.router_factory(),
    )
    if counter is not None and pending[0]:
        with counter.get_lock():
            counter.value += pending[0]
    out = summarize(res)
    done = [r for r in res.requests if not r.rejected]
    out["series"] = {
        "ttft_s": sorted(float(r.first_token - r.arrival) for r in done),
        "load_t": res.load_samples_t,
        "load": res.load_samples,
        "engine_requests": [e.stats["requests"] for e in res.engines],
        "engine_prefill_tokens": [e.stats["prefill_tokens"] for e in res.engines],
    }
    out["router_index"] = res.router_stats
    if spec.replicas > 1:
        out["replicas"] = spec.replicas
        out["replica_sync"] = spec.replica_sync
        out["sync_delay_s"] = spec.sync_delay_s if spec.replica_sync else None
        out["replica_label"] = spec.replica_label()
        out["replica_stats"] = res.replica_stats
    return out


def _init_worker(counter) -> None:
    global _COUNTER
    _COUNTER = counter


_COUNTER = None


def _run_in_worker(args) -> dict:
    spec, text = args
    try:
        return run_policy(spec, text, _COUNTER)
    except Exception as exc:  # carry the worker's traceback across the process boundary
        import traceback

        raise RuntimeError(f"policy {text!r} failed:\n{traceback.format_exc()}") from exc


def run_bench(spec: BenchSpec, jobs: int = 1, progress: bool = True, desc: str = "replay") -> dict:
    """Run every policy; returns the JSON-ready report."""
    for p in spec.policies:
        parse_policy(p)  # fail fast on a typo, before any replay
    records = spec.records()
    if not records:
        raise ValueError("the trace slice is empty")
    t0 = time.perf_counter()
    total = len(records) * len(spec.policies)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc=desc, smoothing=0.05)
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    counter = ctx.Value("q", 0)
    results: list[dict] = []
    jobs = max(1, min(jobs, len(spec.policies)))
    stop = threading.Event()

    def poll() -> None:
        last = 0
        while not stop.wait(0.3):
            v = counter.value
            if bar is not None and v > last:
                bar.update(v - last)
                last = v
        if bar is not None:
            bar.update(counter.value - last)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        if jobs == 1:
            for p in spec.policies:
                results.append(run_policy(spec, p, counter))
        else:
            with ctx.Pool(jobs, initializer=_init_worker, initargs=(counter,)) as pool:
                results = pool.map(_run_in_worker, [(spec, p) for p in spec.policies], chunksize=1)
    finally:
        stop.set()
        poller.join()
        if bar is not None:
            bar.close()
    oracle = oracle_hit_rate(records, spec.block_tokens)
    prompt_engines = spec.n_prefill or spec.n_engines  # where prompts are computed and cached
    # distinct blocks an engine can hold: a victim-cache host adds to the device, an inclusive
    # one ("stored") holds copies of what the device holds
    per_engine = spec.capacity_blocks + spec.host_capacity_blocks
    if spec.host_offload == "stored":
        per_engine = max(spec.capacity_blocks, spec.host_capacity_blocks)
    fleet_cap = prompt_engines * per_engine
    report = {
        "spec": asdict(spec),
        "trace": {
            "requests": len(records),
            "span_s": records[-1].arrival_s - records[0].arrival_s,
            "oracle_hit_rate": oracle["full_block_hit_rate"],
            "oracle_hit_rate_all_ids": oracle["all_id_hit_rate"],
            "fleet_lru_hit_rate": fleet_lru_hit_rate(records, fleet_cap, spec.block_tokens),
            "fleet_lru_capacity_blocks": fleet_cap,
        },
        "results": results,
        "wall_s": time.perf_counter() - t0,
        "jobs": jobs,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    try:
        from kvplug import core

        report["core_backend"] = getattr(core, "backend", getattr(core, "BACKEND", "?"))
    except Exception as exc:  # report, don't fail, when the core cannot load
        report["core_backend"] = f"unavailable: {exc}"
    add_vs_round_robin(results)
    return report


def add_vs_round_robin(results: list[dict]) -> None:
    """Each row's hit rate and TTFT against the run's round-robin row (none: nothing added);
    benchmarks/rerun_default.py derives it again after putting a policy's new rows in place."""
    baseline = next((r for r in results if r["policy"] == "round-robin"), None)
    if not baseline:
        return
    ratios = {"hit_rate_x": "hit_rate", "ttft_p50_x": "ttft_p50_s", "ttft_p99_x": "ttft_p99_s"}
    for r in results:
        r["vs_round_robin"] = {
            name: r[key] / baseline[key] if baseline[key] else None for name, key in ratios.items()
        }


# the figures whose range over seeds a multi-seed report gives beside their mean
SEED_RANGES = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")


def run_seeds(spec: BenchSpec, seeds: list[int], jobs: int = 1, progress: bool = True) -> dict:
    """``run_bench`` once per seed, combined by ``combine_seeds``. A seed draws the tie-breaks
    between equally priced engines and, in a realistic router view, the link's jitter and
    losses: the order of close policies in one run can turn on it, so compare their means."""
    reports = [
        run_bench(replace(spec, seed=s), jobs=jobs, progress=progress, desc=f"seed {s}")
        for s in seeds
    ]
    return combine_seeds(reports)


def combine_seeds(reports: list[dict]) -> dict:
    """One report of runs that differ only in their seed: each policy's figures are their mean
    over the runs, ``over_seeds`` gives the SEED_RANGES' [min, max], and ``seed_runs`` keeps
    every run's own results (without the plots' series). The TTFT series is every run's pooled,
    the load series the first run's."""
    first = reports[0]
    seeds = [rep["spec"]["seed"] for rep in reports]
    policies = [r["policy"] for r in first["results"]]
    if any([r["policy"] for r in rep["results"]] != policies for rep in reports):
        raise ValueError("combine_seeds: the runs must replay the same policies")
    results = []
    for i, head in enumerate(first["results"]):
        runs = [rep["results"][i] for rep in reports]
        row: dict[str, Any] = {"policy": head["policy"]}
        for key, value in head.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                row[key] = float(np.mean([r[key] for r in runs]))
        row["over_seeds"] = {
            key: [min(r[key] for r in runs), max(r[key] for r in runs)] for key in SEED_RANGES
        }
        if "series" in head:
            row["series"] = {
                **head["series"],
                "ttft_s": sorted(t for r in runs for t in r["series"]["ttft_s"]),
            }
        results.append(row)
    add_vs_round_robin(results)
    trace = dict(first["trace"])
    for key, value in first["trace"].items():  # a seed may spread a trace's arrivals
        if isinstance(value, float):
            trace[key] = float(np.mean([rep["trace"][key] for rep in reports]))
    return {
        "spec": first["spec"],
        "seeds": seeds,
        "trace": trace,
        "results": results,
        "seed_runs": [
            {
                "seed": seed,
                "trace": rep["trace"],
                "results": _without_series(rep["results"]),
                "wall_s": rep["wall_s"],
            }
            for seed, rep in zip(seeds, reports, strict=True)
        ],
        "wall_s": sum(rep["wall_s"] for rep in reports),
        "jobs": first["jobs"],
        "host": first["host"],
        "core_backend": first.get("core_backend"),
    }


COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit_rate", "hit %", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("e2e_p50_s", "E2E p50 s", "{:.2f}"),
    ("e2e_p99_s", "E2E p99 s", "{:.2f}"),
    ("output_tok_per_s", "out tok/s", "{:.0f}"),
    ("imbalance_requests", "imb req", "{:.2f}"),
    ("imbalance_busy", "imb busy", "{:.2f}"),
    ("wall_s", "wall s", "{:.1f}"),
)


PICK_COLUMNS = (  # runs with pick_stats (kvplug bench --replicas)
    ("pick_least_loaded", "least-loaded pick %", "{:.1%}"),
    ("pick_excess_mean", "excess mean", "{:.2f}"),
    ("pick_excess_p99", "excess p99", "{:.0f}"),
)


def format_table(report: dict, markdown: bool = False) -> str:
    columns: tuple[tuple[str, str, str], ...] = COLUMNS
    if all("pick_excess_mean" in r for r in report["results"]):
        columns = COLUMNS[:-1] + PICK_COLUMNS + COLUMNS[-1:]
    rows = [[_cell(r, key, fmt) for key, _, fmt in columns] for r in report["results"]]
    for row, r in zip(rows, report["results"], strict=True):
        if r.get("replica_label"):
            row[0] += f" ({r['replica_label']})"
    head = [title for _, title, _ in columns]
    tr = report["trace"]
    n_prefill = report["spec"].get("n_prefill", 0)
    fleet = f"{report['spec']['n_engines']} engines"
    if n_prefill:
        fleet += f" ({n_prefill} prefill + {report['spec']['n_engines'] - n_prefill} decode)"
    note = (
        f"{tr['requests']} requests over {tr['span_s'] / 60:.1f} min on "
        f"{fleet}; oracle (infinite shared cache) "
        f"{tr['oracle_hit_rate']:.1%}, fleet-LRU bound {tr['fleet_lru_hit_rate']:.1%}\n"
        "hit % = prompt blocks reused from a KV cache; TTFT = time to first token; E2E = "
        "request latency; imb = max/mean across engines of routed requests / busy time; "
        "wall = replay time"
    )
    if "seeds" in report:
        seeds = report["seeds"]
        note += (
            f"\nmeans over {len(seeds)} runs, seeds {', '.join(map(str, seeds))} (the seed draws "
            "tie-breaks and the router view's jitter and losses); in brackets the lowest and "
            "highest run"
        )
    if columns is not COLUMNS:
        note += (
            "\nleast-loaded pick = the chosen engine had the fewest running + waiting requests "
            "of the fleet (all replicas' requests) at the decision; excess = how many more it had"
        )
    if markdown:
        lines = [
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n\n" + note
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    lines = [fmt_row(head), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]
    return "\n".join(lines) + "\n" + note


def _cell(row: dict, key: str, fmt: str) -> str:
    """A figure as ``fmt`` gives it, and after a mean over seeds its range: 24.9% (24.6–25.1%)."""
    text = fmt.format(row[key])
    if key in ("hit_rate", "ttft_p99_s") and "over_seeds" in row:
        lo, hi = (fmt.format(v) for v in row["over_seeds"][key])
        text += f" ({lo.rstrip('%')}–{hi})"
    return text


def _without_series(results: list[dict]) -> list[dict]:
    """The rows without the plots' series (the JSON keeps the figures)."""
    return [{k: v for k, v in r.items() if k != "series"} for r in results]


def write_json(report: dict, path: str | Path, keep_series: bool = False) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    out = dict(report)
    if not keep_series:
        out["results"] = _without_series(report["results"])
    p.write_text(json.dumps(out, indent=1, default=float) + "\n")


def ttft_quantiles(series: list[float]) -> dict[str, float]:
    a = np.asarray(series)
    return (
        {q: float(np.percentile(a, float(q[1:]))) for q in ("p50", "p90", "p99")} if len(a) else {}
    )

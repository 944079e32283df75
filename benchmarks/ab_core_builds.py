"""Two builds of the C core side by side: apply speed in one process, memory in fresh ones.

A change to the C index is judged against the build it started from on identical work, the two
taking turns round by round, so machine load falls on both alike (2 shared vCPUs here). Both
builds' ``_core`` extension modules are loaded into one process from their build folders
(``--base`` and ``--new``: each a source tree built in place, i.e. holding
``kvplug/_core*.so``); each round builds a fresh ``Index`` per build from bench_core's workload
(one ``store`` call per event, Python lists of precomputed hashes: bench_core's kvplug apply)
and times it in CPU time, then times ``clear`` of one endpoint (a different one each round) on
that full index. Memory is the RSS growth of a fresh process per build and round
(inputs built first, freed heap returned to the OS before both readings), as bench_core measures
it, plus each build's own accounting.

    python benchmarks/ab_core_builds.py --base /tmp/base --new . --workers 8 64 512
    python benchmarks/ab_core_builds.py --base /tmp/base --new . --disagree   # engines disagree
    python benchmarks/ab_core_builds.py --base /tmp/base --new . --presized   # as kvplug serve

Prints progress and a table of per-round new/base ratios; writes
``benchmarks/results/ab_core_builds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_core  # noqa: E402  (its workload, RSS reading and heap release)
import numpy as np  # noqa: E402
from build_loader import load_extension  # noqa: E402


def load_build(folder: str, tag: str) -> ModuleType:
    """The ``_core`` extension module of the source tree at ``folder``, under its own name."""
    return load_extension(folder, "kvplug", "_core", f"kvplug_ab_{tag}._core")


def fill(idx, inputs: list, n_blocks: int, presized: bool) -> None:
    """Store ``inputs`` into ``idx``, one call per event, having reserved ``n_blocks`` first when
    ``presized`` (as ``kvplug serve`` does: bench_core's pre-sized apply)."""
    if presized:
        idx.reserve(n_blocks, 0)
    store = idx.store
    for w, eng, seq in inputs:
        store(w, 0, eng, seq)


def apply_cpu_ns_per_block(
    mod: ModuleType, inputs: list, n_blocks: int, clear_ep: int, presized: bool = False
) -> tuple[float, int, float]:
    """CPU ns per block of the apply, the index's own bytes, then CPU ms of ``clear(clear_ep)``
    on the full index (an engine restart or removal). ``presized``: the index reserves room for
    the blocks first, inside the clock, as ``kvplug serve`` does (bench_core's pre-sized apply)."""
    idx = mod.Index()
    t0 = time.process_time()
    fill(idx, inputs, n_blocks, presized)
    cpu = time.process_time() - t0
    mem = idx.memory_bytes()
    t0 = time.process_time()
    idx.clear(clear_ep)
    clear_ms = (time.process_time() - t0) * 1e3
    del idx
    return cpu / n_blocks * 1e9, mem, clear_ms


def store_inputs(wl: bench_core.Workload, disagree: bool) -> list:
    """bench_core's kvplug apply inputs. With ``disagree``, every worker's engine hashes differ
    from every other's (xor with a per-worker constant), as vLLM engines without a shared
    PYTHONHASHSEED draw theirs: no engine hash is shared, the index's fallback path."""
    if not disagree:
        return [(ev.worker, ev.engine.tolist(), ev.seq.tolist()) for ev in wl.events]
    salt = [((w + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1) for w in range(wl.workers)]
    return [
        (ev.worker, (ev.engine ^ np.uint64(salt[ev.worker])).tolist(), ev.seq.tolist())
        for ev in wl.events
    ]


def memory_child(folder: str, workers: int, blocks: int, disagree: bool, presized: bool) -> None:
    mod = load_build(folder, "child")
    wl = bench_core.make_workload(workers, blocks, seed=1000 + workers)
    inputs = store_inputs(wl, disagree)
    bench_core.release_freed_heap()
    rss0 = bench_core.rss_bytes()
    idx = mod.Index()
    fill(idx, inputs, wl.blocks, presized)
    bench_core.release_freed_heap()
    rss1 = bench_core.rss_bytes()
    print(
        json.dumps(
            {
                "rss_mib_per_million_blocks": (rss1 - rss0) / 2**20 / (wl.blocks / 1e6),
                "own_mib_per_million_blocks": idx.memory_bytes() / 2**20 / (wl.blocks / 1e6),
            }
        )
    )


def span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f} (median {statistics.median(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="source tree of the baseline build")
    ap.add_argument("--new", required=True, help="source tree of the new build")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--memory-rounds", type=int, default=2, help="0 skips memory")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--disagree", action="store_true", help="per-worker engine hashes (engines that disagree)"
    )
    ap.add_argument(
        "--presized", action="store_true", help="reserve the blocks first, as kvplug serve does"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ab_core_builds.json"))
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.workers[0], args.blocks, args.disagree, args.presized)
        return 0
    builds = {"base": load_build(args.base, "base"), "new": load_build(args.new, "new")}
    results: dict = {"args": vars(args), "workers": {}}
    lines = []
    for workers in args.workers:
        wl = bench_core.make_workload(workers, args.blocks, seed=1000 + workers)
        inputs = store_inputs(wl, args.disagree)
        rounds = []
        for r in range(args.rounds):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            got = {}
            for name in order:
                bench_core.release_freed_heap()
                got[name] = apply_cpu_ns_per_block(
                    builds[name], inputs, wl.blocks, r % workers, args.presized
                )
            rd = {
                "load": os.getloadavg()[0],
                "base_ns": got["base"][0],
                "new_ns": got["new"][0],
                "base_over_new": got["base"][0] / got["new"][0],
                "clear_ep": r % workers,
                "base_clear_ms": got["base"][2],
                "new_clear_ms": got["new"][2],
                "base_own_mib_per_m": got["base"][1] / 2**20 / (wl.blocks / 1e6),
                "new_own_mib_per_m": got["new"][1] / 2**20 / (wl.blocks / 1e6),
            }
            rounds.append(rd)
            bench_core.log(
                f"[{workers} workers] apply round {r + 1}/{args.rounds}: base {rd['base_ns']:.0f}"
                f" ns/block, new {rd['new_ns']:.0f} ns/block (base/new {rd['base_over_new']:.2f},"
                f" load {rd['load']:.1f}); clear({r % workers}) base {rd['base_clear_ms']:.1f} ms,"
                f" new {rd['new_clear_ms']:.1f} ms"
            )
        mem: dict = {"base": [], "new": []}
        for r in range(args.memory_rounds):
            for name in ["base", "new"] if r % 2 == 0 else ["new", "base"]:
                folder = args.base if name == "base" else args.new
                cmd = [sys.executable, __file__, "--base", args.base, "--new", args.new,
                       "--memory-child", folder, "--workers", str(workers),
                       "--blocks", str(args.blocks)] + ["--disagree"] * args.disagree \
                    + ["--presized"] * args.presized  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
                mem[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            bench_core.log(
                f"[{workers} workers] memory round {r + 1}/{args.memory_rounds}: "
                + ", ".join(
                    f"{n} {mem[n][-1]['rss_mib_per_million_blocks']:.2f} MiB/M" for n in mem
                )
            )
        results["workers"][str(workers)] = {"apply_rounds": rounds, "memory": mem}
        row = [
            f"{workers}",
            span([rd["base_over_new"] for rd in rounds]),
            f"{statistics.median(rd['base_ns'] for rd in rounds):.0f} -> "
            f"{statistics.median(rd['new_ns'] for rd in rounds):.0f}",
            f"{span([rd['base_clear_ms'] for rd in rounds])} -> "
            f"{span([rd['new_clear_ms'] for rd in rounds])}",
        ]
        if args.memory_rounds:
            rss = {n: [m["rss_mib_per_million_blocks"] for m in mem[n]] for n in mem}
            own = {n: mem[n][0]["own_mib_per_million_blocks"] for n in mem}
            row.append(
                f"{min(rss['base']):.2f}-{max(rss['base']):.2f} -> "
                f"{min(rss['new']):.2f}-{max(rss['new']):.2f}"
                f" (own {own['base']:.2f} -> {own['new']:.2f})"
            )
        lines.append("| " + " | ".join(row) + " |")
    print("| workers | apply CPU, base/new per round | ns/block medians, base -> new |"
          " clear(ep) CPU ms, base -> new | memory MiB/M (RSS), base -> new |")  # fmt: skip
    print("|---|---|---|---|---|")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two builds of the C core side by side on query time: bench_core's workload and prompts.

Both builds' ``_core`` extension modules are loaded into one process from their source trees
(``--base``, ``--new``: each built in place, holding ``kvplug/_core*.so``). Each builds its own
index from the same events; then, round by round and alternating which goes first, each
answers bench_core's 1,024- and 8,192-token prompts as Python lists with scores materialised
(``Index.query(list, out).scores()``, one timed call per prompt). A 16 MiB buffer is walked
before each pass so the index and the lists are cold, as beside Dynamo's calls in bench_core.

    python benchmarks/ab_query_builds.py --base /tmp/base --new . --workers 8 64 512

Prints new/base median query time per round; writes ``benchmarks/results/ab_query_builds.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_core  # noqa: E402  (its workload and prompts)
import numpy as np  # noqa: E402
from build_loader import load_extension  # noqa: E402

LENGTHS = (1024, 8192)


def load_core(tree: str) -> ModuleType:
    return load_extension(tree, "kvplug", "_core", "kvplug._core")


def bench(
    workers: int, builds: dict[str, ModuleType], rounds: int, prompts: int, blocks: int
) -> dict:
    wl = bench_core.make_workload(workers, blocks, seed=1000 + workers)
    inputs = bench_core.KvplugSide.apply_inputs(wl)
    sides = {}
    for name, core in builds.items():
        idx, out = core.Index(), core.QueryResult()
        for w, eng, seq in inputs:
            idx.store(w, 0, eng, seq)
        sides[name] = (idx, out)
    lists = {}
    walked = {}
    for n_tok in LENGTHS:
        toks = bench_core.prompt_tokens(wl, n_tok, prompts, seed=n_tok + workers)
        lists[n_tok] = [bench_core.both_hashes(t, None)[1].tolist() for t in toks]
        idx, out = sides["base"]
        walked[n_tok] = float(np.median([idx.query(h, out).walked for h in lists[n_tok]]))
        for h in lists[n_tok]:  # the builds must agree on every answer
            answers = [i.query(h, o).scores() for i, o in sides.values()]
            if answers[0] != answers[1]:
                raise SystemExit(f"the builds disagree on a {n_tok}-token prompt: {answers}")
    junk = np.zeros(16 << 20, np.uint8)
    per_round = []
    for r in range(rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        row: dict[str, float] = {}
        for name in order:
            idx, out = sides[name]
            for n_tok in LENGTHS:
                junk += 1
                lat = []
                for h in lists[n_tok]:
                    t0 = time.perf_counter_ns()
                    idx.query(h, out).scores()
                    lat.append(time.perf_counter_ns() - t0)
                row[f"{name}_{n_tok}_median_us"] = statistics.median(lat) / 1000
        for n_tok in LENGTHS:
            row[f"new_over_base_{n_tok}"] = (
                row[f"new_{n_tok}_median_us"] / row[f"base_{n_tok}_median_us"]
            )
        per_round.append(row)
        print(
            f"[{workers} workers] round {r + 1}/{rounds}: new/base "
            + "  ".join(f"{n} tok {row[f'new_over_base_{n}']:.3f}" for n in LENGTHS),
            flush=True,
        )
    return {
        "workers": workers,
        "median_walked_blocks": walked,
        "rounds": per_round,
        "new_over_base": {
            n: [
                min(x[f"new_over_base_{n}"] for x in per_round),
                max(x[f"new_over_base_{n}"] for x in per_round),
            ]
            for n in LENGTHS
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="source tree of the baseline build")
    ap.add_argument("--new", required=True, help="source tree of the new build")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--out", default="benchmarks/results/ab_query_builds.json")
    args = ap.parse_args(argv)
    builds = {"base": load_core(args.base), "new": load_core(args.new)}
    results = [bench(w, builds, args.rounds, args.prompts, args.blocks) for w in args.workers]
    print("\nworkers  median walk (8,192 tok)  new/base 1,024 tok  new/base 8,192 tok")
    for res in results:
        a, b = res["new_over_base"][1024], res["new_over_base"][8192]
        print(
            f"{res['workers']:>7}  {res['median_walked_blocks'][8192]:>23.0f}"
            f"  {a[0]:.2f}–{a[1]:.2f}{'':>9}  {b[0]:.2f}–{b[1]:.2f}"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "command": "python benchmarks/ab_query_builds.py " + " ".join(argv or sys.argv[1:]),
                "base": args.base,
                "new": args.new,
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

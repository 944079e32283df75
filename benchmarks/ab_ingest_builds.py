"""KV-event ingestion of two source trees side by side: each engine's decoder and
``KvIndex.apply_many`` on ``bench_ingest_engines.py``'s workload, the trees taking turns.

Each tree (``--base`` and ``--new``: checkouts built in place) runs in a fresh child process
per round and engine, so each loads its own kvplug (Python and compiled); the order alternates
every round. A child decodes and applies the workload's payloads for one engine as that tree's
kvplug does with what the engine sends (vLLM: ``BatchDecoder.decode``; SGLang:
``SglangDecoder.decode``; TRT-LLM: ``parse_answer`` then ``TrtllmDecoder.decode``), into an
index pre-sized for the fleet, and reports the best of ``--repeat`` passes in thread CPU time
and the index it built, which must be the same for both trees. The payloads are made once, by this
checkout (``bench_ingest_engines.encode``), and handed to every child in a file, so both trees
read the same bytes.

    python benchmarks/ab_ingest_builds.py --base /tmp/base --new . --rounds 6

Prints a table (per-round base/new ratios); writes ``benchmarks/results/ab_ingest_builds.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = ("vllm", "sglang", "trtllm")


def child(tree: str, engine: str, payload_file: str, repeat: int) -> dict:
    sys.path.insert(0, str(Path(tree).resolve()))
    import kvplug

    loaded = Path(kvplug.__file__).resolve().parent.parent
    assert loaded == Path(tree).resolve(), f"{tree}: imported kvplug from {loaded}"
    # the wheel installs integrations/ as kvplug.integrations; an editable install maps that
    # name to its own checkout whatever sys.path says, so load the tree's by hand
    folder = Path(tree).resolve() / "integrations"
    spec = importlib.util.spec_from_file_location(
        "kvplug.integrations", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    integrations = importlib.util.module_from_spec(spec)
    sys.modules["kvplug.integrations"] = integrations
    spec.loader.exec_module(integrations)
    kvplug.integrations = integrations  # type: ignore[attr-defined]
    import kvplug.integrations.sglang.wire as sglang_wire

    sys.path.insert(1, str(HERE))  # bench_ingest, after the tree's kvplug and integrations
    from bench_ingest import fresh_index

    got = Path(sglang_wire.__file__).resolve()
    assert got.is_relative_to(folder), f"{tree}: imported the integrations from {got}"
    work = pickle.loads(Path(payload_file).read_bytes())
    payloads = work["payloads"][engine]
    bs = work["block_size"]
    best = float("inf")
    stats: dict = {}
    for _ in range(repeat):
        if engine == "vllm":
            from kvplug.integrations.vllm.wire import BatchDecoder

            vllm = {f"w{i}": BatchDecoder(f"w{i}", block_size=bs) for i in range(8)}

            def decode(w, p, d=vllm):
                return d[w].decode(p).events
        elif engine == "sglang":
            from kvplug.integrations.sglang.wire import SglangDecoder

            sglang = {f"w{i}": SglangDecoder(f"w{i}", bs) for i in range(8)}

            def decode(w, p, d=sglang):
                return d[w].decode(p)
        else:
            from kvplug.integrations.trtllm.events import TrtllmDecoder
            from kvplug.integrations.trtllm.poller import parse_answer

            trt = {f"w{i}": TrtllmDecoder(f"w{i}", bs) for i in range(8)}

            def decode(w, p, d=trt):
                return d[w].decode(parse_answer(p)[0])

        index = fresh_index(bs, 8)  # pre-sized for the fleet
        apply_many = index.apply_many
        gc.collect()
        c0 = time.thread_time()
        for worker, payload in payloads:
            apply_many(decode(worker, payload))
        best = min(best, time.thread_time() - c0)
        st = index.stats()
        stats = {"blocks": st.get("blocks"), "entries": st.get("entries")}
    return {"cpu_s": best, "blocks": work["blocks"], "index": stats}


def one(tree: str, engine: str, payload_file: str, repeat: int) -> dict:
    cmd = [sys.executable, __file__, "--child", tree, "--engine", engine]
    cmd += ["--payloads", payload_file, "--repeat", str(repeat)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace, payload_file: str) -> dict:
    """Each engine's rounds, the trees taking turns: per-engine rows."""
    rows = {}
    for engine in args.engines:
        runs: dict[str, list[dict]] = {"base": [], "new": []}
        for r in range(args.rounds):
            order = (("base", args.base), ("new", args.new))
            for name, tree in order if r % 2 == 0 else order[::-1]:
                runs[name].append(one(tree, engine, payload_file, args.repeat))
            print(f"  {engine}: round {r + 1}/{args.rounds}", file=sys.stderr)
        blocks = runs["new"][0]["blocks"]
        ratio = [b["cpu_s"] / n["cpu_s"] for b, n in zip(runs["base"], runs["new"], strict=True)]
        same = all(x["index"] == runs["base"][0]["index"] for x in runs["base"] + runs["new"])
        rows[engine] = {
            "base_blocks_per_cpu_s": [blocks / x["cpu_s"] for x in runs["base"]],
            "new_blocks_per_cpu_s": [blocks / x["cpu_s"] for x in runs["new"]],
            "base_over_new_cpu": ratio,
            "median": statistics.median(ratio),
            "same_index": same,
            "index": runs["new"][0]["index"],
        }
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="source tree of the baseline (built in place)")
    ap.add_argument("--new", help="source tree to compare (built in place)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens a block (1: SGLang's default page size, a block per token)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="passes per child; its best counts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--payloads", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "ab_ingest_builds.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.engine, args.payloads, args.repeat)))
        return 0
    if not (args.base and args.new):
        ap.error("--base and --new are required")
    # the payloads, made once by this checkout: both trees read the same bytes
    sys.path.insert(0, str(HERE))
    from bench_ingest import make_events
    from bench_ingest_engines import encode

    steps = make_events(args.batches, args.block_size, 8, 1)
    work = {
        "payloads": encode(steps, args.block_size),
        "blocks": sum(s[3] for s in steps),
        "block_size": args.block_size,
    }
    with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
        f.write(pickle.dumps(work))
        f.flush()
        rows = compare(args, f.name)
    print(f"\n{'engine':8s} {'base M blocks/CPU-s':>21s} {'new':>13s} {'new faster by':>20s}")
    for engine, row in rows.items():
        b, n, q = (
            row["base_blocks_per_cpu_s"],
            row["new_blocks_per_cpu_s"],
            row["base_over_new_cpu"],
        )
        print(
            f"{engine:8s} {min(b) / 1e6:9.2f}-{max(b) / 1e6:.2f} {min(n) / 1e6:7.2f}-"
            f"{max(n) / 1e6:.2f} {min(q):8.2f}-{max(q):.2f}x (median {row['median']:.2f}x)"
            f"{'' if row['same_index'] else '  INDEX DIFFERS'}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": "ab_ingest_builds",
                "command": "python benchmarks/ab_ingest_builds.py " + " ".join(sys.argv[1:]),
                "params": vars(args) | {"out": None},
                "machine": platform.platform(),
                "engines": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0 if all(r["same_index"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU per prompt of kvplug serve's local tokenization, with and without the prefix cache.

The prompts are bench_frontend.py's (2,000 prompts of ~512 words, 384 of them one of 8 shared
prefixes). Two tokenizers: that benchmark's word-level one, and the tiny Llama's
byte-level BPE (made by .ci/setup_vllm.sh) when present. Per round, the same
prompts go through ``LocalTokenizer`` with the cache off (``--tokenizer-cache-chunks 0``) and
on, alternating; every prompt's ids are checked equal between the two. CPU time of this
process (the tokenizers library's thread pool included), per prompt, over all prompts.

    python benchmarks/bench_tokenize.py            # ~1 minute
    python benchmarks/bench_tokenize.py --rounds 1 --prompts 300   # smoke

Writes ``benchmarks/results/bench_tokenize.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from bench_frontend import make_prompts, write_tokenizer  # noqa: E402

from kvplug.frontend.tokens import LocalTokenizer  # noqa: E402

TINY_LLAMA = Path.home() / ".cache" / "kvplug" / "tiny-llama"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(tokenizer_dir: Path, prompts: list[str], chunks: int) -> tuple[float, list, dict]:
    tok = LocalTokenizer(tokenizer_dir, prefix_cache_chunks=chunks)
    out = []
    c0 = cpu()
    for p in prompts:
        out.append(tok.encode(p))
    per_prompt = (cpu() - c0) / len(prompts) * 1e6
    # compared outside the timed loop (a list of a uint32 array costs more than the cache saves)
    out = [ids.tolist() if isinstance(ids, np.ndarray) else ids for ids in out]
    stats = dict(tok.prefix_cache.stats) if tok.prefix_cache else {}
    if tok.prefix_cache is not None:
        stats["enabled"] = tok.prefix_cache.enabled
    return per_prompt, out, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_tokenize.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    prompts = make_prompts(args.prompts)
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-tok-"))
    write_tokenizer(tmp)
    tokenizers = {"word-level (bench_frontend)": tmp}
    if (TINY_LLAMA / "tokenizer.json").exists():
        tokenizers["tiny-llama byte-level BPE"] = TINY_LLAMA
    results: dict = {"config": vars(args), "rows": []}
    for name, path in tokenizers.items():
        off, on, stats = [], [], {}
        for r in range(args.rounds):
            cpu_off, ids_off, _ = run(path, prompts, 0)
            cpu_on, ids_on, stats = run(path, prompts, 16_384)
            if ids_off != ids_on:
                sys.exit(f"{name}: the cached ids differ from the whole-text ids")
            off.append(cpu_off)
            on.append(cpu_on)
            print(
                f"round {r + 1}/{args.rounds}  {name:28s} cache off {cpu_off:6.1f} us  "
                f"on {cpu_on:6.1f} us  ({cpu_off / cpu_on:.2f}x)",
                flush=True,
            )
        results["rows"].append(
            {
                "tokenizer": name,
                "cpu_us_off": off,
                "cpu_us_on": on,
                "ratio": [a / b for a, b in zip(off, on, strict=True)],
                "cache_stats_last_round": stats,
            }
        )
    print("\n| tokenizer | CPU per prompt, cache off (us) | cache on (us) | off / on |")
    print("|---|---:|---:|---:|")
    for row in results["rows"]:
        print(
            f"| {row['tokenizer']} | {statistics.median(row['cpu_us_off']):.0f} "
            f"({min(row['cpu_us_off']):.0f}-{max(row['cpu_us_off']):.0f}) | "
            f"{statistics.median(row['cpu_us_on']):.0f} "
            f"({min(row['cpu_us_on']):.0f}-{max(row['cpu_us_on']):.0f}) | "
            f"{min(row['ratio']):.2f}-{max(row['ratio']):.2f}x |"
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

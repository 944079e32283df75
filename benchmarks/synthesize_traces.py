"""Traces kvplug was not tuned on, made by the ecosystem's own trace synthesizer.

NVIDIA's AIPerf (the benchmark client Dynamo documents; its prefix synthesis used to live in
Dynamo's ``benchmarks/data_generator``) rewrites a Mooncake-format trace with knobs a Dynamo
user reaches for: ``--synthesis-prefix-len-multiplier`` (stretch the shared prefixes),
``--synthesis-prompt-len-multiplier`` (scale each request's unshared tail),
``--synthesis-prefix-root-multiplier`` (spread requests over N copies of the prefix trees) and
``--synthesis-speedup-ratio`` (arrival rate). This script runs AIPerf's ``Synthesizer`` on the
Mooncake conversation trace with those knobs and writes the results into
``benchmarks/data/aiperf/`` (xz, which kvplug's trace reader takes like gzip) with a manifest
(AIPerf version, parameters, seed, sha256 and statistics of every file). kvplug never imports
AIPerf: it has heavy dependencies, so it runs in a venv of its own, and the traces are
committed so the benchmark (``benchmarks/bench_routing_quality.py --trace NAME=PATH``) does not
need it.

    python3 -m venv /tmp/aiperf_venv && /tmp/aiperf_venv/bin/pip install aiperf==0.13.0
    /tmp/aiperf_venv/bin/python benchmarks/synthesize_traces.py

Two things are done to the input first, and both are in the manifest:

* AIPerf 0.13.0 refuses the Mooncake conversation trace as it is (``ValueError: input_len
  (1902) < prefix_len (2048)``): 206 of its 12,031 requests end in a partial block that another
  request shares, so their shared prefix, counted in whole blocks, is longer than the request.
  Those requests are padded to whole blocks (44,641 tokens, 0.03 % of the trace's).
* ``--match-load`` (on by default) sets each variant's speedup ratio so that its new-token rate
  under an infinite shared cache (input tokens per second times the share of blocks not seen
  before) equals the original's: the variants change the trace's shape, not how busy the fleet
  is (``bench_fleet_conditions.py`` changes the load). ``--no-match-load`` keeps the
  multipliers alone, as a user of AIPerf would run them.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"
BUNDLED = ROOT / "kvplug" / "sim" / "data" / "mooncake_conversation_trace.jsonl.gz"
OUT = ROOT / "benchmarks" / "data" / "aiperf"
BLOCK = 512  # tokens per hash id in Mooncake's traces

# name -> AIPerf SynthesisParams fields (speedup_ratio is set by --match-load)
VARIANTS: dict[str, dict] = {
    "prefix-x2": {"prefix_len_multiplier": 2.0},
    "prefix-x0.5": {"prefix_len_multiplier": 0.5},
    "prompt-x2": {"prompt_len_multiplier": 2.0},
    "prompt-x0.5": {"prompt_len_multiplier": 0.5},
    "roots-x2": {"prefix_root_multiplier": 2},
    "roots-x4": {"prefix_root_multiplier": 4},
    "prefix-x2-roots-x2": {"prefix_len_multiplier": 2.0, "prefix_root_multiplier": 2},
}


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pad_shared_tails(trace: list[dict]) -> tuple[int, int]:
    """Pad requests whose leading run of shared blocks (AIPerf's "prefix": ids that occur in
    two or more requests) is longer than the request, so AIPerf accepts the trace."""
    counts = Counter(h for rec in trace for h in rec["hash_ids"])
    padded = tokens = 0
    for rec in trace:
        run = 0
        for h in rec["hash_ids"]:
            if counts[h] < 2:
                break
            run += 1
        if run * BLOCK > rec["input_length"]:
            padded += 1
            tokens += run * BLOCK - rec["input_length"]
            rec["input_length"] = run * BLOCK
    return padded, tokens


def trace_stats(trace: list[dict]) -> dict:
    """What decides a replay's load and reuse: rate, lengths, the infinite-cache repeat share."""
    seen: set[int] = set()
    repeats = occurrences = 0
    for rec in trace:
        for h in rec["hash_ids"]:
            occurrences += 1
            repeats += h in seen
            seen.add(h)
    tokens = sum(rec["input_length"] for rec in trace)
    span_s = (trace[-1]["timestamp"] - trace[0]["timestamp"]) / 1000 or 1.0
    repeat = repeats / occurrences if occurrences else 0.0
    return {
        "requests": len(trace),
        "span_s": round(span_s, 3),
        "input_tokens_mean": round(tokens / len(trace), 1),
        "input_blocks_max": max(len(rec["hash_ids"]) for rec in trace),
        "input_tokens_per_s": round(tokens / span_s, 1),
        "repeat_share": round(repeat, 4),
        "new_tokens_per_s": round(tokens / span_s * (1 - repeat), 1),
    }


def synthesize(trace: list[dict], params: dict, seed: int) -> list[dict]:
    from aiperf.common import random_generator as rng
    from aiperf.dataset.synthesis.models import SynthesisParams
    from aiperf.dataset.synthesis.synthesizer import Synthesizer

    rng.reset()
    rng.init(seed)  # the root-multiplier draws come from AIPerf's seeded generator
    return Synthesizer(SynthesisParams(block_size=BLOCK, **params)).synthesize_traces(
        [dict(rec) for rec in trace]
    )


def write_trace(path: Path, trace: list[dict]) -> str:
    body = "".join(
        json.dumps(
            {k: rec[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")},
            separators=(", ", ": "),
        )
        + "\n"
        for rec in trace
    ).encode()
    # xz: a quarter of gzip's size on these id lists, and the same trace gives the same bytes
    path.write_bytes(lzma.compress(body, preset=9 | lzma.PRESET_EXTREME))
    return hashlib.sha256(body).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--source", type=Path, default=SOURCE if SOURCE.is_file() else BUNDLED)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--match-load", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    try:
        version = metadata.version("aiperf")
    except metadata.PackageNotFoundError:
        ap.error("AIPerf is not installed in this Python: pip install aiperf==0.13.0 (own venv)")

    source = read_trace(args.source)
    padded, pad_tokens = pad_shared_tails(source)
    base = trace_stats(source)
    print(f"source {args.source.name}: {base}; padded {padded} requests (+{pad_tokens} tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "tool": f"aiperf {version} (aiperf.dataset.synthesis.Synthesizer)",
        "source": args.source.name,
        "seed": args.seed,
        "block_size": BLOCK,
        "padded_requests": padded,
        "padded_tokens": pad_tokens,
        "match_load": args.match_load,
        "source_stats": base,
        "traces": {},
    }
    for name in args.variants:
        params = dict(VARIANTS[name])
        if args.match_load:  # one pass at speedup 1 measures the shape's new-token rate
            shaped = trace_stats(synthesize(source, params, args.seed))
            params["speedup_ratio"] = round(
                base["new_tokens_per_s"] / shaped["new_tokens_per_s"], 3
            )
        trace = synthesize(source, params, args.seed)
        path = args.out / f"conversation_{name}.jsonl.xz"
        digest = write_trace(path, trace)
        stats = trace_stats(trace)
        manifest["traces"][name] = {
            "file": path.name,
            "params": params,
            "sha256_uncompressed": digest,
            "stats": stats,
        }
        print(f"{name}: {params} -> {path.name} ({path.stat().st_size // 1024} KiB) {stats}")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""List hashing, two builds of the core in one process: ``seq_hashes(list, 16)`` of build A and
build B taking turns round by round on the same Python lists (CPU time, best of `--repeat`
passes per round), so a change to the list reader is measured against the build it started
from under the same load.

    # a scratch build of the base commit, then the working tree's build against it
    mkdir /tmp/base && git archive <base> | tar -x -C /tmp/base
    (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/ab_seq_hashes.py --a /tmp/base --b .

Inputs: `--lists` token lists of 4-59 blocks of 16 tokens (vocabulary 128,000, one-digit ints:
what a decoded vLLM event carries), or `--tokens N` tokens each. Both builds must give the same
hashes (checked first). Prints each round and a table; writes benchmarks/results/ab_seq_hashes.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kvplug.core  # noqa: F401 - the package a build's module imports from

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_loader import load_extension  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load_core(folder: str):
    """The compiled core of a build folder (a source tree built with build_ext --inplace)."""
    return load_extension(folder, "kvplug", "_core", "kvplug._core")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="build folder A (the baseline)")
    ap.add_argument("--b", required=True, help="build folder B")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=20, help="passes per round; the best counts")
    ap.add_argument("--lists", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=0, help="tokens per list (0: 4-59 blocks)")
    ap.add_argument("--out", default=str(RESULTS / "ab_seq_hashes.json"))
    args = ap.parse_args(argv)

    builds = {"a": load_core(args.a), "b": load_core(args.b)}
    rng = np.random.default_rng(1)
    lists = [
        rng.integers(0, 128_000, args.tokens or 16 * int(rng.integers(4, 60))).tolist()
        for _ in range(args.lists)
    ]
    n_tokens = sum(map(len, lists))
    for x in lists:
        if builds["a"].seq_hashes(x, 16).tolist() != builds["b"].seq_hashes(x, 16).tolist():
            raise SystemExit("the two builds give different hashes")
    print(f"ab_seq_hashes: {args.lists} lists, {n_tokens / args.lists:.0f} tokens each on average")

    ns = {"a": [], "b": []}
    gc.disable()
    try:
        for r in range(args.rounds):
            for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                fn = builds[name].seq_hashes
                best = float("inf")
                for _ in range(args.repeat):
                    c0 = time.process_time_ns()
                    for x in lists:
                        fn(x, 16)
                    best = min(best, time.process_time_ns() - c0)
                ns[name].append(best / n_tokens)
            print(
                f"round {r + 1}/{args.rounds}: A {ns['a'][-1]:.3f} ns/token, "
                f"B {ns['b'][-1]:.3f}, A/B {ns['a'][-1] / ns['b'][-1]:.3f}, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        gc.enable()
    ratio = [a / b for a, b in zip(ns["a"], ns["b"], strict=True)]
    res = {
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
        "a": os.path.abspath(args.a),
        "b": os.path.abspath(args.b),
        "lists": args.lists,
        "tokens_per_list_mean": n_tokens / args.lists,
        "ns_per_token_a": ns["a"],
        "ns_per_token_b": ns["b"],
        "a_over_b": ratio,
    }
    print("| CPU ns per token, call included | median | range over rounds |")
    print("|---|---:|---:|")
    for label, xs in (("A", ns["a"]), ("B", ns["b"]), ("A / B (per round)", ratio)):
        print(f"| {label} | {statistics.median(xs):.3f} | {min(xs):.3f}-{max(xs):.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()

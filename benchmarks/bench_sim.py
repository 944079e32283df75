"""Routing policies on the simulated fleet: the whole Mooncake conversation trace on 8 engines.

Same as ``kvplug bench`` (see docs/sim.md); kept here so every area's benchmark runs from
``benchmarks/``. Prints the table, writes ``benchmarks/results/sim_bench.json`` with each
policy's ratios to round-robin measured in the same run. Extra arguments go to ``kvplug bench``:

    python benchmarks/bench_sim.py                      # 9 policies, ~6 s on 2 cores
    python benchmarks/bench_sim.py --plots docs/img     # + PNG plots
    python benchmarks/bench_sim.py --limit 2000 --policies kv round-robin
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

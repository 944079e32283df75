"""The request path's deadline: ``asyncio.timeout`` against ``kvplug.frontend.timeouts.within``.

``kvplug serve`` puts one deadline (``--request-timeout``) around each non-streamed request's
dispatch. This measures what arming and disarming it costs per request, the awaited work being
a coroutine that returns at once (so the figure is the deadline's own cost), under uvloop (what
``kvplug serve`` runs when installed) and asyncio's default loop. Rounds alternate the two forms
on identical work; each figure is the median of a round's repeats, reported as the range over
rounds.

    python benchmarks/bench_deadline.py [--rounds 5] [--calls 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.frontend.timeouts import within  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_deadline.json"


async def _leaf() -> int:
    return 1


async def _plain(n: int) -> None:
    for _ in range(n):
        await _leaf()


async def _asyncio_timeout(n: int) -> None:
    for _ in range(n):
        async with asyncio.timeout(30):
            await _leaf()


async def _within(n: int) -> None:
    for _ in range(n):
        await within(_leaf(), 30)


FORMS = {"no deadline": _plain, "asyncio.timeout": _asyncio_timeout, "within": _within}


def _loops() -> dict:
    loops = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop

        loops = {"uvloop": uvloop.new_event_loop, **loops}
    except ImportError:
        pass
    return loops


def measure(loop_factory, form, calls: int, repeats: int) -> float:
    """Median CPU microseconds per call over ``repeats`` runs of ``calls`` calls."""
    per_call = []
    loop = loop_factory()
    try:
        for _ in range(repeats):
            t0 = time.thread_time()
            loop.run_until_complete(form(calls))
            per_call.append((time.thread_time() - t0) / calls * 1e6)
    finally:
        loop.close()
    return statistics.median(per_call)


def main() -> int:
    if sys.version_info < (3, 11):
        print("within() is wait_for on 3.10; nothing to compare")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    loops = _loops()
    rows: dict[str, dict[str, list[float]]] = {lp: {f: [] for f in FORMS} for lp in loops}
    for r in range(args.rounds):
        for lp, factory in loops.items():
            for name, form in FORMS.items():
                rows[lp][name].append(measure(factory, form, args.calls, args.repeats))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'loop':<8} {'form':<16} {'us/call median':>15} {'range over rounds':>20}")
    for lp, forms in rows.items():
        for name, xs in forms.items():
            rng = f"{min(xs):.2f}-{max(xs):.2f}"
            print(f"{lp:<8} {name:<16} {statistics.median(xs):>15.2f} {rng:>20}")
    out = {
        "config": vars(args),
        "python": sys.version.split()[0],
        "load_average": os.getloadavg(),
        "us_per_call": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

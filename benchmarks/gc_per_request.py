"""What CPython's garbage collector costs ``kvplug serve`` per request, and what leaves cycles.

A request whose objects end up in a reference cycle is freed by the collector, not by its
reference counts: each such object counts toward the next first-generation pass, and each pass
walks every young object. This starts ``kvplug serve`` (mode ``kv``, token-id prompts, two
``benchmarks/instant_engine.py`` engines, as ``bench_frontend.py`` runs it) from one or two
source trees with a ``sitecustomize`` that times every collection (``gc.callbacks``, the
thread's CPU clock), drives each with wrk at 16 connections, alternating the trees per round,
and reports per request:

* collections per generation and the CPU they took (us per request);
* the objects the collector freed (cyclic garbage) per request;
* what they are: for one second the server keeps its cyclic garbage (``gc.DEBUG_SAVEALL``)
  and counts it by type.

    python benchmarks/gc_per_request.py --baseline-src /tmp/main-export --baseline-label main

Writes ``benchmarks/results/gc_per_request.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_frontend as bf  # noqa: E402

from kvplug.testing import free_port, stop_process  # noqa: E402

# loaded by the server through PYTHONPATH: SIGUSR1 writes the collector's totals, SIGUSR2
# keeps one second of cyclic garbage and writes it by type
SITECUSTOMIZE = r"""
import collections, gc, json, os, signal, threading, time

_out = os.environ["KVPLUG_GC_STATS"]
_totals = {g: [0, 0, 0] for g in range(3)}  # passes, CPU ns, objects collected
_start = [0]


def _timed(phase, info):
    if phase == "start":
        _start[0] = time.thread_time_ns()
    else:
        t = _totals[info["generation"]]
        t[0] += 1
        t[1] += time.thread_time_ns() - _start[0]
        t[2] += info["collected"]


gc.callbacks.append(_timed)


def _write(name, data):
    tmp = _out + "." + name + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, _out + "." + name)


def _totals_now(*_):
    _write("totals", {str(g): v for g, v in _totals.items()})


def _keep_garbage():
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    time.sleep(1.0)
    gc.set_debug(0)
    gc.collect()  # what the second held
    kinds = collections.Counter(
        f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
    )
    gc.garbage.clear()
    _write("garbage", dict(kinds.most_common(20)))


signal.signal(signal.SIGUSR1, _totals_now)
signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=_keep_garbage).start())
"""


def read_json(path: Path, deadline: float = 10.0) -> dict:
    end = time.monotonic() + deadline
    while not path.exists():
        if time.monotonic() > end:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.05)
    data = json.loads(path.read_text())
    path.unlink()
    return data


def lane_served(url: str) -> int:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith('kvplug_router_stat{stat="http_lane.served"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError("no http_lane.served in /metrics")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", default=None, help="also this source tree (PYTHONPATH)")
    ap.add_argument("--baseline-label", default="baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gc_per_request.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: one round of 1 s")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 1
    if shutil.which("wrk") is None:
        sys.exit("gc_per_request needs wrk (apt-get install -y wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-gc-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    procs: list[subprocess.Popen] = []
    results: dict = {"config": vars(args), "load_average_before": os.getloadavg()}
    try:
        script = tmp / "post.lua"
        script.write_text(bf.WRK_LUA)
        engines = bf.start_instant_engines(2, procs)
        prompts = bf.make_prompts(2000)
        bodies = bf.write_bodies(tmp / "ids.jsonl", [bf.token_ids(p) for p in prompts], False, 8)
        bf.write_tokenizer(tmp)
        trees = [("this tree", str(ROOT))]
        if args.baseline_src:
            trees.append((args.baseline_label, str(Path(args.baseline_src).resolve())))
        targets = []
        for i, (label, src) in enumerate(trees):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stats = tmp / f"stats-{i}"
            env = {
                **os.environ,
                "PYTHONPATH": f"{tmp / 'site'}:{src}",
                "KVPLUG_GC_STATS": str(stats),
            }
            p = bf.start(
                bf.kvplug_cmd(port, engines, tmp), url + "/v1/completions", bodies, tmp, env
            )
            procs.append(p)
            bf.run_wrk(url, script, bodies, 16, 2, p.pid)  # warm
            targets.append({"name": label, "url": url, "proc": p, "stats": stats, "runs": []})
        for rnd in range(args.rounds):
            order = targets if rnd % 2 == 0 else targets[::-1]
            for t in order:
                p = t["proc"]
                p.send_signal(signal.SIGUSR1)
                before = read_json(Path(str(t["stats"]) + ".totals"))
                run = bf.run_wrk(t["url"], script, bodies, 16, args.seconds, p.pid)
                p.send_signal(signal.SIGUSR1)
                after = read_json(Path(str(t["stats"]) + ".totals"))
                n = run["requests"]
                row = {
                    "requests": n,
                    "requests_per_s": run["requests_per_s"],
                    "cpu_ms_per_request": run["router_cpu_ms_per_request"],
                }
                for g in range(3):
                    b, a = before[str(g)], after[str(g)]
                    row[f"gen{g}_passes_per_1k"] = (a[0] - b[0]) / n * 1e3
                    row[f"gen{g}_us_per_request"] = (a[1] - b[1]) / n / 1e3
                    row[f"gen{g}_collected_per_request"] = (a[2] - b[2]) / n
                row["gc_us_per_request"] = sum(row[f"gen{g}_us_per_request"] for g in range(3))
                t["runs"].append(row)
                print(
                    f"round {rnd + 1}/{args.rounds}  {t['name']:<12} "
                    f"{run['requests_per_s']:6.0f} req/s  CPU {row['cpu_ms_per_request']:.3f} "
                    f"ms/req  collector {row['gc_us_per_request']:5.2f} us/req  freed "
                    f"{sum(row[f'gen{g}_collected_per_request'] for g in range(3)):5.2f} "
                    "objects/req",
                    flush=True,
                )
        for t in targets:  # what the cyclic garbage is, one second under load
            served0 = lane_served(t["url"])
            wrk = subprocess.Popen(
                ["wrk", "-t1", "-c16", "-d3", "-s", str(script), t["url"], "--", str(bodies)],
                stdout=subprocess.DEVNULL,
            )
            time.sleep(1.0)
            t["proc"].send_signal(signal.SIGUSR2)
            garbage = read_json(Path(str(t["stats"]) + ".garbage"))
            wrk.wait()
            t["garbage_1s"] = garbage
            t["garbage_window_requests_approx"] = (lane_served(t["url"]) - served0) / 3
        results["targets"] = [
            {
                "name": t["name"],
                "runs": t["runs"],
                "gc_us_per_request_median": statistics.median(
                    r["gc_us_per_request"] for r in t["runs"]
                ),
                "cpu_ms_per_request_median": statistics.median(
                    r["cpu_ms_per_request"] for r in t["runs"]
                ),
                "garbage_1s": t["garbage_1s"],
                "garbage_window_requests_approx": t["garbage_window_requests_approx"],
            }
            for t in targets
        ]
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print()
    print("| tree | CPU ms/req (rounds) | collector us/req (rounds) | objects freed by it /req |")
    print("|---|---:|---:|---:|")
    for t in results["targets"]:
        runs = t["runs"]
        cpu = [r["cpu_ms_per_request"] for r in runs]
        gcu = [r["gc_us_per_request"] for r in runs]
        freed = [sum(r[f"gen{g}_collected_per_request"] for g in range(3)) for r in runs]
        print(
            f"| {t['name']} | {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) | "
            f"{statistics.median(gcu):.2f} ({min(gcu):.2f}-{max(gcu):.2f}) | "
            f"{statistics.median(freed):.2f} |"
        )
    for t in results["targets"]:
        n = t["garbage_window_requests_approx"] or 1
        kinds = ", ".join(f"{k} {v / n:.1f}" for k, v in list(t["garbage_1s"].items())[:8])
        print(f"{t['name']}: cyclic garbage per request (one second): {kinds or 'none'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

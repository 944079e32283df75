"""How ``kvplug serve --processes N`` shares one wrk run between its processes.

The kernel hands each new connection to one of the N ``SO_REUSEPORT`` listeners by a hash of
the client's address and port, and a kept-alive connection stays there; with wrk's 16
connections opened once, the split is fixed for the whole run. Per run this records, for each
serving process: the connections it holds (sampled mid-run from ``/proc``), the requests it
answered (its ``kvplug_requests_total`` from the merged ``/metrics``), its CPU share of one
core and its CPU per request. Bench_frontend's setup: two instant engines, ~512-token token-id
prompts, 16 connections, one wrk thread.

    python benchmarks/processes_spread.py [--src .] [--processes 2] [--rounds 6] \
        [--flags=--data-path,native]

Writes ``benchmarks/results/processes_spread.json`` and prints per-run rows and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_frontend as bf  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvplug.testing import free_port, stop_process  # noqa: E402


def serving_processes(supervisor: int) -> list[int]:
    """The supervisor's children (the serving processes), by pid."""
    kids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(bf._stat(int(entry.name))[1]) == supervisor:
                    kids.append(int(entry.name))
            except OSError:
                continue
    return sorted(kids)


def cpu_of(pid: int) -> float:
    fields = bf._stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def established_inodes(port: int) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(f[9])
    return out


def connections_by_process(pids: list[int], port: int) -> dict[int, int]:
    inodes = established_inodes(port)
    held = {}
    for pid in pids:
        n = 0
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(fd.path)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                n += 1
        held[pid] = n
    return held


SYNC_STATS = ("replica_sync.published_events", "replica_sync.published_batches")


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Per ``process`` label, from the merged ``/metrics``: requests answered so far, and the
    load sync's events and batches sent."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvplug_requests_total":
                key = "requests"
            elif s.name == "kvplug_router_stat" and s.labels.get("stat") in SYNC_STATS:
                key = s.labels["stat"].split(".", 1)[1]
            else:
                continue
            mine = out.setdefault(s.labels.get("process", "0"), {})
            mine[key] = mine.get(key, 0.0) + s.value
    return out


def one_run(url: str, port: int, script: Path, bodies: Path, seconds: int, sup: int) -> dict:
    pids = serving_processes(sup)
    seen0 = scrape(url)
    cpu0 = {p: cpu_of(p) for p in pids}
    t0 = time.monotonic()
    wrk = subprocess.Popen(
        ["wrk", "-t1", "-c16", f"-d{seconds}", "--timeout", "10", "-s", str(script), url]
        + ["--", str(bodies)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(seconds / 2)
    conns = connections_by_process(pids, port)
    out, _ = wrk.communicate()
    wall = time.monotonic() - t0
    cpu1 = {p: cpu_of(p) for p in pids}
    seen1 = scrape(url)
    line = next(ln for ln in out.splitlines() if ln.startswith("WRKJSON "))
    total = json.loads(line[len("WRKJSON ") :])["requests"]
    rows = []
    for index, pid in enumerate(pids):  # forked in index order: pid order is index order
        label = str(index)
        delta = {
            k: seen1.get(label, {}).get(k, 0.0) - seen0.get(label, {}).get(k, 0.0)
            for k in ("requests", "published_events", "published_batches")
        }
        served = delta["requests"]
        cpu = cpu1[pid] - cpu0[pid]
        rows.append(
            {
                "process": index,
                "pid": pid,
                "connections": conns[pid],
                "requests": served,
                "cpu_share": cpu / wall,
                "cpu_ms_per_request": cpu / served * 1e3 if served else None,
                "sync_events_per_request": delta["published_events"] / served if served else None,
                "sync_batches_per_s": delta["published_batches"] / wall,
            }
        )
    return {"requests": total, "requests_per_s": total / wall, "processes": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT), help="the kvplug source tree to serve from")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--flags", default="--data-path,native", help="more serve flags, commas")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "processes_spread.json"))
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("processes_spread needs wrk (apt-get install -y wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-spread-"))
    procs: list[subprocess.Popen] = []
    runs = []
    try:
        script = tmp / "post.lua"
        script.write_text(bf.WRK_LUA)
        engines = bf.start_instant_engines(2, procs)
        ids = [bf.token_ids(p) for p in bf.make_prompts(2000)]
        bodies = bf.write_bodies(tmp / "ids.jsonl", ids, False, 8)
        probe = bf.write_bodies(tmp / "probe.jsonl", ids[:1], False, 8)
        bf.write_tokenizer(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        flags = [f for f in args.flags.split(",") if f]
        cmd = bf.kvplug_cmd(port, engines, tmp, "--processes", str(args.processes), *flags)
        env = {**os.environ, "PYTHONPATH": str(Path(args.src).resolve())}
        sup = bf.start(cmd, url + "/v1/completions", probe, tmp, env)
        procs.append(sup)
        one_run(url, port, script, bodies, 1, sup.pid)  # warm
        for rnd in range(args.rounds):
            run = one_run(url, port, script, bodies, args.seconds, sup.pid)
            runs.append(run)
            print(
                f"run {rnd + 1}/{args.rounds}  {run['requests_per_s']:.0f} req/s  "
                + "  ".join(
                    f"p{r['process']}: {r['connections']} conns {r['requests']:.0f} req "
                    f"cpu {r['cpu_share']:.2f} {r['cpu_ms_per_request'] or 0:.3f} ms/req "
                    f"sync {r['sync_events_per_request'] or 0:.2f} ev/req "
                    f"{r['sync_batches_per_s']:.0f} batches/s"
                    for r in run["processes"]
                ),
                flush=True,
            )
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    # the busier process of each run against the other(s): how uneven the split is
    busy_share = [max(r["requests"] for r in run["processes"]) / run["requests"] for run in runs]
    busy_cpu = [max(r["cpu_share"] for r in run["processes"]) for run in runs]
    idle_cpu = [min(r["cpu_share"] for r in run["processes"]) for run in runs]
    summary = {
        "busiest_process_request_share": busy_share,
        "busiest_process_cpu_share": busy_cpu,
        "idlest_process_cpu_share": idle_cpu,
    }
    for k, v in summary.items():
        print(f"{k:<36} median {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"config": vars(args), "runs": runs, "summary": summary}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Two or more ``kvplug serve`` builds (or the floor / ceiling proxies) side by side: CPU per
request at 16 connections, alternating per round.

``bench_frontend.py`` rotates many targets and modes; this runs one mode against a few servers
started once, many short rounds, the order reversed every other round, so a before/after pair
is read from the same moments of a shared machine. Each target is ``LABEL=SRC_DIR`` (a
``kvplug serve`` from that source tree, via ``PYTHONPATH``; ``LABEL=SRC_DIR,--flag,value`` adds
serve flags), ``floor`` (``floor_proxy.py``) or ``ceiling`` (``floor_proxy.py --route``), or
``LABEL=SRC_DIR,floor[,--flag]`` / ``LABEL=SRC_DIR,ceiling[,--flag]`` (this checkout's
``floor_proxy.py`` on that tree's kvplug: ``,floor,--native`` compares two builds of the compiled
lane alone); token-id prompts, two instant engines, as ``bench_frontend.py`` runs them.

A ``kvplug serve`` target routes with Dynamo's cost (``--router-mode kv``), as
``bench_frontend.py``'s kvplug rows do, unless its flags name a ``--router-mode``: give
``,--router-mode,affinity`` to measure the default routing. Each target's routing and full
command are printed at the start and kept in the JSON.

    python benchmarks/ab_frontend.py main=/tmp/main this=. --rounds 10 [--mode stream]
    python benchmarks/ab_frontend.py main=/tmp/main,floor,--native this=.,floor,--native

Writes ``benchmarks/results/ab_frontend.json`` and prints per-round and median figures.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_frontend as bf  # noqa: E402

from kvplug.testing import free_port, stop_process  # noqa: E402


def routing_of(cmd: list[str]) -> str:
    """What a target's decision is: a proxy's, or the ``--router-mode`` (and affinity setting)
    its ``kvplug serve`` command line gives."""
    if "kvplug.cli" not in cmd:
        return "proxy (" + ("route" if "--route" in cmd else "no routing") + ")"
    mode = cmd[cmd.index("--router-mode") + 1]  # bench_frontend.kvplug_cmd always names one
    if "--router-affinity" in cmd:
        mode += " " + cmd[cmd.index("--router-affinity") + 1]
    return f"--router-mode {mode}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", help="LABEL=SRC_DIR[,--flag,...], floor or ceiling")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--mode", choices=("plain", "stream"), default="plain")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ab_frontend.json"))
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("ab_frontend needs wrk (apt-get install -y wrk)")
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-ab-"))
    procs: list[subprocess.Popen] = []
    results: dict = {"config": vars(args), "load_average": [os.getloadavg()[0]]}
    try:
        script = tmp / "post.lua"
        script.write_text(bf.WRK_LUA)
        engines = bf.start_instant_engines(2, procs)
        ids = [bf.token_ids(p) for p in bf.make_prompts(2000)]
        bodies = bf.write_bodies(tmp / "ids.jsonl", ids, args.mode == "stream", 8)
        probe = bf.write_bodies(tmp / "probe.jsonl", ids[:1], False, 8)
        bf.write_tokenizer(tmp)
        targets = []
        for spec in args.targets:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = None
            if spec in ("floor", "ceiling"):
                label = spec
                cmd = [sys.executable, str(ROOT / "benchmarks" / "floor_proxy.py"), str(port)]
                cmd += engines + (["--route"] if spec == "ceiling" else [])
            else:
                label, _, rest = spec.partition("=")
                src, *flags = rest.split(",")
                if flags and flags[0] in ("floor", "ceiling"):  # this floor_proxy, src's kvplug
                    cmd = [sys.executable, str(ROOT / "benchmarks" / "floor_proxy.py"), str(port)]
                    cmd += engines + (["--route"] if flags[0] == "ceiling" else []) + flags[1:]
                else:
                    cmd = bf.kvplug_cmd(port, engines, tmp, *flags)
                env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            p = bf.start(cmd, url + "/v1/completions", probe, tmp, env)
            procs.append(p)
            bf.run_wrk(url, script, bodies, 16, 1, p.pid)  # warm
            routing = routing_of(cmd)
            print(f"{label}: {routing}: {' '.join(cmd)}", flush=True)
            targets.append(
                {
                    "name": label,
                    "url": url,
                    "pid": p.pid,
                    "runs": [],
                    "routing": routing,
                    "command": cmd,
                }
            )
        for rnd in range(args.rounds):
            order = targets if rnd % 2 == 0 else targets[::-1]
            for t in order:
                t["runs"].append(bf.run_wrk(t["url"], script, bodies, 16, args.seconds, t["pid"]))
            results["load_average"].append(os.getloadavg()[0])
            print(
                f"round {rnd + 1}/{args.rounds}  "
                + "  ".join(
                    f"{t['name']} {t['runs'][-1]['router_cpu_ms_per_request']:.3f} ms/req "
                    f"{t['runs'][-1]['requests_per_s']:.0f} req/s"
                    for t in targets
                ),
                flush=True,
            )
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    summary = []
    for t in targets:
        cpu = [r["router_cpu_ms_per_request"] for r in t["runs"]]
        rps = [r["requests_per_s"] for r in t["runs"]]
        summary.append(
            {
                "target": t["name"],
                "routing": t["routing"],
                "command": t["command"],
                "cpu_ms_per_request_rounds": cpu,
                "requests_per_s_rounds": rps,
                "cpu_ms_per_request_median": statistics.median(cpu),
                "requests_per_s_median": statistics.median(rps),
            }
        )
        print(
            f"{t['name']:<10} CPU ms/req median {statistics.median(cpu):.3f} "
            f"({min(cpu):.3f}-{max(cpu):.3f})  req/s median {statistics.median(rps):.0f} "
            f"({min(rps):.0f}-{max(rps):.0f})"
        )
    if len(summary) >= 2:  # the first target against each other, round by round
        first = summary[0]["cpu_ms_per_request_rounds"]
        for other in summary[1:]:
            lower = sum(
                a < b for a, b in zip(first, other["cpu_ms_per_request_rounds"], strict=True)
            )
            name, rounds = summary[0]["target"], len(first)
            print(f"{name} below {other['target']} in {lower} of {rounds} rounds")
    results["targets"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

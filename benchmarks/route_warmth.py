"""Why ``Router.route`` costs more inside ``kvplug serve`` than in ``bench_router.py``.

Runs a real ``kvplug serve`` (mode ``kv``, defaults, two instant engines, 512 token-id prompts as
``bench_frontend.py`` sends them) with each routing decision instrumented by the thread's CPU
clock, drives it with wrk at 16 connections, and measures the same decision three ways:

* ``in serve``: ``route`` as the server makes it, between two requests' HTTP work;
* ``preview first``: a ``preview`` of the same request just before (the same stages but no
  booking), i.e. the decision cold;
* ``route after preview``: the ``route`` that follows it, i.e. the same decision warm;
* ``tight loop``: after the load, the last request routed and finished 5,000 times in a row
  on the live router (warm, nothing in flight).

Both runs (plain, then with the preview) go to the same server; the preview doubles the
decision work, so read the two warm/cold rows against each other, not against ``in serve``.

    python benchmarks/route_warmth.py [--seconds 5] [--out benchmarks/results/route_warmth.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def serve_instrumented(report: str, argv: list[str]) -> int:
    """In the server process: wrap Router.route; SIGUSR1 toggles the preview, SIGUSR2 runs the
    tight loop and writes the report."""
    import dataclasses

    from kvplug.cli import main
    from kvplug.router import Router

    acc: dict[str, list[int]] = {}
    state = {"preview": False, "last": None}
    route = Router.route

    def add(key: str, ns: int) -> None:
        s = acc.setdefault(key, [0, 0])
        s[0] += ns
        s[1] += 1

    def timed_route(self, req):
        state["last"] = (self, req)
        clock = time.thread_time_ns
        if state["preview"]:
            t0 = clock()
            self.preview(req)
            t1 = clock()
            d = route(self, req)
            add("preview first", t1 - t0)
            add("route after preview", clock() - t1)
            return d
        t0 = clock()
        d = route(self, req)
        add("in serve", clock() - t0)
        return d

    def tight(*_):
        router, req = state["last"]
        n = 5000
        t0 = time.thread_time_ns()
        for i in range(n):
            r = dataclasses.replace(req, request_id=f"tight{i}")
            route(router, r)
            router.on_finish(r.request_id)
        add("tight loop (route + finish)", (time.thread_time_ns() - t0) // n)
        out = {k: {"decisions": c, "us_per_decision": t / c / 1e3} for k, (t, c) in acc.items()}
        out["tight loop (route + finish)"]["decisions"] = n
        Path(report).write_text(json.dumps(out))

    Router.route = timed_route  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, lambda *_: state.update(preview=True))
    signal.signal(signal.SIGUSR2, tight)
    sys.argv = ["kvplug", *argv]
    return main()


def drive(args) -> dict:
    import bench_frontend as bf

    tmp = Path(tempfile.mkdtemp(prefix="kvplug-warmth-"))
    prompts = bf.make_prompts(2000)
    bodies = bf.write_bodies(tmp / "ids.jsonl", [bf.token_ids(p) for p in prompts], False, 8)
    script = tmp / "post.lua"
    script.write_text(bf.WRK_LUA)
    bf.write_tokenizer(tmp)
    ports = [bf.free_port() for _ in range(2)]
    engines = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "instant_engine.py"), *map(str, ports)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs = [engines]
    try:
        assert engines.stdout is not None and engines.stdout.readline().strip() == "ready"
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        port = bf.free_port()
        report = tmp / "report.json"
        serve_argv = bf.kvplug_cmd(port, urls, tmp)
        serve_argv = serve_argv[serve_argv.index("serve") :]
        cmd = [sys.executable, __file__, "--_serve", str(report), "--", *serve_argv]
        url = f"http://127.0.0.1:{port}"
        server = bf.start(cmd, url + "/v1/completions", bodies, tmp)
        procs.append(server)
        for phase in ("warm-up", "in serve", "with preview"):
            if phase == "with preview":
                server.send_signal(signal.SIGUSR1)
            r = bf.run_wrk(url, script, bodies, 16, args.seconds, server.pid)
            print(f"{phase}: {r['requests_per_s']:.0f} req/s", file=sys.stderr, flush=True)
        server.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return json.loads(report.read_text())
    finally:
        for p in procs:
            bf.stop_process(p)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--_serve":
        return serve_instrumented(sys.argv[2], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "route_warmth.json"))
    args = ap.parse_args()
    load0 = os.getloadavg()
    rows = drive(args)
    print(f"{'decision':<30} {'decisions':>10} {'CPU us/decision':>16}")
    for k, v in rows.items():
        print(f"{k:<30} {v['decisions']:>10} {v['us_per_decision']:>16.1f}")
    out = {"config": vars(args), "load_average_before": load0, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

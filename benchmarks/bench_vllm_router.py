"""vllm-router's ``kv_aware`` policy vs ``kvplug serve`` on one request stream: hit rate and TTFT.

For each router a fresh fleet of simulated vLLM engines runs in this process with vLLM's own
block hashes (``kvplug sim --block-hashes vllm``: vLLM's default ``sha256`` chain with its
default NONE_HASH seed, low-64-bit ints in the events, topic ``""``, as ``vllm serve`` sends
them), ``/tokenize``, ``/kv_event_sources``, ``/get_server_info`` and vLLM's ``/metrics``; the
router runs as its own process:

* ``vllm-router``: ``vllm-router --policy kv_aware`` (0.1.17) with one static ZMQ source per
  engine (``--kv-event-source URL=tcp://...``, replay endpoints, ``--kv-event-model``);
* ``vllm-router-rr``: the same binary with ``--policy round_robin`` (a cache-blind reference);
* ``kvplug``: ``kvplug serve --worker URL ...`` (discovers each engine's events through
  ``/kv_event_sources``; its default routing, ``affinity-fitted``);
* ``kvplug-kv``: the same with ``--router-mode kv`` (Dynamo's cost alone);
* ``kvplug-protect`` (on request): the same with ``--router-affinity affinity-protect``, the
  default routing before the balance guard;
* ``kvplug-balance`` (on request): the same with ``--router-affinity affinity-balance``, the
  default routing before issue 14's twenty-fourth pass (the shipped prefill model; runs made
  before it, ``*_fitted.json``, name today's default ``kvplug-fitted`` and this one ``kvplug``).

The request stream is the start of the bundled Mooncake conversation trace, as in
``bench_sglang_router.py`` (text prompts whose 512-character blocks follow the trace's
``hash_ids``; byte-level tokens on the engines), sent at the trace's arrival times
(``--speedup`` compresses them) as streaming completions. Reported per router: prompt-token hit
rate on the engines (cached / prompt tokens, the engines' own count: what each request's
``usage.prompt_tokens_details.cached_tokens`` adds up to), TTFT p50/p90/p99 measured by the
client, errors, requests per engine. JSON to ``benchmarks/results/vllm_router.json``.

    python benchmarks/bench_vllm_router.py                    # 600 requests, 4 engines
    python benchmarks/bench_vllm_router.py --limit 100 --routers vllm-router kvplug
    python benchmarks/bench_vllm_router.py --workload multi-turn:duration=120,think=5 --limit 300
    python benchmarks/bench_vllm_router.py --rounds 3    # ranges over rounds, order flipped each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_sglang_router import (  # noqa: E402
    affinity_stats,
    prompt_text,
    replay,
    report_rounds,
    reset_engine_counters,
    run_rounds,
    start_fleet,
    stop_router,
    summary,
    wait_routable,
)

from kvplug.sim.server import FleetOptions, SimServer  # noqa: E402
from kvplug.sim.steptime import parse_slowdowns  # noqa: E402
from kvplug.sim.traces import load_trace, parse_workload  # noqa: E402
from kvplug.testing import free_ports  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vllm_router.json"
ROUTERS = (
    "vllm-router",
    "vllm-router-rr",
    "kvplug",
    "kvplug-kv",
    "kvplug-protect",
    "kvplug-balance",
    "kvplug-one-model",
)


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` script next to this interpreter (a venv), else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def router_command(name: str, port: int, servers: list[SimServer], opts: FleetOptions) -> list[str]:
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    if name.startswith("kvplug"):
        cmd = [sys.executable, "-m", "kvplug.cli", "serve", "--port", str(port)]
        if name == "kvplug-kv":
            cmd += ["--router-mode", "kv"]
        if name == "kvplug-protect":  # the default routing before the balance guard
            cmd += ["--router-affinity", "affinity-protect"]
        if name == "kvplug-balance":  # the default before its prefill model was fitted
            cmd += ["--router-affinity", "affinity-balance"]
        if name == "kvplug-one-model":  # the default with one prefill model for every engine
            cmd += ["--router-affinity", "affinity-fitted:fit_speeds=0"]
        cmd += ["--admin-port", str(free_ports(1)[0]), "--kv-block-size", str(opts.block_size)]
        for u in urls:
            cmd += ["--worker", u]
        return cmd
    binary = vllm_router_binary()
    if binary is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
    policy = "kv_aware" if name == "vllm-router" else "round_robin"
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-port", str(free_ports(1)[0]), "--worker-urls", *urls]
    if policy == "kv_aware":
        for u, s in zip(urls, servers, strict=True):
            cmd += ["--kv-event-source", f"{u}={s.bound[0]}"]
            cmd += ["--kv-event-replay-source", f"{u}={s.bound[1]}"]
        cmd += ["--kv-event-block-size", str(opts.block_size), "--kv-event-model", opts.model]
    return cmd


async def run_router(name: str, args, records, texts, log_dir: Path) -> dict:
    n = args.engines
    ports = free_ports(3 * n + 1)
    base = FleetOptions(
        engines=n,
        block_size=args.block_size,
        speed=args.speed,
        capacity_blocks=args.capacity_blocks,
        block_hashes="vllm",  # vLLM's defaults: sha256, seed "vllm-none-hash", topic ""
        slowdowns=args.slowdowns,
    )
    servers = await start_fleet(SimServer, base, ports)
    port = ports[-1]
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RUST_LOG=os.environ.get("RUST_LOG", "info"))
    proc = subprocess.Popen(
        router_command(name, port, servers, base),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "w"),  # noqa: SIM115 - closed with the process
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    out: dict = {"ttft": [], "errors": 0}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    wall = 0.0
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await wait_routable(session, url, base.model, proc, time.monotonic() + 60)
            await asyncio.sleep(1.0)  # subscribers connected (ZMQ slow joiner) before the stream
            reset_engine_counters(servers)
            wall = await replay(session, url, base.model, records, texts, args, name, out)
            if name.startswith("kvplug"):
                out["affinity"] = await affinity_stats(session, url)
    finally:
        stop_router(proc)
        for s in servers:
            await s.stop()
    return {**summary(name, records, servers, out, wall), "log": str(log_path)}


def available(name: str) -> bool:
    return name.startswith("kvplug") or vllm_router_binary() is not None


def table(rows: list[dict], base: dict | None) -> str:
    head = (
        f"{'router':<15} {'hit rate':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'p99 vs base':>11} {'errors':>6}  requests per engine"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p99 = r["ttft_p99_s"] / base["ttft_p99_s"] if base else float("nan")
        lines.append(
            f"{r['router']:<15} {r['hit_rate']:>8.1%} {r['ttft_p50_s']:>8.3f}s "
            f"{r['ttft_p90_s']:>7.3f}s {r['ttft_p99_s']:>7.3f}s {p99:>10.2f}x "
            f"{r['errors']:>6}  {r['per_engine_requests']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS[:4]))
    p.add_argument("--limit", type=int, default=600, help="trace requests (default 600)")
    p.add_argument(
        "--workload",
        default=None,
        help="a generated workload instead of the trace, as kvplug bench takes it, e.g. "
        "multi-turn:duration=120,think=5 (cut to --limit requests)",
    )
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16, help="engine block size")
    p.add_argument("--capacity-blocks", type=int, default=None)
    p.add_argument("--speed", type=float, default=1.0, help="engine model speed (wall)")
    p.add_argument(
        "--slowdowns",
        type=parse_slowdowns,
        default=(),
        help="a mixed fleet: engine i's step times x the i-th factor (e.g. 1,2)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="trace arrival compression")
    p.add_argument("--max-output", type=int, default=64, help="cap on output tokens")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--rounds", type=int, default=1, help="every router once per round, the order flipped"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: >= 1")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    routers = [r for r in args.routers if available(r)]
    for r in set(args.routers) - set(routers):
        print(f"skipping {r}: vllm-router is not installed", file=sys.stderr)
    if args.workload:
        records = parse_workload(args.workload)[: args.limit]
    else:
        records = load_trace(limit=args.limit)
    texts = [prompt_text(r.hash_ids, r.input_length) for r in records]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kvplug-bench-vllm-router"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    rows = run_rounds(
        routers,
        args.rounds,
        lambda name: asyncio.run(run_router(name, args, records, texts, log_dir)),
        f"{len(records)} requests on {args.engines} engines",
    )
    summary_rows = report_rounds(rows, routers, args.rounds, "vllm-router", table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                },
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                "baseline": "vllm-router" if "vllm-router" in routers else None,
                "results": rows,
                "ranges": summary_rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

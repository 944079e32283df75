"""Soak: a compressed day of traffic through ``kvplug serve`` in front of ``kvplug sim`` engines
(real processes), sampling the router's RSS, its index size and its decision time over time.
Drift - memory that keeps growing, an index that outgrows the engines' caches, decisions that
slow down - shows as a slope between the first and the last part of the run.

The day: arrivals follow a diurnal curve (quiet night, a morning ramp, an afternoon peak),
``--duration`` wall seconds standing for 24 hours. Prompts are token ids: one of 60 long
"system prompts" (tenants) plus a short unique question; which tenants are active rotates by
the hour, so the engines keep evicting and the index keeps changing. The engines' caches are
small (``--capacity-blocks``) so eviction runs all day. ``kvplug serve`` keeps its last
``--decision-store-size`` decision traces (default 10,000, a few KB each): the soak sets 1,000
so that bounded store is full within the first hours, and any growth after it is drift.

Baseline in the same run: the first sampled hour after warm-up; the figures compare the last
quarter of the day with it.

    python benchmarks/soak.py                     # 7 minutes: 24 h at ~206x
    python benchmarks/soak.py --duration 20       # smoke run

Writes ``benchmarks/results/soak.json`` and ``docs/img/soak.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.testing import free_port, free_port_runs, serve_command, stop_process  # noqa: E402

MODEL = "sim-llama-3-8b"
BS = 16
TENANTS = 60
DAY_S = 24 * 3600


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def diurnal(hour: float) -> float:
    """Relative load, 0.15 at 04:00 to 1.0 at 15:00."""
    return 0.15 + 0.85 * (0.5 - 0.5 * math.cos(2 * math.pi * (hour - 4.0) / 24.0)) ** 1.5


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(math.ceil(0.99 * len(v))) - 1)]


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.tenants = [
            [self.rng.randrange(1000, 30000) for _ in range(args.prefix_blocks * BS)]
            for _ in range(TENANTS)
        ]
        self.sim: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None
        self.url = ""
        self.session: aiohttp.ClientSession | None = None
        self.route_us: list[float] = []  # decision times sampled since the last sample
        self.latency: list[float] = []
        self.sent = 0
        self.errors = 0
        self.statuses: dict[int, int] = {}
        self.inflight = 0
        self._n = 0

    async def start(self) -> None:
        a = self.args
        base, ev, rp = free_port_runs(a.engines, 3)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.sim = subprocess.Popen(
            [
                sys.executable, "-m", "kvplug.cli", "sim", "--engines", str(a.engines),
                "--base-port", str(base), "--events-base-port", str(ev),
                "--replay-base-port", str(rp), "--speed", str(a.speed),
                "--capacity-blocks", str(a.capacity_blocks),
            ],
            stdout=open(self.workdir / "sim.log", "wb"),  # noqa: SIM115 - the child's
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        port = free_port()
        workers = [f"e{i}=http://127.0.0.1:{base + i}" for i in range(a.engines)]
        self.serve = subprocess.Popen(
            serve_command(
                port,
                "--kv-block-size", str(BS), "--log-level", "warning",
                "--decision-store-size", str(a.decision_store_size),
                *[x for w in workers for x in ("--worker", w)],
            ),
            stdout=open(self.workdir / "serve.log", "wb"),  # noqa: SIM115 - the child's
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=120),
            connector=aiohttp.TCPConnector(limit=0),
        )
        end = time.monotonic() + 60
        while time.monotonic() < end:
            for p, name in ((self.sim, "sim"), (self.serve, "serve")):
                if p.poll() is not None:
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-800:]
                    raise RuntimeError(f"kvplug {name} exited ({p.returncode}): {tail}")
            try:
                async with self.session.get(self.url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("kvplug serve not ready within 60 s")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        stop_process(self.serve, timeout=10, sig=signal.SIGTERM)
        stop_process(self.sim, timeout=10, sig=signal.SIGTERM)

    async def metrics(self) -> dict[str, float]:
        assert self.session is not None
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        out = {}
        for m in re.finditer(r'^kvplug_router_stat\{stat="([^"]+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out

    def prompt(self, hour: float) -> list[int]:
        # tenants active this hour: a window of 12 that moves 2 tenants an hour
        first = int(hour * 2)
        tenant = self.tenants[(first + int(self.rng.paretovariate(1.2)) - 1) % TENANTS]
        self._n += 1
        question = [30000 + (self._n * 7 + i) % 20000 for i in range(self.rng.randrange(8, 64))]
        return tenant + question

    async def request(self, hour: float, trace: bool) -> None:
        assert self.session is not None
        body = {"model": MODEL, "prompt": self.prompt(hour), "max_tokens": self.args.max_tokens}
        t0 = time.perf_counter()
        self.inflight += 1
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as r:
                await r.read()
                status = r.status
                decision = r.headers.get("x-kvplug-decision-id")
            self.latency.append(time.perf_counter() - t0)
            if trace and decision:
                async with self.session.get(f"{self.url}/kvplug/decisions/{decision}") as r:
                    if r.status == 200:
                        self.route_us.append((await r.json())["timings"]["route_us"])
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = 0
        finally:
            self.inflight -= 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status != 200:
            self.errors += 1

    async def run(self) -> dict[str, Any]:
        a = self.args
        scale = DAY_S / a.duration
        samples: list[dict[str, Any]] = []
        tasks: set[asyncio.Task] = set()
        t0 = time.monotonic()
        next_sample = t0
        next_progress = t0
        while True:
            now = time.monotonic()
            elapsed = now - t0
            if elapsed >= a.duration:
                break
            hour = elapsed * scale / 3600
            if now >= next_sample:
                samples.append(await self.sample(hour, elapsed))
                next_sample += a.sample_every
            if now >= next_progress:
                s = samples[-1]
                log(
                    f"{hour:5.1f} h  sent {self.sent:6d}  errors {self.errors}  "
                    f"rss {s['rss_mb']:.1f} MB  index {s['index_blocks']:.0f} blocks  "
                    f"decision p99 {s['decision_p99_us'] or 0:.0f} us"
                )
                next_progress += max(10.0, a.duration / 20)
            rate = a.peak_rate * diurnal(hour)
            if self.inflight < a.max_inflight:
                self.sent += 1
                task = asyncio.create_task(self.request(hour, self.sent % a.trace_every == 0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(self.rng.expovariate(rate))
        if tasks:
            await asyncio.gather(*tasks)
        samples.append(await self.sample(24.0, time.monotonic() - t0))
        return self.report(samples, scale)

    async def sample(self, hour: float, elapsed: float) -> dict[str, Any]:
        assert self.serve is not None
        m = await self.metrics()
        s = {
            "t_s": round(elapsed, 2),
            "hour": round(hour, 3),
            "rss_mb": rss_bytes(self.serve.pid) / 2**20,
            "index_blocks": m.get("index.blocks", 0.0),
            "index_memory_mb": m.get("index.memory_bytes", 0.0) / 2**20,
            "decision_p99_us": p99(self.route_us),
            "decisions_sampled": len(self.route_us),
            "latency_p99_s": p99(self.latency),
            "requests": self.sent,
            "errors": self.errors,
        }
        self.route_us = []
        self.latency = []
        return s

    def report(self, samples: list[dict[str, Any]], scale: float) -> dict[str, Any]:
        a = self.args
        settings = {
            "duration_s": a.duration,
            "compression": round(scale, 1),
            "engines": a.engines,
            "capacity_blocks": a.capacity_blocks,
            "peak_rate": a.peak_rate,
            "prefix_blocks": a.prefix_blocks,
            "max_tokens": a.max_tokens,
            "decision_store_size": a.decision_store_size,
            "speed": a.speed,
            "seed": a.seed,
        }
        statuses = {str(k): v for k, v in sorted(self.statuses.items())}
        return {
            "settings": settings,
            "figures": summarize(samples, settings, statuses),
            "samples": samples,
        }


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return None if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def summarize(
    samples: list[dict[str, Any]], settings: dict[str, Any], statuses: dict[str, int]
) -> dict[str, Any]:
    """Drift figures. Steady state: past the first hour and once the bounded decision store
    is full; its first quarter is the baseline the last quarter is compared with."""
    steady = [
        s
        for s in samples
        if s["hour"] >= 1.0 and s["requests"] >= settings.get("decision_store_size", 10_000)
    ]
    if len(steady) < 8:  # a short run: whatever follows the first hour
        steady = [s for s in samples if s["hour"] >= 1.0] or samples
    n = max(1, len(steady) // 4)
    first, last = steady[:n], steady[-n:]

    def med(rows, key):
        vals = [r[key] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None

    rss0, rss1 = med(first, "rss_mb"), med(last, "rss_mb")
    p0, p1 = med(first, "decision_p99_us"), med(last, "decision_p99_us")
    slope = _slope([s["requests"] / 1000 for s in steady], [s["rss_mb"] for s in steady])
    blocks_max = max(s["index_blocks"] for s in samples)
    capacity = settings["engines"] * settings["capacity_blocks"]
    requests = samples[-1]["requests"]
    errors = samples[-1]["errors"]
    f: dict[str, Any] = {
        "requests": requests,
        "errors": errors,
        "statuses": statuses,
        "steady_state_from_hour": steady[0]["hour"],
        "rss_first_quarter_mb": rss0,
        "rss_last_quarter_mb": rss1,
        "rss_growth_mb": None if rss0 is None or rss1 is None else rss1 - rss0,
        "rss_slope_mb_per_1k_requests": slope,
        "index_blocks_max": blocks_max,
        "engine_capacity_blocks": capacity,
        "decision_p99_first_quarter_us": p0,
        "decision_p99_last_quarter_us": p1,
        "decision_p99_ratio": None if not p0 or not p1 else p1 / p0,
    }
    growth, ratio = f["rss_growth_mb"], f["decision_p99_ratio"]
    f["drift"] = {
        "rss": growth is not None and growth > max(4.0, 0.05 * (rss0 or 0)),
        "index_over_capacity": blocks_max > capacity,
        "decision_p99": ratio is not None and ratio > 1.5,
    }
    f["no_drift"] = not any(f["drift"].values()) and errors == 0
    return f


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["samples"]
    hours = [x["hour"] for x in s]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    series = [
        ("rss_mb", "router RSS (MB)"),
        ("index_blocks", "index blocks"),
        ("decision_p99_us", "decision p99 (us)"),
    ]
    for ax, (key, label) in zip(axes, series, strict=False):
        pts = [(h, x[key]) for h, x in zip(hours, s, strict=True) if x[key] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "index_blocks":
            cap = report["figures"]["engine_capacity_blocks"]
            ax.axhline(cap, color="grey", ls="--", lw=0.8, label="engines' KV capacity")
            ax.legend(loc="lower right", fontsize=8)
        top = max((p[1] for p in pts), default=1.0)
        ax.set_ylim(0, top * 1.15)
        if key == "rss_mb":
            steady = report["figures"].get("steady_state_from_hour")
            if steady:
                ax.axvline(steady, color="grey", ls=":", lw=0.8)
                ax.text(steady, top * 0.5, " decision store full", fontsize=8, color="grey")
    reqs = [x["requests"] for x in s]
    ts = [x["t_s"] for x in s]
    rates = [0.0] + [
        (reqs[i] - reqs[i - 1]) / max(1e-9, ts[i] - ts[i - 1]) for i in range(1, len(s))
    ]
    axes[3].plot(hours, rates, lw=1.0, color="tab:green")
    axes[3].set_ylabel("requests / s (wall)")
    axes[3].set_xlabel("hour of the simulated day")
    axes[3].grid(alpha=0.3)
    cfg = report["settings"]
    fig.suptitle(
        f"kvplug serve soak: 24 h in {cfg['duration_s']:.0f} s ({cfg['compression']:.0f}x), "
        f"{report['figures']['requests']} requests, {cfg['engines']} kvplug sim engines"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict[str, Any]) -> str:
    f = report["figures"]

    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    rows = [
        ("requests (errors)", f"{f['requests']} ({f['errors']})"),
        ("steady state from (simulated hour)", fmt(f["steady_state_from_hour"])),
        ("RSS first / last quarter of it (MB)", f"{fmt(f['rss_first_quarter_mb'])} / "
         f"{fmt(f['rss_last_quarter_mb'])}"),
        ("RSS slope (MB per 1,000 requests)", fmt(f["rss_slope_mb_per_1k_requests"])),
        ("index blocks max / engines' capacity", f"{fmt(f['index_blocks_max'])} / "
         f"{f['engine_capacity_blocks']}"),
        ("decision p99 first / last quarter (us)", f"{fmt(f['decision_p99_first_quarter_us'])}"
         f" / {fmt(f['decision_p99_last_quarter_us'])}"),
        ("drift", ", ".join(k for k, v in f["drift"].items() if v) or "none"),
    ]  # fmt: skip
    return "\n".join(["| figure | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvplug-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        log(
            f"soak: 24 h in {args.duration:g} s ({DAY_S / args.duration:.0f}x), "
            f"{args.engines} engines, peak {args.peak_rate:g} req/s"
        )
        try:
            for attempt in range(3):  # a port picked as free may be taken meanwhile
                try:
                    await soak.start()
                    break
                except RuntimeError as exc:
                    if attempt == 2 or "exited" not in str(exc):
                        raise
                    log(f"start failed ({exc}); again on other ports")
                    await soak.close()
            return await soak.run()
        except BaseException:
            for f in sorted(Path(tmp).glob("*.log")):
                print(f"--- {f.name} (tail)\n{f.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            await soak.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=420.0, help="wall seconds for 24 h")
    ap.add_argument("--sample-every", type=float, default=3.0, help="wall seconds")
    ap.add_argument("--peak-rate", type=float, default=25.0, help="requests/s at the peak")
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--capacity-blocks", type=int, default=3000, help="KV blocks per engine")
    ap.add_argument("--prefix-blocks", type=int, default=48, help="blocks per tenant prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--decision-store-size",
        type=int,
        default=1000,
        help="kvplug serve --decision-store-size: small, so the bounded store fills early",
    )
    ap.add_argument("--speed", type=float, default=20.0, help="kvplug sim --speed")
    ap.add_argument("--trace-every", type=int, default=4, help="fetch 1 decision trace in N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/soak.png"))
    ap.add_argument(
        "--summarize", metavar="JSON", help="recompute the figures and plot of a saved run"
    )
    args = ap.parse_args(argv)
    if args.summarize:
        report = json.loads(Path(args.summarize).read_text())
        f = report["figures"]
        report["figures"] = summarize(report["samples"], report["settings"], f["statuses"])
    else:
        report = asyncio.run(main_async(args))
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.out}")
    if args.plot:
        plot(report, Path(args.plot))
        log(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

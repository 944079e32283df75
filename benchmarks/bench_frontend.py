"""What ``kvplug serve`` adds to a request, against stub engines on loopback that answer at once.

Three processes: stub engines (kvplug.frontend.stub_engine, no delay), the proxy under test, and
this load generator. For each target - the engine directly (the baseline), ``kvplug serve``, and
SGLang's Rust router (``sglang-router`` from a separate venv, optional) - and for non-streamed
and streamed (8 SSE events) completions:

* added latency: sequential requests (concurrency 1), median and p99 of time-to-last-byte, minus
  the direct engine's median;
* throughput: requests/s with ``--concurrency`` requests in flight.

Prompts are ~512-token texts sharing 8 long prefixes; kvplug tokenizes them with a local
tokenizer (``--tokenizer``, a word-level tokenizer.json made here) and also gets a run with token
id prompts (no tokenization). The SGLang router runs ``cache_aware`` (its default).

    python benchmarks/bench_frontend.py            # ~1-2 minutes on 2 cores
    python benchmarks/bench_frontend.py --quick    # smoke run

Writes ``benchmarks/results/bench_frontend.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.testing import free_port, serve_command, stop_process, wait_ready_async  # noqa: E402

MODEL = "stub-model"
SGL_VENV = Path(os.environ.get("KVPLUG_SGL_VENV", "/work/sgl-venv"))
WORDS = [f"w{i}" for i in range(2000)]


# ------------------------------------------------------------------------------------------
# stub engines (run in their own process)


async def _run_stubs(ports: list[int], output_tokens: int) -> None:
    import logging

    from kvplug.frontend.stub_engine import StubEngine

    # sglang-router probes workers with HTTP/2 prior knowledge first; aiohttp logs each refusal
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    engines = []
    for i, port in enumerate(ports):
        e = StubEngine(f"s{i}", output_tokens=output_tokens, model=MODEL)
        e.record_requests = e.record_sent = e.track_cache = False
        await e.start(port=port)
        engines.append(e)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        pass


def _stubs_main(ports: list[int], output_tokens: int) -> None:
    try:
        asyncio.run(_run_stubs(ports, output_tokens))
    except KeyboardInterrupt:
        pass


# ------------------------------------------------------------------------------------------
# load generation


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(384)) for _ in range(8)]
    return [
        prefixes[i % 8] + " " + " ".join(rng.choice(WORDS) for _ in range(128)) for i in range(n)
    ]


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")


def token_ids(text: str) -> list[int]:
    return [int(w[1:]) + 1 for w in text.split()]


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t0


def bodies(prompts: list, stream: bool, max_tokens: int) -> list[bytes]:
    return [
        json.dumps(
            {"model": MODEL, "prompt": p, "stream": stream, "max_tokens": max_tokens}
        ).encode()
        for p in prompts
    ]


async def latency(base: str, reqs: list[bytes], warmup: int) -> dict:
    url = base + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn) as s:
        for b in reqs[:warmup]:
            await one(s, url, b)
        times = [await one(s, url, b) for b in reqs[warmup:]]
    return {"samples": times}


async def throughput(base: str, reqs: list[bytes], concurrency: int) -> dict:
    url = base + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=concurrency)
    queue = list(reversed(reqs))
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(one(s, url, b) for b in reqs[:concurrency]))  # warm pool

        async def worker():
            while queue:
                await one(s, url, queue.pop())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"requests_per_s": len(reqs) / elapsed, "n": len(reqs), "concurrency": concurrency}


# ------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """user+system CPU time of a process (all threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_round(target: dict, args, rnd: int) -> None:
    """One round of one target: a latency batch and a throughput run per mode."""
    n_lat = args.latency_requests // args.rounds
    n_thr = args.throughput_requests // args.rounds
    prompts = target["prompts"]
    for stream in (False, True):
        kind = "stream" if stream else "plain"
        start = rnd * (n_lat + n_thr)
        lat_reqs = bodies(prompts[start : start + n_lat + 20], stream, args.max_tokens)
        cpu0 = cpu_seconds(target["pid"])
        lat = await latency(target["url"], lat_reqs, 20)
        cpu1 = cpu_seconds(target["pid"])
        thr_reqs = bodies(prompts[start + n_lat : start + n_lat + n_thr], stream, args.max_tokens)
        thr = await throughput(target["url"], thr_reqs, args.concurrency)
        acc = target["acc"].setdefault(kind, {"lat": [], "rate": [], "cpu": []})
        acc["lat"] += lat.pop("samples")
        acc["rate"].append(thr["requests_per_s"])
        acc["cpu"].append((cpu1 - cpu0, len(lat_reqs)))


def summarise(target: dict) -> dict:
    out: dict = {"target": target["name"], "process": target["process"]}
    for kind, acc in target["acc"].items():
        lat = sorted(acc["lat"])
        out[f"{kind}_latency"] = {
            "median_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
            "n": len(lat),
            # summed over rounds: /proc counts CPU in 10 ms ticks
            "cpu_ms_per_request": sum(c for c, _ in acc["cpu"])
            / sum(n for _, n in acc["cpu"])
            * 1e3,
        }
        out[f"{kind}_throughput"] = {
            "requests_per_s": statistics.median(acc["rate"]),
            "rounds": acc["rate"],
            "concurrency": None,
        }
    return out


async def main_async(args) -> dict:
    ports = [free_port() for _ in range(args.engines)]
    stubs = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--_stubs",
            ",".join(map(str, ports)),
            "--max-tokens",
            str(args.max_tokens),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    procs: list[subprocess.Popen] = [stubs]
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-bench-"))
    results: dict = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "load_average_before": os.getloadavg(),
    }
    try:
        assert stubs.stdout is not None and stubs.stdout.readline().strip() == "ready"
        engines = [f"http://127.0.0.1:{p}" for p in ports]
        per_round = (args.latency_requests + args.throughput_requests) // args.rounds + 20
        text_prompts = make_prompts(per_round * args.rounds + 50)
        id_prompts = [token_ids(p) for p in text_prompts]
        warm = bodies(text_prompts[:1], False, 1)[0]
        targets = [
            {
                "name": "engine (direct)",
                "url": engines[0],
                "pid": stubs.pid,
                "process": "stub engines",
                "prompts": text_prompts,
            }
        ]

        write_tokenizer(tmp)
        kv_port = free_port()
        cmd = serve_command(
            kv_port,
            "--worker-engine",
            "openai",
            "--tokenizer",
            str(tmp),
            "--served-model-name",
            MODEL,
            "--kv-block-size",
            "16",
            "--log-level",
            "warning",
            *sum((["--worker", f"e{i}={u}"] for i, u in enumerate(engines)), []),
        )
        kv = subprocess.Popen(cmd, cwd=ROOT)
        procs.append(kv)
        kv_url = f"http://127.0.0.1:{kv_port}"
        await wait_ready_async(kv_url + "/v1/completions", proc=kv, json_body=warm)
        targets.append(
            {
                "name": "kvplug (text+tokenizer)",
                "url": kv_url,
                "pid": kv.pid,
                "process": "kvplug serve",
                "prompts": text_prompts,
            }
        )
        targets.append(
            {
                "name": "kvplug (token ids)",
                "url": kv_url,
                "pid": kv.pid,
                "process": "kvplug serve",
                "prompts": id_prompts,
            }
        )

        sgl_python = SGL_VENV / "bin" / "python"
        if args.no_sglang:
            results["sglang_router"] = "skipped: --no-sglang"
        elif not sgl_python.exists():
            results["sglang_router"] = f"skipped: no venv at {SGL_VENV} (pip install sglang-router)"
        else:
            sg_port, prom_port = free_port(), free_port()
            sg = subprocess.Popen(
                [
                    str(sgl_python),
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(sg_port),
                    "--worker-urls",
                    *engines,
                    "--policy",
                    "cache_aware",
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(prom_port),
                    "--log-level",
                    "warn",
                ],
                cwd=tmp,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(sg)
            sg_url = f"http://127.0.0.1:{sg_port}"
            try:
                await wait_ready_async(sg_url + "/v1/completions", proc=sg, json_body=warm)
                shown = subprocess.run(
                    [str(SGL_VENV / "bin" / "pip"), "show", "sglang-router"],
                    capture_output=True,
                    text=True,
                ).stdout
                ver = next(
                    (ln.split()[-1] for ln in shown.splitlines() if ln.startswith("Version")), "?"
                )
                targets.append(
                    {
                        "name": f"sglang-router {ver}",
                        "url": sg_url,
                        "pid": sg.pid,
                        "process": "sglang-router",
                        "prompts": text_prompts,
                    }
                )
                results["sglang_router"] = f"sglang-router {ver}, --policy cache_aware"
            except RuntimeError as exc:
                results["sglang_router"] = f"skipped: {exc}"
        if results.get("sglang_router", "").startswith("skipped"):
            print(f"SGLang router {results['sglang_router']}", flush=True)

        for t in targets:
            t["acc"] = {}
        # rounds interleave the targets, so a noisy moment on a shared machine hits them all
        for rnd in range(args.rounds):
            for t in targets:
                await measure_round(t, args, rnd)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        results["targets"] = [summarise(t) for t in targets]
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()

    base = results["targets"][0]
    for t in results["targets"]:
        for kind in ("plain", "stream"):
            lat, b = t[f"{kind}_latency"], base[f"{kind}_latency"]
            lat["added_median_ms"] = lat["median_ms"] - b["median_ms"]
            lat["added_p99_ms"] = lat["p99_ms"] - b["p99_ms"]
            thr = t[f"{kind}_throughput"]
            thr["concurrency"] = args.concurrency
            thr["vs_direct"] = thr["requests_per_s"] / base[f"{kind}_throughput"]["requests_per_s"]
    return results


def table(results: dict) -> str:
    lines = [
        "| target | mode | median ms | added median ms | p99 ms | added p99 ms | "
        "proxy CPU ms/req | req/s | req/s vs direct |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results["targets"]:
        for kind in ("plain", "stream"):
            lat, thr = t[f"{kind}_latency"], t[f"{kind}_throughput"]
            lines.append(
                f"| {t['target']} | {'streamed' if kind == 'stream' else 'non-streamed'} | "
                f"{lat['median_ms']:.3f} | {lat['added_median_ms']:+.3f} | {lat['p99_ms']:.3f} | "
                f"{lat['added_p99_ms']:+.3f} | {lat['cpu_ms_per_request']:.3f} | "
                f"{thr['requests_per_s']:.0f} | "
                f"{thr['vs_direct']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens (SSE events) per answer")
    ap.add_argument("--latency-requests", type=int, default=1000)
    ap.add_argument("--throughput-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the targets")
    ap.add_argument("--no-sglang", action="store_true", help="skip sglang-router")
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_frontend.json"))
    ap.add_argument("--_stubs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._stubs:
        _stubs_main([int(p) for p in args._stubs.split(",")], args.max_tokens)
        return
    if args.quick:
        args.latency_requests, args.throughput_requests = 100, 200
    t0 = time.perf_counter()
    results = asyncio.run(main_async(args))
    results["wall_s"] = time.perf_counter() - t0
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print()
    print(table(results))
    print(f"\nwrote {args.out} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

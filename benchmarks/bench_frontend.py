"""What a router adds to a request, driven by wrk against engines that answer at once.

Processes: two instant engines (``benchmarks/instant_engine.py``: raw uvloop, ~20 us of CPU a
request), the routers under test, and ``wrk`` (C, one thread; a Lua script posts pre-built
bodies in turn). Targets, rotated within every round so a noisy moment on a shared machine hits
them all:

* the engine directly (the baseline every "added" figure subtracts, round by round);
* ``kvplug serve --router-mode kv`` (Dynamo's cost; otherwise its defaults: the compiled data
  path where it is built) with ~512-token text prompts and a local tokenizer, and with the same
  prompts as token ids;
* ``kvplug serve`` with its default routing (``affinity-fitted``: kv's cost, then the affinity
  decision, more CPU per request than kv: ab_frontend.py measures it; the committed JSON's runs
  are of ``affinity-balance``, the default before issue 14's twenty-fourth pass), token ids;
* optionally ``kvplug serve --processes N`` (``--processes N``, repeatable): N server processes
  on the one port, side by side with the single process (kv's cost, and the default routing
  with token ids);
* optionally (``--python-path``) ``kvplug serve --data-path python``: every request on the
  Python path (aiohttp and kvplug's Python HTTP lane), with each ``--processes N`` too;
* optionally ``kvplug serve`` from another source tree (``--baseline-src DIR``: a before/after
  pair in one run; with ``--processes N`` too);
* optionally (``--floor``) ``benchmarks/floor_proxy.py``: the HTTP stacks (kvplug's lane,
  aiohttp behind it) and the engine pool ``kvplug serve`` uses, with no routing at all - the
  floor under kvplug's CPU per request; ``--ceiling`` adds the same proxy with the real routing
  decision in it (``floor_proxy.py --route``: token ids, one ``Router.route`` and its release)
  - how cheap a request can be with the decision and nothing else;
* ``sglang-router`` (``--policy cache_aware``; installed by the ``test`` extra) and
  ``vllm-router`` (``--policy cache_aware``; ``pip install vllm-router``, found on ``PATH``, in
  ``$KVPLUG_VLLM_ROUTER`` or in ``.vrvenv/``), text prompts, when installed.

For non-streamed and streamed (8 SSE events) completions: latency at concurrency 1 (wrk's p50 and
p99 of time to the last byte), and requests/s at ``--concurrency`` (16) in flight. Router CPU per
request = user+system CPU of the router process and its child processes (all threads,
``/proc/<pid>/stat``: ``kvplug serve --processes N``'s supervisor and its N children) over a run,
divided by the run's requests. wrk's own CPU share is recorded per run: below one core it is not
the bottleneck.

    python benchmarks/bench_frontend.py            # ~4 minutes on 2 cores
    python benchmarks/bench_frontend.py --quick    # smoke run (~40 s)

Writes ``benchmarks/results/bench_frontend.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.config import RouterConfig  # noqa: E402
from kvplug.testing import free_port, serve_command, stop_process  # noqa: E402

MODEL = "stub-model"
WORDS = [f"w{i}" for i in range(2000)]
MODES = ("plain", "stream")

# wrk: post the bodies of a file (one JSON document a line) in turn; report as one JSON line
WRK_LUA = r"""
local bodies = {}
local n = 0
local i = 0
function init(args)
  for line in io.lines(args[1]) do
    n = n + 1
    bodies[n] = wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, line)
  end
end
function request()
  i = i % n + 1
  return bodies[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "mean_us": %f, '
    .. '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


# ------------------------------------------------------------------------------------------
# prompts


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """~512-word prompts sharing 8 long prefixes (384 words each)."""
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


def write_bodies(path: Path, prompts: list, stream: bool, max_tokens: int) -> Path:
    lines = [
        json.dumps({"model": MODEL, "prompt": p, "stream": stream, "max_tokens": max_tokens})
        for p in prompts
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------------
# measuring


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """user+system CPU time of a process (all threads) and of its live children, from /proc
    (a multi-process router's children do the work; a reaped child's time would be in the
    parent's cutime, but none exits during a run)."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat(int(entry.name))
        except OSError:  # exited meanwhile
            continue
        if int(entry.name) == pid or int(fields[1]) == pid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, script: Path, bodies: Path, conns: int, seconds: int, pid: int) -> dict:
    """One wrk run; adds the router's CPU per request and wrk's own CPU share."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = cpu_seconds(pid)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{seconds}", "--timeout", "10", "-s", str(script), url]
        + ["--", str(bodies)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu1 = cpu_seconds(pid)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next(ln for ln in out.splitlines() if ln.startswith("WRKJSON "))
    r = json.loads(line[len("WRKJSON ") :])
    errors = sum(r[k] for k in ("connect", "read", "write", "status", "timeout"))
    if errors:
        raise RuntimeError(f"{url}: wrk counted {errors} errors: {r}")
    wall = r["duration_us"] / 1e6
    wrk_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "requests": r["requests"],
        "requests_per_s": r["requests"] / wall,
        "p50_ms": r["p50_us"] / 1e3,
        "p99_ms": r["p99_us"] / 1e3,
        "router_cpu_ms_per_request": (cpu1 - cpu0) / r["requests"] * 1e3,
        "router_cpu_share": (cpu1 - cpu0) / wall,
        "wrk_cpu_share": wrk_cpu / wall,
    }


# ------------------------------------------------------------------------------------------
# targets


def start(cmd: list[str], probe_url: str, probe_body: Path, tmp: Path, env=None):
    """Start a router; ready once a completion goes through it."""
    log = tmp / f"log-{len(list(tmp.glob('log-*')))}.txt"
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    body = probe_body.read_text().splitlines()[0].encode()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-1500:]}")
        try:
            req = urllib.request.Request(
                probe_url, data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"{cmd} not ready: {log.read_text()[-1500:]}")
        time.sleep(0.3)


def vllm_router_command() -> list[str] | None:
    for cand in (
        os.environ.get("KVPLUG_VLLM_ROUTER"),
        # next to this interpreter (the venv's .venv/bin/python without the venv on PATH)
        str(Path(sysconfig.get_path("scripts")) / "vllm-router"),
        shutil.which("vllm-router"),
        str(ROOT / ".vrvenv" / "bin" / "vllm-router"),
    ):
        if cand and Path(cand).exists():
            return [cand]
    return None


def version_of(python_or_script: str, dist: str) -> str:
    py = Path(python_or_script)
    python = py if py.name.startswith("python") else py.parent / "python"
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "?"


def kvplug_cmd(port: int, engines: list[str], tokenizer: Path, *extra: str) -> list[str]:
    # Dynamo's cost unless the target says otherwise (the default routing is a target of its own)
    mode = () if "--router-mode" in extra else ("--router-mode", "kv")
    return serve_command(
        port,
        *mode,
        *extra,
        "--worker-engine",
        "openai",
        "--tokenizer",
        str(tokenizer),
        "--served-model-name",
        MODEL,
        "--kv-block-size",
        "16",
        "--log-level",
        "warning",
        *sum((["--worker", f"e{i}={u}"] for i, u in enumerate(engines)), []),
    )


# ------------------------------------------------------------------------------------------


def main_run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-bench-"))
    procs: list[subprocess.Popen] = []
    results: dict = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "load_generator": subprocess.run(["wrk", "-v"], capture_output=True, text=True)
        .stdout.splitlines()[0]
        .strip(),
        "load_average_before": os.getloadavg(),
        "skipped": {},
    }
    try:
        script = tmp / "post.lua"
        script.write_text(WRK_LUA)
        engines = start_instant_engines(args.engines, procs, args.max_tokens)
        engines_pid = procs[-1].pid

        text = make_prompts(args.prompts)
        files = {}
        for kind, prompts in (("text", text), ("ids", [token_ids(p) for p in text])):
            for mode in MODES:
                files[kind, mode] = write_bodies(
                    tmp / f"{kind}-{mode}.jsonl", prompts, mode == "stream", args.max_tokens
                )
        write_tokenizer(tmp)

        targets: list[dict] = [
            {"name": "engine (direct)", "url": engines[0], "pid": engines_pid, "kind": "text"}
        ]

        def add_kvplug(label: str, env: dict | None, *extra: str, ids_only: bool = False) -> None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            p = start(
                kvplug_cmd(port, engines, tmp, *extra),
                url + "/v1/completions",
                files["text", "plain"],
                tmp,
                env,
            )
            procs.append(p)
            kinds = (("ids", "token ids"),)
            if not (args.ids_only or ids_only):
                kinds = (("text", "text+tokenizer"), *kinds)
            for kind, name in kinds:
                targets.append(
                    {"name": f"{label} ({name})", "url": url, "pid": p.pid, "kind": kind}
                )

        add_kvplug("kvplug", None)
        # the default routing (no --router-mode): what a user who changes nothing pays
        default = RouterConfig()
        default_routing = (
            "--router-mode",
            default.router_mode,
            "--router-affinity",
            default.router_affinity,
        )
        add_kvplug("kvplug default routing", None, *default_routing, ids_only=True)
        for n in args.processes:
            add_kvplug(f"kvplug --processes {n}", None, "--processes", str(n))
            # the default routing scales the same way (each process a whole router, load
            # shared): its affinity decision costs more CPU than kv's, so it needs the cores more
            label = f"kvplug default routing --processes {n}"
            add_kvplug(label, None, *default_routing, "--processes", str(n), ids_only=True)
        if args.python_path:  # every request on the Python path
            python = ("--data-path", "python")
            add_kvplug("kvplug python path", None, *python)
            for n in args.processes:
                add_kvplug(
                    f"kvplug python path --processes {n}", None, *python, "--processes", str(n)
                )
        if args.baseline_src:
            env = {**os.environ, "PYTHONPATH": str(Path(args.baseline_src).resolve())}
            add_kvplug(f"kvplug {args.baseline_label}", env)
            for n in args.processes:  # the same pair with N processes
                label = f"kvplug {args.baseline_label} --processes {n}"
                add_kvplug(label, env, "--processes", str(n))
            if args.python_path:  # the Python path before/after too
                add_kvplug(
                    f"kvplug python path {args.baseline_label}", env, "--data-path", "python"
                )

        proxies = []
        if args.floor:
            # the same HTTP stacks with no routing: what kvplug's own request handling adds
            proxies.append(("floor: kvplug's HTTP stacks + engine pool", []))
        if args.ceiling:
            # the same with the routing decision and nothing else: a lean path's ceiling
            proxies.append(("ceiling: floor + Router.route", ["--route"]))
        for name, flags in proxies:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "floor_proxy.py"), str(port)]
            p = start(cmd + engines + flags, url + "/v1/completions", files["ids", "plain"], tmp)
            procs.append(p)
            targets.append({"name": name, "url": url, "pid": p.pid, "kind": "ids"})

        if args.no_rust:
            results["skipped"]["rust routers"] = "--no-rust"
        else:
            # sglang-router: the test extra installs it beside kvplug
            sg_version = version_of(sys.executable, "sglang-router")
            if sg_version == "?":
                results["skipped"]["sglang-router"] = "not installed (pip install sglang-router)"
            else:
                port, prom = free_port(), free_port()
                cmd = [sys.executable, "-m", "sglang_router.launch_router"]
                cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines]
                cmd += ["--policy", "cache_aware", "--prometheus-host", "127.0.0.1"]
                cmd += ["--prometheus-port", str(prom), "--log-level", "warn"]
                url = f"http://127.0.0.1:{port}"
                p = start(cmd, url + "/v1/completions", files["text", "plain"], tmp)
                procs.append(p)
                name = f"sglang-router {sg_version}"
                targets.append({"name": name, "url": url, "pid": p.pid, "kind": "text"})
            vr = vllm_router_command()
            if vr is None:
                results["skipped"]["vllm-router"] = "not installed (pip install vllm-router)"
            else:
                port, prom = free_port(), free_port()
                cmd = [*vr, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines]
                cmd += ["--policy", "cache_aware", "--prometheus-host", "127.0.0.1"]
                cmd += ["--prometheus-port", str(prom), "--log-level", "warning"]
                url = f"http://127.0.0.1:{port}"
                try:
                    p = start(cmd, url + "/v1/completions", files["text", "plain"], tmp)
                    procs.append(p)
                    name = f"vllm-router {version_of(vr[0], 'vllm-router')}"
                    targets.append({"name": name, "url": url, "pid": p.pid, "kind": "text"})
                except RuntimeError as exc:
                    results["skipped"]["vllm-router"] = str(exc)[-300:]
        for what, why in results["skipped"].items():
            print(f"skipped {what}: {why}", flush=True)

        # warm every target (pools, caches, JIT-free but allocator-warm)
        for t in targets:
            for mode in MODES:
                run_wrk(t["url"], script, files[t["kind"], mode], args.concurrency, 1, t["pid"])
            t["runs"] = {m: {"c1": [], "cN": []} for m in MODES}

        loads = []
        for rnd in range(args.rounds):
            order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
            for t in order:
                for mode in MODES:
                    f = files[t["kind"], mode]
                    c1 = run_wrk(t["url"], script, f, 1, args.seconds, t["pid"])
                    cn = run_wrk(t["url"], script, f, args.concurrency, args.seconds, t["pid"])
                    t["runs"][mode]["c1"].append(c1)
                    t["runs"][mode]["cN"].append(cn)
                    print(
                        f"round {rnd + 1}/{args.rounds}  {t['name']:<34} {mode:<6} "
                        f"c=1 p50 {c1['p50_ms']:.3f} ms  c={args.concurrency} "
                        f"{cn['requests_per_s']:7.0f} req/s  router CPU "
                        f"{cn['router_cpu_ms_per_request']:.3f} ms/req  "
                        f"(wrk {cn['wrk_cpu_share']:.2f} core)",
                        flush=True,
                    )
            loads.append(os.getloadavg()[0])
        results["load_average_per_round"] = loads
        results["targets"] = summarise(targets, args.concurrency)
    finally:
        for p in reversed(procs):
            stop_process(p, timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    return results


def _span(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def summarise(targets: list[dict], concurrency: int) -> list[dict]:
    base = targets[0]["runs"]
    out = []
    for t in targets:
        row: dict = {"target": t["name"], "prompts": t["kind"]}
        for mode in MODES:
            c1, cn = t["runs"][mode]["c1"], t["runs"][mode]["cN"]
            b1, bn = base[mode]["c1"], base[mode]["cN"]
            added = [r["p50_ms"] - b["p50_ms"] for r, b in zip(c1, b1, strict=True)]
            added99 = [r["p99_ms"] - b["p99_ms"] for r, b in zip(c1, b1, strict=True)]
            rates = [r["requests_per_s"] for r in cn]
            row[f"{mode}_latency"] = {
                "median_ms": statistics.median(r["p50_ms"] for r in c1),
                "p99_ms": statistics.median(r["p99_ms"] for r in c1),
                "added_median_ms": statistics.median(added),
                "added_median_ms_rounds": added,
                "added_p99_ms": statistics.median(added99),
                "requests": sum(r["requests"] for r in c1),
                "cpu_ms_per_request": sum(
                    r["router_cpu_ms_per_request"] * r["requests"] for r in c1
                )
                / sum(r["requests"] for r in c1),
            }
            row[f"{mode}_throughput"] = {
                "requests_per_s": statistics.median(rates),
                "rounds": rates,
                "concurrency": concurrency,
                "vs_direct": statistics.median(rates)
                / statistics.median(r["requests_per_s"] for r in bn),
                "requests": sum(r["requests"] for r in cn),
                # /proc counts CPU in 10 ms ticks: summed over the rounds
                "cpu_ms_per_request": sum(
                    r["router_cpu_ms_per_request"] * r["requests"] for r in cn
                )
                / sum(r["requests"] for r in cn),
                "router_cpu_share": statistics.median(r["router_cpu_share"] for r in cn),
                "wrk_cpu_share": statistics.median(r["wrk_cpu_share"] for r in cn),
            }
        out.append(row)
    return out


def _rng(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}..{hi:{fmt}}"


def table(results: dict) -> str:
    c = results["config"]["concurrency"]
    lines = [
        f"| target | mode | c=1 p50 ms | added p50 ms (rounds) | c=1 p99 ms | "
        f"c={c} req/s (rounds) | vs direct | router CPU ms/req (c={c}) | wrk cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in results["targets"]:
        for mode in MODES:
            lat, thr = t[f"{mode}_latency"], t[f"{mode}_throughput"]
            lines.append(
                f"| {t['target']} | {'streamed' if mode == 'stream' else 'non-streamed'} | "
                f"{lat['median_ms']:.3f} | {lat['added_median_ms']:+.3f} "
                f"({_rng(lat['added_median_ms_rounds'], '+.2f')}) | {lat['p99_ms']:.2f} | "
                f"{thr['requests_per_s']:.0f} ({_rng(thr['rounds'], '.0f')}) | "
                f"{thr['vs_direct']:.2f} | {thr['cpu_ms_per_request']:.3f} | "
                f"{thr['wrk_cpu_share']:.2f} |"
            )
    return "\n".join(lines)


def start_instant_engines(n: int, procs: list, tokens: int = 8) -> list[str]:
    """``n`` instant engines in one process (appended to ``procs``), once they listen: their
    URLs."""
    ports = [free_port() for _ in range(n)]
    stubs = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "instant_engine.py"), *map(str, ports)]
        + ["--tokens", str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(stubs)
    assert stubs.stdout is not None and stubs.stdout.readline().strip() == "ready"
    return [f"http://127.0.0.1:{p}" for p in ports]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens (SSE events) per answer")
    ap.add_argument("--prompts", type=int, default=2000, help="distinct bodies wrk cycles")
    ap.add_argument("--seconds", type=int, default=3, help="length of each wrk run")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds rotating over the targets")
    ap.add_argument("--no-rust", action="store_true", help="skip sglang-router and vllm-router")
    ap.add_argument(
        "--processes",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="also run kvplug serve --processes N (repeatable)",
    )
    ap.add_argument(
        "--baseline-src",
        default=None,
        help="also run kvplug serve from this source tree (PYTHONPATH), e.g. an export of "
        "the previous commit with the built core copied in",
    )
    ap.add_argument("--baseline-label", default="before")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also run benchmarks/floor_proxy.py (kvplug serve's HTTP stacks, no routing)",
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also run benchmarks/floor_proxy.py --route (the HTTP stacks + the routing decision)",
    )
    ap.add_argument(
        "--ids-only",
        action="store_true",
        help="kvplug serve targets with token-id prompts only (no text + local tokenizer)",
    )
    ap.add_argument(
        "--python-path",
        action="store_true",
        help="also run kvplug serve --data-path python (every request on the Python path; with "
        "each --processes N too)",
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_frontend.json"))
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench_frontend needs wrk (apt-get install -y wrk)")
    if args.quick:
        args.rounds, args.seconds, args.prompts = 1, 1, 200
    t0 = time.perf_counter()
    results = main_run(args)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print()
    print(table(results))
    print(
        f"\nload average {results['load_average_before'][0]:.1f} before, per round "
        f"{', '.join(f'{x:.1f}' for x in results['load_average_per_round'])}"
    )
    print(f"wrote {args.out} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

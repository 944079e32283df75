"""``kvplug demo``, ``kvplug bench`` and ``kvplug sim`` (registered by kvplug.cli)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvplug.cli import RunError, UsageError, check_port, check_ports_free
from kvplug.sim.policies import DEFAULT_POLICIES, DEMO_POLICIES, NAMES


def add_host_offload_option(parser: argparse._ActionsContainer) -> None:
    """``--host-offload evicted|stored`` (EngineConfig.host_offload), for bench and sim."""
    parser.add_argument(
        "--host-offload",
        choices=("evicted", "stored"),
        default="evicted",
        help="with a host tier: 'evicted' (default: a device block moves to the host when "
        "evicted and back on a hit) or 'stored' (as vLLM's default offloading connector: every "
        "block computed is copied to the host, whose LRU keeps copies; a hit is copied back)",
    )


def add_kv_allocation_option(parser: argparse._ActionsContainer) -> None:
    """``--kv-allocation reserve|vllm`` (EngineConfig.kv_allocation), for bench and sim alike."""
    parser.add_argument(
        "--kv-allocation",
        choices=("reserve", "vllm"),
        default="reserve",
        help="how the engines allocate KV: 'reserve' (default: prompt and requested output at "
        "admission, nothing preempted) or 'vllm' (as vLLM 0.32.0: admitted when the whole prompt "
        "fits, blocks allocated as computed, the latest admitted request preempted and "
        "recomputed when a running one cannot grow)",
    )


def register(subparsers) -> None:
    _register_demo(subparsers)
    _register_bench(subparsers)
    _register_sim(subparsers)


# ------------------------------------------------------------------------------ shared flags
def _add_fleet_args(
    p: argparse.ArgumentParser, engines: int, duration: float | None = None
) -> None:
    g = p.add_argument_group("simulated fleet and trace")
    g.add_argument(
        "--engines", type=int, default=engines, help=f"simulated engines (default {engines})"
    )
    g.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL (.gz, .xz); default: the bundled FAST'25 conversation trace",
    )
    g.add_argument(
        "--workload",
        default=None,
        metavar="NAME[:k=v,...]",
        help="a generated workload instead of the trace: shared-prefix, multi-turn, agentic or "
        "doc-qa, with its settings (docs/sim.md)",
    )
    g.add_argument("--start", type=float, default=0.0, help="slice start, seconds into the trace")
    g.add_argument(
        "--duration",
        type=float,
        default=duration,
        help="slice length in seconds (default: "
        + ("the whole trace)" if duration is None else f"{duration:g}, {duration / 60:g} minutes)"),
    )
    g.add_argument("--limit", type=int, default=None, help="at most this many requests")
    g.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    g.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="device KV blocks per engine (default: 840k tokens, the 8B model on one H200, "
        "= 1640 blocks of 512)",
    )
    g.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per trace hash id, = the engines' and the router's block size (512 for "
        "the Mooncake traces)",
    )
    g.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        help="host-tier KV blocks per engine (0 = no host tier)",
    )
    g.add_argument(
        "--prefill-engines",
        type=int,
        default=0,
        help="disaggregated fleet: this many prefill engines, the rest decode (0 = aggregated)",
    )
    g.add_argument("--max-batched-tokens", type=int, default=8192, help="chunked-prefill budget")
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        metavar="T",
        help="vLLM's flag of that name on every engine: while other requests run or wait, no "
        "prompt takes more than T tokens of a step (default 0: off, as vLLM)",
    )
    g.add_argument(
        "--long-prefill-token-threshold-adaptive",
        action="store_true",
        help="vLLM's flag of that name on every engine: that cap is at least the budget over "
        "the engine's running and waiting requests",
    )
    add_kv_allocation_option(g)
    add_host_offload_option(g)
    g.add_argument(
        "--steptime",
        default="causal",
        metavar="causal|cached|ctx=MS|mocker",
        help="prefill context cost per (new, cached) token pair: causal (default, the cold fit's "
        "causal rate, 8.7e-7 ms) or cached (the cached-prefill fit, 2.45e-6 ms): the two ends "
        "of what the H200 calibration allows; or mocker: the step timing of Dynamo's mocker "
        "engine, as measured (docs/sim.md)",
    )
    g.add_argument(
        "--slowdowns",
        default="",
        metavar="F[,F...]",
        help="a mixed fleet: engine i's step times are the model's times the i-th factor, the "
        "list repeated over the engines (e.g. 1,2: every other engine twice as slow; default: "
        "every engine alike)",
    )
    r = p.add_argument_group("the router's view of the fleet (default: ideal)")
    r.add_argument(
        "--realism",
        choices=("ideal", "realistic"),
        default="ideal",
        help="ideal: events 5 ms late, none lost, instant reports, gauges exact every 1 s; "
        "realistic: events 20 ms + 10 ms jitter late, 1%% of batches lost (gap -> replay), "
        "gauges every 2 s and 1 s old, reports 20 ms late (the flags below override)",
    )
    r.add_argument("--event-delay", type=float, default=None, help="KV event latency, seconds")
    r.add_argument("--event-jitter", type=float, default=None, help="mean extra event delay, s")
    r.add_argument(
        "--event-loss", type=float, default=None, help="probability an event batch is lost"
    )
    r.add_argument("--replay-rtt", type=float, default=None, help="gap -> replayed, seconds")
    r.add_argument("--metrics-delay", type=float, default=None, help="age of the gauges, s")
    r.add_argument("--metrics-period", type=float, default=None, help="gauge scrape period, s")
    r.add_argument(
        "--report-delay", type=float, default=None, help="first token / finish report delay, s"
    )
    g.add_argument(
        "--mode",
        choices=("hashes", "tokens"),
        default="hashes",
        help="hand the router precomputed block hashes (fast) or expanded token ids",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="policies replayed in parallel processes",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _spec(args, policies):
    from kvplug.sim.bench import BenchSpec
    from kvplug.sim.policies import parse_policy
    from kvplug.sim.steptime import capacity_blocks

    if args.capacity_blocks is None:
        args.capacity_blocks = capacity_blocks(max(args.block_tokens, 1))
    for name in ("engines", "capacity_blocks", "max_batched_tokens", "jobs", "block_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.prefill_engines < args.engines:
        raise UsageError("--prefill-engines must be in [0, --engines)")
    if args.long_prefill_token_threshold < 0:
        raise UsageError(
            f"--long-prefill-token-threshold must be >= 0, got {args.long_prefill_token_threshold}"
        )
    if args.host_blocks < 0 or args.speedup <= 0:
        raise UsageError("--host-blocks must be >= 0, --speedup > 0")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be > 0 seconds, got {args.duration:g}")
    if not args.start >= 0:
        raise UsageError(f"--start must be >= 0 seconds, got {args.start:g}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    for text in policies:
        try:
            parse_policy(text).router_config(args.block_tokens)  # every setting checked
        except ValueError as exc:  # ConfigError is one too
            msg = str(exc)
            raise UsageError(
                msg if msg.startswith("policy") else f"policy {text!r}: {msg}"
            ) from None
    replicas = getattr(args, "replicas", 1)
    replica_sync = getattr(args, "replica_sync", "on") == "on"
    sync_delay = getattr(args, "sync_delay", 0.003)
    if replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {replicas}")
    if not sync_delay >= 0:
        raise UsageError(f"--sync-delay must be >= 0 seconds, got {sync_delay:g}")
    if replicas > 1 and replica_sync:
        from kvplug.sim.policies import BASELINE_MODE

        for text in policies:
            if parse_policy(text).mode == BASELINE_MODE:
                raise UsageError(
                    f"policy {text!r}: --replica-sync on needs a kvplug policy (the baselines "
                    "keep no load tracker to fold into); use --replica-sync off"
                )
    link = _link(args)
    slowdowns = _slowdowns(getattr(args, "slowdowns", ""))
    try:
        if args.workload:
            from kvplug.sim.traces import parse_workload

            parse_workload(args.workload, args.block_tokens)
    except ValueError as exc:  # ConfigError is one too
        raise UsageError(str(exc)) from None
    if args.trace and not args.workload:
        _check_trace(args.trace)
    return BenchSpec(
        policies=list(policies),
        n_engines=args.engines,
        trace=args.trace,
        start_s=args.start,
        duration_s=args.duration,
        limit=args.limit,
        speedup=args.speedup,
        capacity_blocks=args.capacity_blocks,
        host_capacity_blocks=args.host_blocks,
        max_batched_tokens=args.max_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        kv_allocation=args.kv_allocation,
        host_offload=args.host_offload,
        link=link,
        steptime=args.steptime,
        mode=args.mode,
        seed=args.seed,
        workload=args.workload,
        n_prefill=args.prefill_engines,
        block_tokens=args.block_tokens,
        replicas=replicas,
        replica_sync=replica_sync,
        sync_delay_s=sync_delay,
        spread_arrivals=getattr(args, "spread_arrivals", False),
        pick_stats=replicas > 1,
        slowdowns=slowdowns,
    )


def _check_trace(path: str) -> None:
    """A missing file or one that is not a Mooncake JSONL trace is a usage error, found
    before any replay starts (its first record is read)."""
    from kvplug.sim.traces import iter_trace

    if not Path(path).is_file():
        raise UsageError(f"--trace {path}: no such file")
    try:
        next(iter_trace(path), None)
    except (ValueError, OSError) as exc:  # OSError: unreadable; a broken .gz/.xz is a ValueError
        raise UsageError(f"--trace {path} is not a Mooncake JSONL trace: {exc}") from None


def _run_bench(spec, args):
    """run_bench, or run_seeds over --seed .. --seed + --seeds - 1 (bench's --seeds > 1); a bad
    record further down the trace being one line (exit 1), too."""
    from kvplug.sim.bench import run_bench, run_seeds

    seeds = getattr(args, "seeds", 1)  # demo has no --seeds
    try:
        if seeds > 1:
            span = list(range(args.seed, args.seed + seeds))
            return run_seeds(spec, span, jobs=args.jobs, progress=not args.no_progress)
        return run_bench(spec, jobs=args.jobs, progress=not args.no_progress)
    except ValueError as exc:
        raise RunError(str(exc).splitlines()[0]) from None


_LINK_FLAGS = {
    "event_delay": "event_delay_s",
    "event_jitter": "event_jitter_s",
    "event_loss": "event_loss",
    "replay_rtt": "replay_rtt_s",
    "metrics_delay": "metrics_delay_s",
    "metrics_period": "attribute_period_s",
    "report_delay": "report_delay_s",
}


def _slowdowns(text: str) -> tuple[float, ...]:
    """``--slowdowns 1,2`` -> (1.0, 2.0); UsageError on anything else."""
    from kvplug.sim.steptime import parse_slowdowns

    try:
        return parse_slowdowns(text)
    except ValueError:
        raise UsageError(
            f"--slowdowns: expected factors > 0 separated by commas, got {text!r}"
        ) from None


def _link(args):
    from dataclasses import replace

    from kvplug.sim.steptime import parse_steptime
    from kvplug.sim.transport import PRESETS

    try:
        parse_steptime(args.steptime)
        overrides = {
            field: getattr(args, flag)
            for flag, field in _LINK_FLAGS.items()
            if getattr(args, flag) is not None
        }
        return replace(PRESETS[args.realism], **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _finish_report(report, args, prefix: str) -> None:
    from kvplug.sim.bench import format_table, write_json

    print()
    print(format_table(report, markdown=getattr(args, "markdown", False)))
    if args.json:
        write_json(report, args.json)
        print(f"JSON: {args.json}")
    if args.plots:
        from kvplug.sim.plots import plot_report

        for p in plot_report(report, args.plots, prefix=prefix):
            print(f"plot: {p}")
    print(f"total wall time {report['wall_s']:.1f} s ({report['jobs']} process(es))")


# ------------------------------------------------------------------------------ demo
def _register_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="replay 20 minutes of a real conversation trace on 4 simulated engines under kv, "
        "round-robin and random routing (virtual time, no GPU, < 1 minute)",
    )
    _add_fleet_args(p, engines=4, duration=1200.0)
    p.add_argument("--policies", nargs="+", default=list(DEMO_POLICIES))
    p.add_argument("--json", default="kvplug-demo/demo.json", help="report path ('' = none)")
    p.add_argument("--plots", default="kvplug-demo", help="plot directory ('' = none)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    spec = _spec(args, args.policies)
    if args.workload:
        source = f"generated workload {args.workload}"
    else:
        span = f"first {int(args.duration // 60)} min" if args.duration else "all"
        source = f"Mooncake conversation trace (Kimi, FAST'25), {span}"
    print(
        f"kvplug demo: {source}, {args.engines} simulated Llama-3-8B/H200 engines "
        f"({args.capacity_blocks} KV blocks of {args.block_tokens} tokens each), virtual time; "
        f"policies: {', '.join(args.policies)}"
    )
    report = _run_bench(spec, args)
    _finish_report(report, args, prefix="demo")
    # the first policy (by default kvplug serve's default routing) against the next best
    first, *others = report["results"]
    if others:
        best = min(others, key=lambda r: r["ttft_p50_s"])
        print(
            f"{first['policy']} vs {best['policy']}: "
            f"hit rate {first['hit_rate']:.1%} vs {best['hit_rate']:.1%}, "
            f"TTFT p50 {first['ttft_p50_s']:.3f} s vs {best['ttft_p50_s']:.3f} s, "
            f"p99 {first['ttft_p99_s']:.2f} s vs {best['ttft_p99_s']:.2f} s"
        )
    return 0


# ------------------------------------------------------------------------------ bench
def _register_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="replay a trace on N simulated engines under several routing policies (virtual time)",
        description=f"Policies are NAME[:key=value,...] with NAME one of {', '.join(NAMES)} "
        "and keys router settings or aliases (credit, temperature, prefill_scale, "
        "host_weight, track_output, ttl), e.g. kv:credit=0.5,temperature=0.1; affinity also "
        "takes guard, cap, memory, min_share; the baselines sglang-cache-aware, "
        "smg-cache-aware and vllm-kv-aware take their own settings.",
    )
    _add_fleet_args(p, engines=8)
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    p.add_argument(
        "--json", default="benchmarks/results/sim_bench.json", help="report path ('' = none)"
    )
    p.add_argument("--plots", default="", help="directory for PNG plots ('' = none)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--sweep",
        nargs=2,
        metavar=("X=V,..", "Y=V,.."),
        help="grid-sweep two kv settings, e.g. --sweep credit=0.25,0.5,1 temperature=0,0.1",
    )
    p.add_argument("--sweep-base", default="kv", help="policy the sweep varies (default kv)")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="replay every policy with this many seeds from --seed on and report each figure's "
        "mean with its range over them (the seed draws tie-breaks and the router view's "
        "jitter and losses; default 1)",
    )
    r = p.add_argument_group("router replicas (docs/scale-out.md)")
    r.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas in front of the fleet; requests go to them in turn, every replica "
        "hears every engine's KV events (default 1)",
    )
    r.add_argument(
        "--replica-sync",
        choices=("on", "off"),
        default="on",
        help="on: each replica folds the others' request lifecycle (added / first token / "
        "finished) into its load, as kvplug serve --replica-sync does over NATS; off: each "
        "knows only its own requests",
    )
    r.add_argument(
        "--sync-delay",
        type=float,
        default=0.003,
        help="seconds a replica's lifecycle event takes to reach the others (default 0.003: "
        "1 ms batching + a NATS hop)",
    )
    r.add_argument(
        "--spread-arrivals",
        action="store_true",
        help="spread requests that share a timestamp (the bundled trace's 3-second buckets) "
        "over the gap to the next one",
    )
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.sweep:
        if args.seeds > 1:
            raise UsageError("--seeds: a sweep replays one seed (give --seed instead)")
        return _cmd_sweep(args)
    report = _run_bench(_spec(args, args.policies), args)
    _finish_report(report, args, prefix="sim")
    return 0


def _cmd_sweep(args) -> int:
    from kvplug.sim.bench import write_json
    from kvplug.sim.sweep import format_sweep, parse_axis, run_sweep

    try:
        (x_name, xs), (y_name, ys) = (parse_axis(axis) for axis in args.sweep)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not xs or not ys:
        raise UsageError("--sweep: each axis needs at least one value")
    sep = "," if ":" in args.sweep_base else ":"
    corner = f"{args.sweep_base}{sep}{x_name}={xs[0]:g},{y_name}={ys[0]:g}"
    spec = _spec(args, [corner])  # one grid point checks the names and the base
    try:
        sweep = run_sweep(
            spec,
            args.sweep[0],
            args.sweep[1],
            jobs=args.jobs,
            base=args.sweep_base,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        raise RunError(str(exc).splitlines()[0]) from None
    print()
    print(format_sweep(sweep))
    path = Path(args.json or "sim_sweep.json")
    if path.name == "sim_bench.json":
        path = path.with_name("sim_sweep.json")
    report = sweep.pop("report")
    if args.json:
        write_json(report, path.with_name(path.stem + "_runs.json"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sweep, indent=1) + "\n")
        print(f"JSON: {path}")
    if args.plots:
        from kvplug.sim.plots import plot_sweep

        for p in plot_sweep({**sweep, "report": report}, args.plots, prefix=path.stem):
            print(f"plot: {p}")
    return 0


# ------------------------------------------------------------------------------ sim (servers)
def _register_sim(sub) -> None:
    p = sub.add_parser(
        "sim",
        help="run a fleet of simulated vLLM-like engines: OpenAI HTTP, /metrics, ZMQ KV events",
    )
    p.add_argument("--engines", type=int, default=2, help="simulated engines (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=8100, help="engine i serves HTTP on base+i")
    p.add_argument(
        "--events-base-port",
        type=int,
        default=None,
        help="engine i publishes KV events on this+i (default base-port+1000)",
    )
    p.add_argument(
        "--replay-base-port",
        type=int,
        default=None,
        help="engine i answers replay requests on this+i (default base-port+2000)",
    )
    p.add_argument(
        "--events-connect",
        default=None,
        help="connect every engine's PUB to this endpoint (a router-bound SUB) instead "
        "of binding one port each; engine i then publishes on topic TOPIC.sim-i (sim-i when "
        "TOPIC is empty)",
    )
    p.add_argument("--topic", default="", help="ZMQ topic of the event frames (default '', vLLM's)")
    p.add_argument("--vllm-version", default="0.32", help="event encoding of this vLLM version")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (16)")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="device KV blocks per engine (default: 840k tokens / block size)",
    )
    p.add_argument("--host-blocks", type=int, default=0, help="host-tier blocks (0 = none)")
    p.add_argument(
        "--max-batched-tokens", type=int, default=8192, help="chunked-prefill budget (8192)"
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        metavar="T",
        help="vLLM's flag of that name: while other requests run or wait, no prompt takes more "
        "than T tokens of a step (default 0: off, as vLLM)",
    )
    p.add_argument(
        "--long-prefill-token-threshold-adaptive",
        action="store_true",
        help="vLLM's flag of that name: that cap is at least the budget over the engine's "
        "running and waiting requests",
    )
    add_kv_allocation_option(p)
    add_host_offload_option(p)
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="virtual seconds per wall second (2 = twice as fast as the modelled GPU)",
    )
    p.add_argument(
        "--slowdowns",
        default="",
        metavar="F[,F...]",
        help="a mixed fleet: engine i's step times are the model's times the i-th factor, the "
        "list repeated over the engines (e.g. 1,2; default: every engine alike)",
    )
    p.add_argument("--model", default="sim-llama-3-8b", help="model name served")
    p.add_argument(
        "--block-hashes",
        choices=("sim", "vllm"),
        default="sim",
        help="engine block hashes in events: sim (the simulator's own chain, default) or vllm "
        "(vLLM's own chained hashes, --hash-algo with NONE_HASH from --hash-seed)",
    )
    p.add_argument(
        "--hash-algo",
        choices=("sha256", "sha256_cbor"),
        default="sha256",
        help="with --block-hashes vllm: vLLM's --prefix-caching-hash-algo (default sha256, "
        "vLLM's default)",
    )
    p.add_argument(
        "--hash-seed",
        default=None,
        help="with --block-hashes vllm: the engines' PYTHONHASHSEED (default: unset, vLLM's "
        "'vllm-none-hash'); SEED,SEED,... gives one per engine",
    )
    p.add_argument(
        "--hash-form",
        choices=("uint64", "bytes"),
        default="uint64",
        help="with --block-hashes vllm: events carry the low 64 bits (uint64, vLLM's default "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or the 32-byte digest (bytes, =0)",
    )
    p.set_defaults(func=_cmd_sim)


def _cmd_sim(args) -> int:
    from kvplug.sim.server import FleetOptions, run_fleet
    from kvplug.sim.vllm_hashes import DEFAULT_SEED

    if args.engines < 1 or args.block_size < 1 or args.speed <= 0:
        raise UsageError("--engines and --block-size must be >= 1, --speed > 0")
    if args.long_prefill_token_threshold < 0:
        raise UsageError(
            f"--long-prefill-token-threshold must be >= 0, got {args.long_prefill_token_threshold}"
        )
    seeds = (DEFAULT_SEED,) if args.hash_seed is None else tuple(args.hash_seed.split(","))
    if len(seeds) not in (1, args.engines):
        raise UsageError(f"--hash-seed: give one seed or {args.engines} (one per engine)")
    if args.block_hashes == "sim" and (
        args.hash_seed is not None or args.hash_algo != "sha256" or args.hash_form != "uint64"
    ):
        raise UsageError("--hash-algo, --hash-seed and --hash-form need --block-hashes vllm")
    events_base = args.events_base_port or args.base_port + 1000
    replay_base = args.replay_base_port or args.base_port + 2000
    bases = [(args.base_port, "--base-port")]
    if not args.events_connect:
        bases.append((events_base, _flag("--events-base-port", args.events_base_port, 1000)))
    bases.append((replay_base, _flag("--replay-base-port", args.replay_base_port, 2000)))
    ports = []
    for base, flag in bases:  # engine i listens on base + i
        check_port(base, flag)
        if args.engines > 1:
            check_port(base + args.engines - 1, f"{flag} + {args.engines - 1} (the last engine)")
        ports += [(base + i, flag if i == 0 else f"{flag} + {i}") for i in range(args.engines)]
    check_ports_free(args.host, ports)  # before any engine starts
    opts = FleetOptions(
        engines=args.engines,
        host=args.host,
        base_port=args.base_port,
        events_base_port=events_base,
        replay_base_port=replay_base,
        events_connect=args.events_connect,
        topic=args.topic,
        vllm_version=args.vllm_version,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        host_blocks=args.host_blocks,
        max_batched_tokens=args.max_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        kv_allocation=args.kv_allocation,
        host_offload=args.host_offload,
        speed=args.speed,
        model=args.model,
        block_hashes=args.block_hashes,
        hash_algo=args.hash_algo,
        hash_seeds=seeds,
        hash_form=args.hash_form,
        slowdowns=_slowdowns(args.slowdowns),
    )
    import zmq

    try:
        run_fleet(opts)
    except KeyboardInterrupt:
        pass
    except (OSError, zmq.ZMQError) as exc:  # taken between the check and the start
        raise RunError(f"cannot start the simulated engines: {exc}") from None
    return 0


def _flag(name: str, given: int | None, offset: int) -> str:
    return name if given else f"{name} (--base-port + {offset})"


def main(argv=None) -> int:  # python -m kvplug.sim.cli: the kvplug command's errors and codes
    from kvplug.cli import main as kvplug_main

    return kvplug_main(argv)


if __name__ == "__main__":
    sys.exit(main())

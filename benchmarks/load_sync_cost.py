"""What the shared in-flight load of ``kvplug serve --processes N`` costs per request.

Each process tells the others its requests' added / first token / finished
(:mod:`kvplug.local_sync`, :class:`kvplug.replica_sync.ReplicaLoad`), batched per millisecond,
and folds theirs into its load model. Three figures, on real ``Router`` objects (mode ``kv``,
block size 16, two workers) and bench_frontend's ~512-token token-id prompts, each request
finished ``--window`` (5) requests after it was routed, a batch every ``--batch`` (7) requests:
so 2 of 7 requests start and end within one batch and the others send an "added" and a
"finished", 1.4 events a request, as ``processes_spread.py`` counts in a ``--processes 2``
serve under wrk's 16 connections (1.2-1.6):

* ``sender``: CPU per request the listener adds to ``route`` + ``on_first_token`` +
  ``on_finish`` (the three events made and queued, the batch encoded and written to a real
  Unix socket every ``--batch`` requests): the same loop with the listener on minus off,
  alternating in chunks;
* ``receiver``: CPU per request of folding those batches in (the bytes as the peer's
  connection hands them to ``data_received``: split, decoded, applied to its load model);
* ``flush cycle``: CPU per batch of the machinery around one batch in a running uvloop (the
  flush scheduled on the first event, the wait, the write, the peer's wake-up and read), two
  processes' syncs over a real socket pair in one loop, a one-event batch every 1.5 ms, minus
  the same loop without the event.

In the serve these add up to ``sender + receiver + flush_cycle / batch`` per request (each
process is the sender of its requests and the receiver of its peer's).

Each build runs in its own fresh process per round, builds alternating and the order reversed
every other round (a shared 2-core machine):

    python benchmarks/load_sync_cost.py main=/tmp/main15 this=. [--rounds 8] [--batch 7]

Writes ``benchmarks/results/load_sync_cost.json`` and prints a table (medians, ranges over
rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
FIGURES = ("sender_us", "receiver_us", "flush_cycle_us")


# ------------------------------------------------------------------------------------------
# one build, in its own process (kvplug from PYTHONPATH)


def _one_build(requests: int, batch: int, window: int, phase: str | None = None) -> dict:
    import asyncio
    import random
    import socket
    import time

    import kvplug  # noqa: F401  (from PYTHONPATH, before bench_frontend puts ROOT on sys.path)
    from kvplug.config import RouterConfig
    from kvplug.frontend.gc_tuning import tune_for_serving
    from kvplug.local_sync import LocalLoadSync, _Inbound
    from kvplug.request import RouteRequest
    from kvplug.router import Router
    from kvplug.workers import Worker

    sys.path.insert(0, str(HERE.parent))
    from bench_frontend import make_prompts, token_ids

    def router() -> Router:
        r = Router(RouterConfig(kv_block_size=16, router_mode="kv"), rng=random.Random(0))
        for i in range(2):
            r.add_worker(Worker(f"e{i}"))
        return r

    class SocketTransport:  # what LocalLoadSync needs of its connection to a peer
        def __init__(self, sock: socket.socket) -> None:
            self.write = sock.sendall

        def is_closing(self) -> bool:
            return False

    class Unclosed:
        def close(self) -> None:
            raise AssertionError("the receiver dropped a batch as malformed")

    prompts = [token_ids(p) for p in make_prompts(512)]
    tune_for_serving()
    a, b = router(), router()
    sa = LocalLoadSync(a, "/nonexistent", 0, 2, replica_id="p0", flush_s=0)
    sb = LocalLoadSync(b, "/nonexistent", 1, 2, replica_id="p1", flush_s=0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    sa._out[1] = SocketTransport(ours)  # type: ignore[assignment]
    inbound = _Inbound(sb)
    inbound.transport = Unclosed()
    counter = iter(range(10**9))

    def serve(n: int, listen: bool) -> tuple[float, list[bytes]]:
        """``n`` requests through router ``a`` (``window`` in flight); CPU seconds, and the
        reads of the peer's end of the socket."""
        a.load.listener = sa if listen else None
        reads: list[bytes] = []
        live: list[str] = []
        t0 = time.process_time()
        for i in range(n):
            rid = f"r{next(counter)}"
            a.route(RouteRequest(rid, prompts[i % len(prompts)]))
            live.append(rid)
            if len(live) > window:
                done = live.pop(0)
                a.on_first_token(done)
                a.on_finish(done)
            if listen and i % batch == batch - 1:
                sa._flush()
                if i % (batch * 32) == batch * 32 - 1:  # drain, untimed
                    t1 = time.process_time()
                    reads += _drain(theirs)
                    t0 += time.process_time() - t1
        for done in live:
            a.on_first_token(done)
            a.on_finish(done)
        if listen:
            sa._flush()
        spent = time.process_time() - t0
        return spent, reads + _drain(theirs)

    if phase is not None:  # one phase under callgrind: the differences between phases count
        _, reads = serve(requests, phase != "off")
        if phase == "receive":
            for data in reads:
                inbound.data_received(data)
            assert not b.load.requests and sb.stats.dropped_malformed == 0
        return {}
    chunk = 2000
    serve(chunk, True)  # warm both paths
    serve(chunk, False)
    on, off, reads = 0.0, 0.0, []
    for k in range(max(1, requests // chunk)):
        order = (True, False) if k % 2 == 0 else (False, True)
        for listen in order:
            spent, got = serve(chunk, listen)
            if listen:
                on += spent
                reads += got
            else:
                off += spent
    served = max(1, requests // chunk) * chunk
    assert not a.load.requests
    t0 = time.process_time()
    for data in reads:
        inbound.data_received(data)
    receive = time.process_time() - t0
    assert sb.stats.dropped_malformed == 0 and sb.stats.applied_events > 0
    assert not b.load.requests, "the receiver kept requests the sender finished"
    result = {
        "sender_us": (on - off) / served * 1e6,
        "receiver_us": receive / (served + chunk) * 1e6,  # the warm-up's batches too
        "route_alone_us": off / served * 1e6,
        "events_per_batch": sb.stats.applied_events / max(1, sb.stats.received_batches),
        "bytes_per_request": sum(map(len, reads)) / (served + chunk),
    }
    result["flush_cycle_us"] = asyncio.run(_flush_cycle(router, LocalLoadSync))
    return result


def _drain(sock) -> list[bytes]:
    out = []
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return out
        out.append(data)


async def _flush_cycle(make_router, sync_class, cycles: int = 400) -> float:
    """CPU microseconds per one-event batch, sent and received, in a running loop (the
    default 1 ms flush), minus the same loop's ticks without the event."""
    import asyncio
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        syncs = [
            sync_class(make_router(), tmp, i, 2, replica_id=f"p{i}", heartbeat_s=3600)
            for i in range(2)
        ]
        for s in syncs:
            await s.start()
        while not all(s.connected_peers() for s in syncs):
            await asyncio.sleep(0.01)
        peer = syncs[1].stats
        try:
            figures = []
            for rnd in range(6):
                spent = {}
                for send in (True, False) if rnd % 2 == 0 else (False, True):
                    heard = peer.received_batches
                    t0 = time.process_time()
                    for _ in range(cycles):
                        if send:
                            syncs[0].finished("unknown")  # one event, ignored by the peer
                        await asyncio.sleep(0.0015)
                    spent[send] = time.process_time() - t0
                    if send:
                        assert peer.received_batches - heard >= cycles * 0.9, "batches lost"
                figures.append((spent[True] - spent[False]) / cycles * 1e6)
            return statistics.median(figures[1:])  # the first round warms up
        finally:
            for s in syncs:
                await s.close()


# ------------------------------------------------------------------------------------------
# the rounds


def _instructions(src: str, args) -> dict:
    """Sender and receiver instructions per request: one callgrind run per phase (the route
    loop alone; with the listener, batches written; and the peer folding them), differences."""
    total = {}
    for phase in ("off", "send", "receive"):
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable]
            + [str(HERE), "--one", "--phase", phase, "--requests", str(args.instr_requests)]
            + ["--batch", str(args.batch), "--window", str(args.window)],
            env={**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(ln for ln in out.stderr.splitlines() if "Collected :" in ln)
        total[phase] = int(line.rsplit(":", 1)[1])
    n = args.instr_requests
    return {
        "sender": (total["send"] - total["off"]) / n,
        "receiver": (total["receive"] - total["send"]) / n,
        "totals": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", help="LABEL=SRC_DIR (a source tree built in place)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20000, help="per round and build")
    ap.add_argument(
        "--batch",
        type=int,
        default=7,
        help="requests per batch (the serve at "
        "~13,000 req/s over 2 processes flushes ~6.5 per millisecond)",
    )
    ap.add_argument("--instr-requests", type=int, default=3000, help="per callgrind run")
    ap.add_argument("--window", type=int, default=5, help="requests in flight in the router")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("off", "send", "receive"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="also count sender and receiver instructions per request under valgrind's "
        "callgrind (user space only: steady under a busy machine, blind to the kernel)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_sync_cost.json"))
    args = ap.parse_args()
    if args.one:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        print(json.dumps(_one_build(args.requests, args.batch, args.window, args.phase)))
        return
    builds = []
    for spec in args.builds:
        label, _, src = spec.partition("=")
        builds.append({"name": label, "src": str(Path(src).resolve()), "rounds": []})
    for rnd in range(args.rounds):
        for b in builds if rnd % 2 == 0 else builds[::-1]:
            out = subprocess.run(
                [
                    sys.executable,
                    str(HERE),
                    "--one",
                    "--requests",
                    str(args.requests),
                    "--batch",
                    str(args.batch),
                    "--window",
                    str(args.window),
                ],
                env={**os.environ, "PYTHONPATH": b["src"]},
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                sys.exit(f"{b['name']}: {out.stderr[-2000:]}")
            b["rounds"].append(json.loads(out.stdout.splitlines()[-1]))
        print(
            f"round {rnd + 1}/{args.rounds}  "
            + "  ".join(
                f"{b['name']} " + " ".join(f"{k[:-3]} {b['rounds'][-1][k]:.2f}" for k in FIGURES)
                for b in builds
            ),
            flush=True,
        )
    if args.instructions:
        for b in builds:
            b["instructions"] = _instructions(b["src"], args)
    summary = []
    print(f"\nus per request (median, range over {args.rounds} rounds); flush cycle per batch")
    print(f"{'build':<8}" + "".join(f"{k:>24}" for k in FIGURES) + f"{'per request':>14}")
    for b in builds:
        row = {"build": b["name"], "src": b["src"]}
        cells = []
        for k in (*FIGURES, "route_alone_us", "events_per_batch", "bytes_per_request"):
            vals = [r[k] for r in b["rounds"]]
            row[k] = {
                "median": statistics.median(vals),
                "min": min(vals),
                "max": max(vals),
                "rounds": vals,
            }
            if k in FIGURES:
                cells.append(f"{statistics.median(vals):8.2f} ({min(vals):.2f}-{max(vals):.2f})")
        total = [
            r["sender_us"] + r["receiver_us"] + r["flush_cycle_us"] / args.batch
            for r in b["rounds"]
        ]
        row["per_request_us"] = {"median": statistics.median(total), "rounds": total}
        if "instructions" in b:
            row["instructions_per_request"] = b["instructions"]
        summary.append(row)
        print(
            f"{b['name']:<8}"
            + "".join(f"{c:>24}" for c in cells)
            + f"{statistics.median(total):14.2f}"
        )
    if args.instructions:
        print("\ninstructions per request (callgrind, user space)")
        print(f"{'build':<8}{'sender':>12}{'receiver':>12}")
        for b in builds:
            i = b["instructions"]
            print(f"{b['name']:<8}{i['sender']:>12.0f}{i['receiver']:>12.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "builds": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Discrete-event replay in virtual time: a trace against N simulated engines, driving the real
:class:`kvplug.router.Router` (same object the frontend uses, with the virtual clock injected).

Per arrival at time ``t``: every engine runs the steps that start before ``t``; everything they
reported up to ``t`` reaches the router in time order with the clock set to each item's time
(``on_first_token``, ``on_output_progress`` at block boundaries, ``on_finish`` after
``report_delay_s``; KV events through the event link of :mod:`kvplug.sim.transport`: delay,
jitter, loss, gap detection and replay), engine gauges become worker attributes every
``attribute_period_s``, ``metrics_delay_s`` late; then ``router.route()`` picks an engine and the
request joins its queue. No sockets, no threads. ``LinkConfig()`` is the ideal view (5 ms event
delay, nothing lost, instant reports, exact gauges); ``transport.PRESETS["realistic"]`` is not.

With ``replicas > 1`` the fleet is fronted by that many Routers, as ``kvplug serve`` replicas
would front it: every replica hears every engine's KV events through its own event links (each
with the delay / loss model), gets the gauges, and the requests go to the replicas in turn; a
request's first token, progress and finish reach the replica that routed it. With
``replica_sync`` each replica's request lifecycle reaches the others ``sync_delay_s`` later and
is folded into their load trackers by :class:`kvplug.replica_sync.ReplicaLoad`, the code NATS
load sync runs; without it each replica knows only its own requests.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvplug.errors import InvalidRequest, RoutingError
from kvplug.sim.engine import EngineConfig, SimEngine, SimRequest
from kvplug.sim.steptime import check_slowdowns, engine_model
from kvplug.sim.traces import TraceRecord, block_hashes_of, expand_tokens
from kvplug.sim.transport import EventLink, LinkConfig


class VirtualClock:
    """The router's clock: returns the driver's current virtual time (seconds)."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class PromptLength(Sequence):
    """Stands in for a prompt's token ids when the router gets precomputed block hashes: it has
    the prompt's length (the router's load model needs it) but no content."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise TypeError("token ids are not materialised in hash mode (block_hashes are given)")


@dataclass
class ReplayConfig:
    n_engines: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = "hashes"  # "hashes": precomputed block hashes | "tokens": expanded token ids
    link: LinkConfig = field(default_factory=LinkConfig)  # the router's view (ideal default)
    feed_events: bool = True  # False for routers that ignore KV events (approximate, baselines)
    sample_period_s: float = 10.0  # load-per-engine time series for the plots
    seed: int = 0
    n_prefill: int = 0  # > 0: disaggregated, engines [0, n_prefill) prefill, the rest decode
    event_driven: bool = True  # False: step and collect every engine at each arrival (baseline)
    replicas: int = 1  # router replicas; requests go to them in turn
    replica_sync: bool = True  # replicas fold each other's request lifecycle (kvplug.replica_sync)
    sync_delay_s: float = 0.003  # a replica's lifecycle event reaches the others this late
    pick_stats: bool = False  # record each pick's in-flight excess over the least-loaded engine
    # a mixed fleet: engine i's step times are engine.model's times slowdowns[i % len] (empty:
    # every engine alike)
    slowdowns: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("hashes", "tokens"):
            raise ValueError(f"mode must be 'hashes' or 'tokens', got {self.mode!r}")
        if self.n_engines < 1:
            raise ValueError("n_engines must be >= 1")
        if not 0 <= self.n_prefill < self.n_engines:
            raise ValueError("n_prefill must be in [0, n_engines): decode engines are needed")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if not self.sync_delay_s >= 0:
            raise ValueError("sync_delay_s must be >= 0")
        check_slowdowns(self.slowdowns)


@dataclass
class ReplayResult:
    policy: str
    requests: list[SimRequest]
    engines: list[SimEngine]
    load_samples_t: list[float]
    load_samples: list[list[int]]  # per sample: running + waiting per engine
    route_errors: int
    route_seconds: float  # wall time inside router.route()
    wall_seconds: float
    router_stats: dict
    prefill_requests: list[SimRequest] = field(default_factory=list)  # P/D: the prefill hops
    link_stats: dict = field(default_factory=dict)  # KV-event batches lost, gaps, replayed
    # pick_stats: per decision, the chosen engine's running + waiting requests minus the fewest
    # any engine of its stage had (god's view, over all replicas' requests)
    pick_excess: list[int] = field(default_factory=list)
    replica_stats: list[dict] = field(default_factory=list)  # replicas: ReplicaLoad counters


def _engine_id(i: int) -> str:
    return f"sim-{i}"


def make_fleet(cfg: ReplayConfig) -> list[SimEngine]:
    return [SimEngine(_engine_id(i), engine_config(cfg, i)) for i in range(cfg.n_engines)]


def engine_config(cfg: ReplayConfig, i: int) -> EngineConfig:
    """Engine i's configuration: the fleet's, its step times scaled in a mixed fleet."""
    model = engine_model(cfg.engine.model, cfg.slowdowns, i)
    return cfg.engine if model is cfg.engine.model else replace(cfg.engine, model=model)


def replay(
    records: Sequence[TraceRecord],
    router_config,
    cfg: ReplayConfig | None = None,
    *,
    policy: str = "",
    progress: Callable[[int], None] | None = None,
    router_factory: Callable[..., Any] | None = None,
    observe: Callable[..., None] | None = None,
) -> ReplayResult:
    """Replay ``records`` through a fresh Router built from ``router_config``.

    With ``cfg.n_prefill > 0`` the fleet is disaggregated: engines ``0..n_prefill-1`` are prefill
    workers, the rest decode workers. Each request is routed twice (stage PREFILL at arrival;
    stage DECODE when its prefill finishes) and its prompt KV is transferred to the decode engine.

    ``router_factory(config, clock=, rng=)``: builds something with the Router's interface
    instead of a :class:`Router` (the baseline policies of :mod:`kvplug.sim.baselines`).

    ``observe(t, request, decision, router, engines)``: called after each routing decision, before
    the request reaches its engine (analyses: ``benchmarks/sim_loss_breakdown.py``). ``engines``
    maps worker ids to the :class:`SimEngine` objects; each is as of its last step at or
    before ``t`` (the event-driven replay advances an engine only when it has something due).
    """
    from kvplug.request import RouteRequest
    from kvplug.router import Router
    from kvplug.workers import Role, Stage, Worker

    cfg = cfg or ReplayConfig()
    if router_config.kv_block_size != cfg.engine.block_size:
        raise ValueError(
            f"router block size {router_config.kv_block_size} != engine block size "
            f"{cfg.engine.block_size}"
        )
    bt = cfg.engine.block_size  # = the trace's tokens per hash id
    clock = VirtualClock()
    make_router = router_factory or Router
    # common random numbers: replicas draw from the one stream a single router would, so
    # configurations differ by what the replicas know, not by luck
    router_rng = random.Random(cfg.seed)
    n_rep = cfg.replicas
    routers = [make_router(router_config, clock=clock, rng=router_rng) for _ in range(n_rep)]
    router = routers[0]
    engines = make_fleet(cfg)
    by_id = {e.worker_id: e for e in engines}
    pd = cfg.n_prefill > 0
    for i, e in enumerate(engines):
        role = Role.BOTH if not pd else (Role.PREFILL if i < cfg.n_prefill else Role.DECODE)
        for r in routers:
            r.add_worker(
                Worker(
                    worker_id=e.worker_id,
                    engine="sim",
                    role=role,
                    kv_capacity_blocks=cfg.engine.capacity_blocks,
                    max_batched_tokens=cfg.engine.max_batched_tokens,
                    long_prefill_token_threshold=cfg.engine.long_prefill_token_threshold,
                    long_prefill_token_threshold_adaptive=(
                        cfg.engine.long_prefill_token_threshold_adaptive
                    ),
                )
            )
    # engines that receive new requests only at trace arrivals, and (P/D) the decode engines,
    # which receive them at prefill completions and so advance in step with the event heap
    arrival_engines = engines[: cfg.n_prefill] if pd else engines
    # event-driven stepping of the arrival engines: a heap of (start of the next step that can
    # report anything, version, index) over the busy ones, so an arrival touches only engines
    # with something to say before it, not all N; a decode-only run is advanced lazily (when it
    # reaches an eventful step, or when a request is routed to it). Engines given output outside
    # a step (a rejected request) are collected as dirty.
    arrival_index = {e.worker_id: i for i, e in enumerate(arrival_engines)}
    event_driven = cfg.event_driven
    busy: list[tuple[float, int, int]] = []
    version = [0] * len(arrival_engines)
    dirty: set[int] = set()

    def schedule(k: int) -> None:
        version[k] += 1  # older heap entries of this engine are stale
        when = arrival_engines[k].next_output_start()
        if when != math.inf:
            heapq.heappush(busy, (when, version[k], k))

    decode_engines = engines[cfg.n_prefill :] if pd else []
    decode_ids = {e.worker_id for e in decode_engines}
    feed_events = cfg.feed_events
    link_cfg = cfg.link
    report_delay = link_cfg.report_delay_s
    # one event link per (replica, engine): each replica subscribes to every engine itself
    link_rngs = [
        random.Random(cfg.seed ^ 0x5EED if k == 0 else f"{cfg.seed}/{k}") for k in range(n_rep)
    ]
    replica_links = [[EventLink(link_cfg, link_rngs[k]) for _ in engines] for k in range(n_rep)]
    links = [lk for per_replica in replica_links for lk in per_replica]
    links_of = {
        e.worker_id: [replica_links[k][i] for k in range(n_rep)] for i, e in enumerate(engines)
    }
    heap: list[tuple] = []  # (time, seq, kind, payload)
    seq = 0
    owner: dict[str, int] = {}  # request id -> the replica that routed it (replicas only)
    syncs: list[Any] = []
    if n_rep > 1 and cfg.replica_sync:
        if not hasattr(router, "load"):
            raise ValueError("replica load sync needs a kvplug Router (this policy has no load)")
        from kvplug.replica_sync import ReplicaLoad

        sync_delay = cfg.sync_delay_s

        def sender(k: int) -> Callable[[list], None]:
            def send(event: list) -> None:
                nonlocal seq
                seq += 1
                heapq.heappush(heap, (clock.now + sync_delay, seq, "sync", (k, [event])))
                syncs[k].stats.published_events += 1

            return send

        for k, r in enumerate(routers):
            syncs.append(ReplicaLoad(r, f"replica-{k}", send=sender(k), clock=clock))
            syncs[k].attach()
    pick_stats = cfg.pick_stats
    pick_excess: list[int] = []
    requests: list[SimRequest] = []
    prefill_requests: list[SimRequest] = []
    handoff: dict[str, tuple[SimRequest, RouteRequest]] = {}  # prefill id -> decode request
    route_errors = 0
    route_s = 0.0
    samples_t: list[float] = []
    samples: list[list[int]] = []
    next_attr = 0.0
    next_sample = 0.0
    tokens_mode = cfg.mode == "tokens"

    def publish(k: int, link: EventLink, t: float, batch: list) -> None:
        nonlocal seq
        sent = link.publish(t, batch)
        if sent is not None:
            seq += 1
            heapq.heappush(heap, (sent[1], seq, "kv", (k, link, sent[0], batch)))

    def publish_all(wid: str, t: float, batch: list) -> None:
        for k, link in enumerate(links_of[wid]):
            publish(k, link, t, batch)

    def collect(group) -> None:
        nonlocal seq
        for e in group:
            out = e.outputs
            if not out:
                continue
            wid = e.worker_id
            batch: list = []
            batch_t = 0.0
            for kind, t, payload in out:
                if kind == "kv":
                    if not feed_events:
                        continue
                    if batch and t != batch_t:  # one engine step's events = one batch
                        publish_all(wid, batch_t, batch)
                        batch = []
                    batch_t = t
                    batch.append(payload)
                    continue
                seq += 1
                heapq.heappush(heap, (t + report_delay, seq, kind, payload))
            if batch:
                publish_all(wid, batch_t, batch)
            out.clear()

    def route(
        sreq: SimRequest,
        rreq: RouteRequest,
        t: float,
        queue_at: float | None = None,
        replica: int = 0,
    ):
        """Route on ``replica`` and queue the request on the chosen engine at ``queue_at``
        (default ``t``)."""
        nonlocal route_errors, route_s, seq
        if n_rep > 1:  # set first: a failed prefill hop's decode hop goes to this replica too
            owner[rreq.request_id] = replica
        r0 = time.perf_counter()
        try:
            decision = routers[replica].route(rreq)
        except (RoutingError, InvalidRequest) as exc:
            route_errors += 1
            sreq.rejected = f"routing error: {exc}"
            return
        route_s += time.perf_counter() - r0
        if observe is not None:
            observe(t, rreq, decision, routers[replica], by_id)
        engine = by_id[decision.worker_id]
        if pick_stats:
            group = decode_engines if engine.worker_id in decode_ids else arrival_engines
            inflight = [e.num_running + e.num_waiting for e in group]
            pick_excess.append(engine.num_running + engine.num_waiting - min(inflight))
        if queue_at is None or queue_at <= t:
            k = arrival_index.get(engine.worker_id) if event_driven else None
            if k is not None and engine.has_work():
                engine.advance(t)  # a lazily skipped decode run catches up (no output before t)
            engine.add_request(sreq, t)
            if k is not None:
                schedule(k)
                if engine.outputs:
                    dirty.add(k)
        else:
            seq += 1
            heapq.heappush(heap, (queue_at, seq, "queue", (engine, sreq)))

    def start_decode(p_req: SimRequest, t: float) -> None:
        """Prefill done: pick the decode engine now; the request queues there once its prompt
        KV has been transferred (full blocks at ``transfer_gbps``)."""
        d_req, rreq = handoff.pop(p_req.request_id)
        if p_req.rejected:
            d_req.rejected = f"prefill failed: {p_req.rejected}"
            return
        cacheable = min(d_req.prompt_blocks, (d_req.prompt_len - 1) // bt)
        transfer_s = cfg.engine.model.transfer_ms(cacheable * bt) / 1000.0
        route(d_req, rreq, t, queue_at=t + transfer_s, replica=owner.get(p_req.request_id, 0))

    def owner_of(request_id: str, done: bool = False):
        """The router that routed the request (with replicas: its reports go there only)."""
        if n_rep == 1:
            return router
        k = owner.pop(request_id, 0) if done else owner.get(request_id, 0)
        return routers[k]

    def deliver(until: float) -> None:
        nonlocal seq
        while True:
            if decode_engines:  # bring the decode engines up to the next item first
                x = min(heap[0][0], until) if heap else until
                for e in decode_engines:
                    if e.has_work():
                        e.advance(x)
                collect(decode_engines)
            if not heap or heap[0][0] > until:
                return
            t, _, kind, payload = heapq.heappop(heap)
            clock.now = t
            if kind == "kv":
                k, link, bseq, batch = payload
                ready, gap = link.on_batch(bseq, batch)
                for evs in ready:
                    for ev in evs:
                        routers[k].apply_event(ev)
                if gap:
                    seq += 1
                    heapq.heappush(heap, (t + link_cfg.replay_rtt_s, seq, "replay", (k, link)))
            elif kind == "replay":
                k, link = payload
                for evs in link.on_replay(t):
                    for ev in evs:
                        routers[k].apply_event(ev)
            elif kind == "attrs":
                for r in routers:
                    for wid, attrs in payload:
                        r.set_attributes(wid, attrs, ts=t)
            elif kind == "first":
                owner_of(payload.request_id).on_first_token(payload.request_id)
            elif kind == "progress":
                owner_of(payload.request_id).on_output_progress(
                    payload.request_id, payload.generated
                )
            elif kind == "queue":  # P/D: transferred KV landed, the decode request queues
                engine, d_req = payload
                engine.add_request(d_req, t)
            elif kind == "sync":  # a replica's lifecycle events reach the others
                k, events = payload
                peer = syncs[k].replica_id
                for j, sync in enumerate(syncs):
                    if j != k:
                        sync.apply_events(peer, events)
            else:  # finish (success or rejection)
                if payload.request_id in handoff:  # the decode hop goes to the same replica
                    owner_of(payload.request_id).on_finish(payload.request_id)
                    start_decode(payload, t)
                    owner.pop(payload.request_id, None)
                else:
                    owner_of(payload.request_id, done=True).on_finish(payload.request_id)

    def make_route_request(rid: str, sreq: SimRequest, stage) -> RouteRequest:
        if sreq.token_ids is not None:  # tokens mode: every request carries its tokens
            return RouteRequest(request_id=rid, token_ids=sreq.token_ids, stage=stage)
        return RouteRequest(
            request_id=rid,
            token_ids=PromptLength(sreq.prompt_len),
            block_hashes=np.asarray(sreq.block_hashes, dtype=np.uint64),
            stage=stage,
        )

    wall0 = time.perf_counter()
    for i, rec in enumerate(records):
        replica = i % n_rep  # requests spread over the replicas in turn
        t = rec.arrival_s
        if not event_driven:  # the scan over every engine, kept as the benchmark's baseline
            for e in arrival_engines:
                if e.has_work():
                    e.advance(t)
            collect(arrival_engines)
        while busy and busy[0][0] < t:
            _, ver, k = heapq.heappop(busy)
            if ver != version[k]:
                continue
            arrival_engines[k].advance(t)
            dirty.add(k)
            schedule(k)  # its next output starts at or after t: not popped again now
        if dirty:
            collect([arrival_engines[k] for k in sorted(dirty)])  # engine order, as before
            dirty.clear()
        deliver(t)
        clock.now = t
        if t >= next_attr:
            snapshot = [(e.worker_id, e.metrics()) for e in engines]
            if link_cfg.metrics_delay_s > 0:
                seq += 1
                heapq.heappush(heap, (t + link_cfg.metrics_delay_s, seq, "attrs", snapshot))
            else:
                for r in routers:
                    for wid, attrs in snapshot:
                        r.set_attributes(wid, attrs, ts=t)
            next_attr = t + link_cfg.attribute_period_s
        if t >= next_sample:
            samples_t.append(t)
            samples.append([e.num_running + e.num_waiting for e in engines])
            next_sample = t + cfg.sample_period_s
        nf = rec.input_length // bt
        hashes = block_hashes_of(rec.hash_ids, nf)
        tokens = expand_tokens(rec.hash_ids, rec.input_length, bt) if tokens_mode else None
        out_len = max(rec.output_length, 1)
        sreq = SimRequest(f"r{i}", t, rec.input_length, out_len, hashes, tokens, salt=i + 1)
        requests.append(sreq)
        if pd:
            # the prefill hop generates one token (vLLM's max_tokens=1 prefill request); the
            # decode hop generates the whole output from the transferred KV
            p_req = SimRequest(f"r{i}:p", t, rec.input_length, 1, hashes, tokens, salt=-(i + 1))
            prefill_requests.append(p_req)
            sreq.kv_from_remote = True
            handoff[p_req.request_id] = (
                sreq,
                make_route_request(sreq.request_id, sreq, Stage.DECODE),
            )
            route(
                p_req,
                make_route_request(p_req.request_id, p_req, Stage.PREFILL),
                t,
                replica=replica,
            )
            if p_req.rejected and p_req.request_id in handoff:
                start_decode(p_req, t)
        else:
            route(
                sreq,
                make_route_request(sreq.request_id, sreq, Stage.AGGREGATED),
                t,
                replica=replica,
            )
        if progress is not None:
            progress(1)
    for e in arrival_engines:
        e.run_until_idle()
    collect(arrival_engines)
    deliver(math.inf)
    for e in decode_engines:  # nothing left to hand off: drain
        e.run_until_idle()
    collect(decode_engines)
    deliver(math.inf)
    return ReplayResult(
        policy=policy
        or getattr(router_config, "router_mode", "")
        or getattr(router_config, "name", ""),
        requests=requests,
        engines=engines,
        load_samples_t=samples_t,
        load_samples=samples,
        route_errors=route_errors,
        route_seconds=route_s,
        wall_seconds=time.perf_counter() - wall0,
        router_stats=_router_stats(router),
        prefill_requests=prefill_requests,
        link_stats={k: sum(lk.stats[k] for lk in links) for k in links[0].stats},
        pick_excess=pick_excess,
        replica_stats=_replica_stats(routers, syncs, replica_links) if n_rep > 1 else [],
    )


def _replica_stats(routers: list, syncs: list, links: list[list[EventLink]]) -> list[dict]:
    """Per replica: requests still tracked after the drain (0 when every lifecycle, its own and
    the folded ones, was closed), its event links' counters and, with load sync, its
    ReplicaLoad counters."""
    out = []
    for k, r in enumerate(routers):
        load = getattr(r, "load", None)
        st: dict = {"active_requests": load.active_count() if load is not None else None}
        st.update(
            {f"event_{name}": sum(lk.stats[name] for lk in links[k]) for name in links[k][0].stats}
        )
        if syncs:
            st.update(syncs[k].stats_dict())
        out.append(st)
    return out


def _router_stats(router) -> dict:
    index = getattr(router, "index", None)
    if index is not None and hasattr(index, "stats"):
        return dict(index.stats())
    return dict(router.stats()) if hasattr(router, "stats") else {}  # the baselines


def summarize(res: ReplayResult) -> dict:
    """Per-policy figures: hit rate, TTFT, end-to-end latency, throughput, load imbalance."""
    done = [r for r in res.requests if not r.rejected and not math.isnan(r.first_token)]
    # cache reuse is where prompts are computed: the prefill hops in P/D
    hit_src = [r for r in res.prefill_requests if not r.rejected] if res.prefill_requests else done
    prompt_blocks = sum(r.prompt_blocks for r in hit_src)
    hit_dev = sum(r.hit_device for r in hit_src)
    hit_host = sum(r.hit_host for r in hit_src)
    ttft = np.array([r.first_token - r.arrival for r in done]) if done else np.zeros(1)
    e2e = np.array([r.finished - r.arrival for r in done]) if done else np.zeros(1)
    out_tokens = sum(r.output_len for r in done)
    t0 = min((r.arrival for r in res.requests), default=0.0)
    t1 = max((r.finished for r in done), default=t0)
    per_engine_req = np.array([e.stats["requests"] for e in res.engines], dtype=float)
    per_engine_prefill = np.array([e.stats["prefill_tokens"] for e in res.engines], dtype=float)
    per_engine_busy = np.array([e.stats["busy_s"] for e in res.engines], dtype=float)

    def imbalance(v: np.ndarray) -> float:
        return float(v.max() / v.mean()) if v.mean() > 0 else 1.0

    return {
        "policy": res.policy,
        "requests": len(res.requests),
        "completed": len(done),
        "rejected": len(res.requests) - len(done),
        "prompt_blocks": prompt_blocks,
        "hit_rate": (hit_dev + hit_host) / prompt_blocks if prompt_blocks else 0.0,
        "hit_rate_device": hit_dev / prompt_blocks if prompt_blocks else 0.0,
        "hit_rate_host": hit_host / prompt_blocks if prompt_blocks else 0.0,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / (t1 - t0) if t1 > t0 else 0.0,
        "prefill_tokens": int(per_engine_prefill.sum()),
        "imbalance_requests": imbalance(per_engine_req),
        "imbalance_prefill_tokens": imbalance(per_engine_prefill),
        "imbalance_busy": imbalance(per_engine_busy),
        "busy_fraction_mean": float(per_engine_busy.mean() / (t1 - t0)) if t1 > t0 else 0.0,
        "transferred_blocks": sum(r.remote_blocks for r in done),
        # kv_allocation="vllm": running requests sent back to the queue to recompute
        "preemptions": sum(e.stats["preemptions"] for e in res.engines),
        "route_errors": res.route_errors,
        "route_us_mean": 1e6 * res.route_seconds / max(1, len(res.requests)),
        "event_batches": res.link_stats.get("batches", 0),
        "event_batches_lost": res.link_stats.get("lost", 0),
        "event_gaps": res.link_stats.get("gaps", 0),
        "event_batches_unrecovered": res.link_stats.get("unrecovered", 0),
        "wall_s": res.wall_seconds,
        **_pick_summary(res.pick_excess),
    }


def _pick_summary(excess: list[int]) -> dict:
    """Herding, seen at each decision: how many more requests (running + waiting) the chosen
    engine had than the least-loaded engine of its stage (``pick_stats`` runs only)."""
    if not excess:
        return {}
    a = np.asarray(excess, dtype=float)
    return {
        "pick_least_loaded": float((a == 0).mean()),
        "pick_excess_mean": float(a.mean()),
        "pick_excess_p99": float(np.percentile(a, 99)),
        "pick_excess_max": int(a.max()),
    }

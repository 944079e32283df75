"""A simulated serving engine: FCFS continuous batching with chunked prefill over a paged,
prefix-cached KV cache, timed by :mod:`kvplug.sim.steptime`.

The engine runs in virtual time and is advanced by its driver: :meth:`SimEngine.advance` runs
every step that *starts* before a given time. Runs of decode-only steps with an unchanged batch
are fast-forwarded in closed form (step times form an arithmetic series, since every sequence's
context grows by one token per step), so an hour of traffic costs a few hundred thousand Python
operations, not millions of steps.

What it reports (``SimEngine.outputs``, time-stamped, consumed by the driver):
``("first", t, request)``, ``("progress", t, request)`` at each output block boundary,
``("finish", t, request)``, and ``("kv", t, event)`` normalised kvplug events.

Scheduling (vLLM V1-like, simplified; assumptions in docs/sim.md):
* per step, every decoding sequence takes one token of the ``max_batched_tokens`` budget, then
  running prefills take chunks in arrival order, then waiting requests are admitted FCFS while
  budget, ``max_num_seqs`` and KV blocks allow;
* admission references the cached prefix (device hits, then host-tier hits which are reloaded at
  a copy cost) and, with ``kv_allocation="reserve"`` (the default), reserves KV for the rest of
  the prompt *and* the requested output, so a running sequence is never preempted (a request
  that cannot fit waits at the head of the queue); with ``kv_allocation="vllm"`` KV is
  allocated as vLLM 0.32.0 allocates it: a request is admitted when its whole prompt fits, each
  step allocates the blocks that step computes, and a running request that cannot grow
  preempts the latest admitted one (its blocks freed tail first, recomputed when it is taken in
  again, as vLLM recomputes a preempted request);
* the last prompt token is always computed (a fully cached prompt recomputes its last block);
* the step that computes a prompt's last chunk also samples its first token;
* with ``long_prefill_token_threshold`` T > 0, no prompt's chunk exceeds T tokens while more
  than one request is running or waiting, as vLLM's V1 scheduler caps it (vLLM 0.32.0,
  ``vllm/v1/core/sched/scheduler.py``: the cap applies to running and waiting requests alike,
  and not when a request is alone); with ``long_prefill_token_threshold_adaptive`` the cap is
  at least the budget over the running and waiting requests, as vLLM's flag of that name
  floors it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvplug.events import BlockMoved, BlockRemoved, BlockStored, KvEvent
from kvplug.sim.cache import BlockCache, CacheFull
from kvplug.sim.steptime import REFERENCE, StepTimeModel
from kvplug.sim.traces import output_tokens

_M64 = (1 << 64) - 1


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request as the engine sees it. ``block_hashes``: engine hashes of the full prompt
    blocks (chained: equal hash = equal prefix). ``token_ids``: the prompt's tokens when events
    must carry tokens (token mode); None in hash mode."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    block_hashes: Sequence[int]
    token_ids: np.ndarray | None = None
    salt: int = 0  # seeds this request's output-block hashes / stand-in output tokens
    kv_from_remote: bool = False  # decode stage of a P/D request: prompt KV arrives by transfer
    # --- engine state ---
    worker_id: str = ""
    computed: int = 0  # prompt tokens whose KV exists (cached prefix + computed chunks)
    generated: int = 0
    held: list[int] = field(default_factory=list)  # referenced block hashes, chain order
    reserved: int = 0  # anonymous blocks still reserved for this request
    hit_device: int = 0  # prompt blocks found on the device at admission
    hit_host: int = 0  # prompt blocks reloaded from the host tier
    remote_blocks: int = 0  # prompt blocks received from a prefill engine (P/D)
    reload_tokens: int = 0  # pending host->device copy, charged to its first step
    # the tokens its prefill computes (set when it is queued: the prompt; with
    # kv_allocation="vllm", after a preemption, the prompt and the tokens generated so far, as
    # vLLM recomputes them) and the chained hashes of their full blocks; its place in the
    # running order, and how often it was preempted
    prefill_len: int = 0
    prefill_hashes: Sequence[int] = ()
    admission: int = 0
    preemptions: int = 0
    admitted: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    rejected: str = ""

    @property
    def prompt_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 512
    capacity_blocks: int = 1640  # 8B on H200: ~840k tokens of KV (assumption, see steptime)
    host_capacity_blocks: int = 0  # 0 = no host tier
    max_batched_tokens: int = 8192  # chunked-prefill token budget per step (vLLM-like default)
    # vLLM's --long-prefill-token-threshold: while another request is running or waiting, no
    # prompt takes more than this many tokens of a step, so a long prefill leaves room for the
    # rest (0 = off, vLLM's default)
    long_prefill_token_threshold: int = 0
    # vLLM's --long-prefill-token-threshold-adaptive: that cap is floored at the budget's fair
    # share, max_batched_tokens // (running + waiting requests)
    long_prefill_token_threshold_adaptive: bool = False
    max_num_seqs: int = 256
    events_with_tokens: bool = False  # token mode: BlockStored carries token ids, not hashes
    emit_output_blocks: bool = True  # report blocks filled by generated tokens, as vLLM does
    fast_forward: bool = True  # closed-form decode runs (False: one step at a time; tests)
    # "reserve": prompt and requested output reserved at admission, nothing preempted (the
    # simplification every README figure was replayed with); "vllm": as vLLM 0.32.0 allocates
    # (the whole prompt must fit to be admitted, blocks allocated as computed, the latest
    # admitted request preempted and recomputed when a running one cannot grow)
    kv_allocation: str = "reserve"
    # with a host tier: "evicted" (a device block is moved to the host when evicted, and moved
    # back on a hit: a victim cache, what every README figure was replayed with); "stored" (as
    # vLLM's default offloading connector, OffloadingConnector: every block computed on the
    # device is copied to the host, whose LRU keeps copies; a hit is copied back)
    host_offload: str = "evicted"
    model: StepTimeModel = REFERENCE


class SimEngine:
    def __init__(self, worker_id: str, config: EngineConfig | None = None, dp_rank: int = 0):
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.cfg = config or EngineConfig()
        self.model = self.cfg.model
        self.bs = self.cfg.block_size
        if self.cfg.kv_allocation not in ("reserve", "vllm"):
            raise ValueError(
                f"kv_allocation must be 'reserve' or 'vllm', got {self.cfg.kv_allocation!r}"
            )
        self.vllm_allocation = self.cfg.kv_allocation == "vllm"
        if self.cfg.host_offload not in ("evicted", "stored"):
            raise ValueError(
                f"host_offload must be 'evicted' or 'stored', got {self.cfg.host_offload!r}"
            )
        self._admitted = 0  # admissions so far: the running order preemption goes by
        self.cache = BlockCache(
            self.cfg.capacity_blocks,
            self.cfg.host_capacity_blocks,
            sink=self._on_cache_change,
            host_inclusive=self.cfg.host_offload == "stored",
        )
        self.now = 0.0  # end of the last step (virtual seconds)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.outputs: list[tuple] = []
        self._pending_cache: list[tuple] = []  # cache changes of the step being built
        self.stats = {
            "steps": 0,
            "decode_runs": 0,
            "busy_s": 0.0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "requests": 0,
            "rejected": 0,
            "prompt_blocks": 0,
            "hit_blocks_device": 0,
            "hit_blocks_host": 0,
            "remote_blocks": 0,
            "preemptions": 0,
        }

    # -- introspection ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.cache.active / self.cache.capacity

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def metrics(self) -> dict[str, float]:
        """Gauges under the attribute names the vLLM metrics scraper gives the router (vLLM's
        names and the aliases kvplug's scorers read)."""
        running, waiting, usage = float(self.num_running), float(self.num_waiting), self.kv_usage()
        return {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage": usage,
            "running_requests": running,
            "queue_depth": waiting,
            "kv_usage": usage,
        }

    # -- input ----------------------------------------------------------------------------------
    def add_request(self, req: SimRequest, t: float) -> None:
        """Queue a request arriving at ``t`` (the engine must have been advanced to ``t``)."""
        req.worker_id = self.worker_id
        if not self.has_work() and self.now < t:
            self.now = t  # idle engine: the next step starts at the arrival
        need = -(-(req.prompt_len + req.output_len) // self.bs)
        if need > self.cache.capacity or req.prompt_len <= 0:
            # can never fit: fail it now rather than block the queue forever
            req.rejected = f"needs {need} KV blocks, capacity {self.cache.capacity}"
            req.finished = max(t, self.now)
            self.stats["rejected"] += 1
            self.outputs.append(("finish", req.finished, req))
            return
        req.prefill_len, req.prefill_hashes = req.prompt_len, req.block_hashes
        self.waiting.append(req)

    # -- cache -> events ------------------------------------------------------------------------
    def _on_cache_change(self, kind: str, tier, hashes: list[int]) -> None:
        self._pending_cache.append((kind, tier, hashes))

    def _flush_cache_events(self, t: float) -> None:
        wid, rank = self.worker_id, self.dp_rank
        ev: KvEvent
        for kind, tier, hashes in self._pending_cache:
            if kind == "removed":
                ev = BlockRemoved(worker_id=wid, dp_rank=rank, tier=tier, engine_hashes=hashes)
            elif kind == "host_stored":  # copies of device blocks: resolved by engine hash
                ev = BlockStored(
                    worker_id=wid,
                    dp_rank=rank,
                    tier=tier,
                    engine_hashes=hashes,
                    tier_copy=True,
                    block_size=self.bs,
                )
            elif kind == "moved":
                ev = BlockMoved(
                    worker_id=wid,
                    dp_rank=rank,
                    from_tier=tier[0],
                    to_tier=tier[1],
                    engine_hashes=hashes,
                )
            else:  # "stored" events are built by _stored() with their tokens / hashes
                ev = tier
            self.outputs.append(("kv", t, ev))
        self._pending_cache.clear()

    def _stored(
        self, req: SimRequest, first_block: int, hashes: list[int], stored: list[bool]
    ) -> None:
        """Queue BlockStored events for the newly cached blocks among ``hashes`` (which are the
        request's blocks ``first_block..``), one event per contiguous run."""
        i, n = 0, len(hashes)
        while i < n:
            if not stored[i]:
                i += 1
                continue
            j = i
            while j < n and stored[j]:
                j += 1
            pos = first_block + i
            run = hashes[i:j]
            parent = req.held[pos - 1] if pos > 0 else None
            if self.cfg.events_with_tokens:
                toks = self._block_tokens(req, pos, j - i)
                ev = BlockStored(
                    worker_id=self.worker_id,
                    dp_rank=self.dp_rank,
                    parent_engine_hash=parent,
                    engine_hashes=run,
                    token_ids=toks,
                    block_size=self.bs,
                )
            else:
                ev = BlockStored(
                    worker_id=self.worker_id,
                    dp_rank=self.dp_rank,
                    parent_engine_hash=parent,
                    engine_hashes=run,
                    block_hashes=run,
                    block_size=self.bs,
                )
            self._pending_cache.append(("stored", ev, run))
            i = j

    def _block_tokens(self, req: SimRequest, pos: int, n: int) -> list[int]:
        lo, hi = pos * self.bs, (pos + n) * self.bs
        prompt = req.token_ids if req.token_ids is not None else np.zeros(0, np.uint32)
        parts = []
        if lo < req.prompt_len:
            parts.append(prompt[lo : min(hi, req.prompt_len)])
        if hi > req.prompt_len:
            start = max(lo, req.prompt_len) - req.prompt_len
            parts.append(output_tokens(req.salt, start, hi - max(lo, req.prompt_len)))
        return np.concatenate(parts).tolist()

    def _commit(self, req: SimRequest, hashes: list[int]) -> None:
        first = len(req.held)
        stored = self.cache.commit(hashes)
        req.held.extend(hashes)
        req.reserved -= len(hashes)
        if any(stored):
            self._stored(req, first, hashes, stored)
        if self.cache.host_inclusive:  # the offloading connector stores what a step computed
            self.cache.store_host(hashes)

    def _copied_back(self, req: SimRequest, dev: list[int], host: list[int]) -> None:
        """An inclusive host tier: its hits were copied to the device, after the device hits,
        and are reported as stored there, as vLLM's prefix cache reports the blocks it loaded;
        the device hits are offered to the host again, as vLLM's offloading connector offers a
        request's hits (stored if the host lost them)."""
        if not self.cache.host_inclusive:
            return
        if host:
            first = len(req.held) - len(host)
            self._stored(req, first, host, [True] * len(host))
        if dev:
            self.cache.store_host(dev)

    @staticmethod
    def _output_block_hash(req: SimRequest, block_index: int) -> int:
        """A request-unique hash for a block filled by generated tokens (splitmix64)."""
        x = (req.salt * 0x9E3779B97F4A7C15 + block_index) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)

    # -- scheduling -----------------------------------------------------------------------------
    def _admit(self, req: SimRequest) -> bool:
        if self.vllm_allocation:
            return self._admit_as_vllm(req)
        nf = len(req.block_hashes)
        cacheable = min(nf, (req.prompt_len - 1) // self.bs)  # the last token is always computed
        dev, host = self.cache.split_prefix(req.block_hashes[:cacheable])
        hits = len(dev) + len(host)
        need = -(-(req.prompt_len + req.output_len) // self.bs)
        try:
            self.cache.admit(dev, host, need - hits)
        except CacheFull:
            return False
        req.held = list(dev) + list(host)
        req.reserved = need - hits
        self._admitted_with_hits(req, dev, host, cacheable)
        return True

    def _admit_as_vllm(self, req: SimRequest) -> bool:
        """vLLM 0.32.0's admission: the prefix hits are referenced when the blocks of the whole
        prefill (not the output) fit; the blocks it computes are allocated step by step."""
        chain = req.prefill_hashes
        cacheable = min(len(chain), (req.prefill_len - 1) // self.bs)
        dev, host = self.cache.split_prefix(chain[:cacheable])
        hits = len(dev) + len(host)
        try:
            self.cache.admit(dev, host, 0, fits=-(-req.prefill_len // self.bs) - hits)
        except CacheFull:
            return False
        req.held = list(dev) + list(host)
        req.reserved = 0
        self._admitted += 1
        req.admission = self._admitted
        if req.preemptions:  # its hit was counted when it was first admitted
            req.computed = hits * self.bs
            req.reload_tokens = len(host) * self.bs
            self._copied_back(req, dev, host)
            return True
        if req.kv_from_remote and cacheable > hits:
            self.cache.reserve(cacheable - hits)  # the transferred blocks, committed below
            req.reserved = cacheable - hits
        self._admitted_with_hits(req, dev, host, cacheable)
        return True

    def _admitted_with_hits(
        self, req: SimRequest, dev: list[int], host: list[int], cacheable: int
    ) -> None:
        """A request's first admission: its prefix hits and the statistics."""
        nf = len(req.block_hashes)
        hits = len(dev) + len(host)
        self._copied_back(req, dev, host)
        req.hit_device, req.hit_host = len(dev), len(host)
        req.computed = hits * self.bs
        req.reload_tokens = len(host) * self.bs
        if req.kv_from_remote and cacheable > hits:
            # P/D decode side: the prefill engine's blocks arrived by KV transfer (asynchronous,
            # before the request was queued here, as NIXL pulls are) and enter this engine's
            # prefix cache (vLLM's decode engine reports them as stored)
            remote = list(req.block_hashes[hits:cacheable])
            self._commit(req, remote)
            req.remote_blocks = len(remote)
            req.computed = cacheable * self.bs
            self.stats["remote_blocks"] += len(remote)
        st = self.stats
        st["requests"] += 1
        st["prompt_blocks"] += nf
        st["hit_blocks_device"] += len(dev)
        st["hit_blocks_host"] += len(host)
        st["cached_tokens"] += req.computed
        st["prompt_tokens"] += req.prompt_len

    def _allocate_running(self, chunks: list[tuple[SimRequest, int]]) -> bool:
        """kv_allocation="vllm": allocate the blocks this step computes for the running requests,
        in the order they were admitted; when one cannot grow, preempt the latest admitted
        (vLLM's FCFS policy), which may be itself. Returns whether any was preempted."""
        bs, cache = self.bs, self.cache
        wants = []
        for req in self.decoding:  # a decode computes the KV of its last sampled token
            need = -(-(req.prompt_len + req.generated) // bs) - len(req.held) - req.reserved
            if need > 0:
                wants.append((req.admission, need, req))
        for req, n in chunks:
            need = -(-(req.computed + n) // bs) - len(req.held) - req.reserved
            if need > 0:
                wants.append((req.admission, need, req))
        if not wants:
            return False
        wants.sort(key=lambda w: w[0])
        preempted: set[SimRequest] = set()
        for _order, need, req in wants:
            while req not in preempted:
                try:
                    cache.reserve(need)
                except CacheFull:
                    victim = max(self.prefilling + self.decoding, key=lambda r: r.admission)
                    self._preempt(victim, chunks)
                    preempted.add(victim)
                    continue
                req.reserved += need
                break
        return bool(preempted)

    def _preempt(self, req: SimRequest, chunks: list[tuple[SimRequest, int]]) -> None:
        """Back to the head of the queue, its blocks freed (tail first: they stay cached until
        evicted) and its KV to be computed again, the tokens it generated included."""
        if req in self.prefilling:
            self.prefilling.remove(req)
            chunks[:] = [(r, n) for r, n in chunks if r is not req]
        else:
            self.decoding.remove(req)
        self.cache.release(req.held)
        self.cache.unreserve(req.reserved)
        req.held, req.reserved = [], 0
        req.computed = 0
        req.preemptions += 1
        if req.generated:  # it recomputes its prompt and what it generated before its next token
            req.prefill_len = req.prompt_len + req.generated
            if self.cfg.emit_output_blocks:
                first_out = len(req.block_hashes)
                req.prefill_hashes = list(req.block_hashes) + [
                    self._output_block_hash(req, i)
                    for i in range(first_out, req.prefill_len // self.bs)
                ]
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)

    def _finish(self, req: SimRequest, t: float) -> None:
        req.finished = t
        if self.cache.host_inclusive:
            self.cache.host_finished(req.held)
        self.cache.release(req.held)
        if req.reserved:
            self.cache.unreserve(req.reserved)
            req.reserved = 0
        self.outputs.append(("finish", t, req))

    def abort(self, req: SimRequest, t: float) -> bool:
        """Stop a request wherever it is (client went away): its blocks are released (cached
        ones stay cached) and it finishes now. False if it is not here or already done."""
        if not math.isnan(req.finished):
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            req.finished = t
            req.rejected = "aborted"
            self.outputs.append(("finish", t, req))
            return True
        for group in (self.prefilling, self.decoding):
            if req in group:
                group.remove(req)
                req.rejected = "aborted"
                self._finish(req, max(t, self.now))
                return True
        return False

    def _generated_one(self, req: SimRequest, t: float) -> bool:
        """Bookkeeping after a token is sampled; returns True when the request finished."""
        req.generated += 1
        ctx = req.prompt_len + req.generated
        if ctx % self.bs == 0:  # a block just filled with output tokens
            # (kv_allocation="vllm" stores it in the next step, which computes the token's KV)
            if self.cfg.emit_output_blocks and not self.vllm_allocation:
                idx = ctx // self.bs - 1
                self._commit(req, [self._output_block_hash(req, idx)])
            self.outputs.append(("progress", t, req))
        if req.generated >= req.output_len:
            self._finish(req, t)
            return True
        return False

    def step(self) -> None:
        """Build, time and complete one iteration starting at ``self.now``."""
        model = self.model
        budget = self.cfg.max_batched_tokens - len(self.decoding)
        chunks: list[tuple[SimRequest, int]] = []
        reload_tokens = 0
        # vLLM caps a prompt's share of the step only when some other request could use the rest
        cap = self.cfg.long_prefill_token_threshold
        eligible = len(self.decoding) + len(self.prefilling) + len(self.waiting)
        if not cap or eligible <= 1:
            cap = budget
        elif self.cfg.long_prefill_token_threshold_adaptive:
            cap = max(cap, self.cfg.max_batched_tokens // eligible)
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prefill_len - req.computed, budget, cap)
            chunks.append((req, n))
            budget -= n
        # vLLM takes in no waiting request in a step that preempted one
        admitting = not (self.vllm_allocation and self._allocate_running(chunks))
        prefill_ms = 0.0
        for req, n in chunks:
            prefill_ms += model.prefill_ms(n, req.computed)
        while (
            admitting and budget > 0 and self.waiting and self.num_running < self.cfg.max_num_seqs
        ):
            req = self.waiting[0]
            if not self._admit(req):
                break  # head of line waits for blocks
            self.waiting.popleft()
            if math.isnan(req.admitted):
                req.admitted = self.now
            self.prefilling.append(req)
            n = min(req.prefill_len - req.computed, budget, cap)
            if self.vllm_allocation:  # the blocks of this step's chunk (the whole prompt fits)
                need = -(-(req.computed + n) // self.bs) - len(req.held) - req.reserved
                self.cache.reserve(need)
                req.reserved += need
            chunks.append((req, n))
            prefill_ms += model.prefill_ms(n, req.computed)
            reload_tokens += req.reload_tokens
            req.reload_tokens = 0
            budget -= n
        decoding = self.decoding
        n_decode = len(decoding)
        ctx = 0
        for req in decoding:
            ctx += req.prompt_len + req.generated
        dt = model.step_ms(prefill_ms, n_decode, ctx, model.reload_ms(reload_tokens)) / 1000.0
        t = self.now + dt
        self.now = t
        st = self.stats
        st["steps"] += 1
        st["busy_s"] += dt
        bs = self.bs
        # decoders first (they were running before this step's prefills)
        if n_decode:
            st["generated_tokens"] += n_decode
            done = False
            store_computed = self.vllm_allocation and self.cfg.emit_output_blocks
            for req in decoding:
                if store_computed and (req.prompt_len + req.generated) % bs == 0:
                    # vLLM stores a block once its last token's KV is computed: this step
                    idx = (req.prompt_len + req.generated) // bs - 1
                    self._commit(req, [self._output_block_hash(req, idx)])
                if self._generated_one(req, t):
                    done = True
            if done:
                self.decoding = [r for r in decoding if math.isnan(r.finished)]
        for req, n in chunks:
            before = req.computed
            req.computed += n
            st["prefill_tokens"] += n
            chain = req.prefill_hashes
            full_before = min(before // bs, len(chain))
            full_after = min(req.computed // bs, len(chain))
            if full_after > full_before:
                self._commit(req, list(chain[full_before:full_after]))
            if req.computed >= req.prefill_len:
                self.prefilling.remove(req)
                if not req.generated:  # (a preempted request had its first token already)
                    req.first_token = t
                    self.outputs.append(("first", t, req))
                st["generated_tokens"] += 1
                if not self._generated_one(req, t):
                    self.decoding.append(req)
        if self._pending_cache:
            self._flush_cache_events(t)

    def _steps_to_event(self) -> int:
        """Decode steps until some sequence finishes or fills a block (the last is eventful);
        with kv_allocation="vllm" also until one stores that block (the step after) or needs a
        new one (the step after that: it may evict or preempt)."""
        bs, vllm = self.bs, self.vllm_allocation
        k = 1 << 62
        for req in self.decoding:
            r = (req.prompt_len + req.generated) % bs  # of the tokens whose KV exists after a step
            k = min(k, req.output_len - req.generated, bs - r)
            if vllm:  # the step storing the filled block, and the one allocating the next
                k = min(k, (-r % bs) + 1, ((1 - r) % bs) + 1)
        return k

    def _fast_forward(self, t_until: float) -> bool:
        """Decode-only run: skip uneventful steps in closed form. Returns True if it moved."""
        k = self._steps_to_event() - 1  # the eventful step itself goes through step()
        if k <= 0:
            return False
        model = self.model
        b = len(self.decoding)
        ctx0 = sum(r.prompt_len + r.generated for r in self.decoding)
        a = (model.decode_only_ms(b) + model.decode_kv_ms(ctx0)) / 1000.0  # first step (s)
        d = model.decode_kv_ms(b) / 1000.0  # growth per step (s)
        # steps i = 0..k-1 start at now + i*a + d*i*(i-1)/2; run those starting before t_until
        span = t_until - self.now
        if span <= 0:
            return False
        if span == math.inf:
            n = k
        elif d <= 0:
            n = math.ceil(span / a)
        else:
            # largest real i with d/2 i^2 + (a - d/2) i - span < 0
            bq = a - d / 2
            root = (-bq + math.sqrt(bq * bq + 2 * d * span)) / d
            n = math.ceil(root)
        n = min(n, k)
        if n <= 0:
            return False
        dt = n * a + d * n * (n - 1) / 2
        self.now += dt
        for req in self.decoding:
            req.generated += n
        st = self.stats
        st["steps"] += n
        st["decode_runs"] += 1
        st["busy_s"] += dt
        st["generated_tokens"] += n * b
        return True

    def next_output_start(self) -> float:
        """Start of the next step that can report anything (a token, a block, a KV event, a
        finish) or change a gauge: ``now`` unless the engine is in a decode-only run, where the
        uneventful steps before it are skipped in closed form (as :meth:`_fast_forward` would).
        ``inf`` when idle. The replay advances an engine only when this is before an arrival."""
        if not self.has_work():
            return math.inf
        if not self.cfg.fast_forward or self.prefilling or not self.decoding or self._admissible():
            return self.now
        m = self._steps_to_event() - 1  # uneventful steps before the eventful one
        if m <= 0:
            return self.now
        model = self.model
        b = len(self.decoding)
        ctx0 = sum(r.prompt_len + r.generated for r in self.decoding)
        a = (model.decode_only_ms(b) + model.decode_kv_ms(ctx0)) / 1000.0
        d = model.decode_kv_ms(b) / 1000.0
        return self.now + m * a + d * m * (m - 1) / 2

    def advance(self, t_until: float) -> None:
        """Run every step that starts before ``t_until``."""
        while self.now < t_until and self.has_work():
            if (
                self.cfg.fast_forward
                and not self.prefilling
                and self.decoding
                and not self._admissible()
            ):
                if self._fast_forward(t_until):
                    continue
            self.step()

    def _admissible(self) -> bool:
        """Could the head of the waiting queue be admitted now (without side effects)?"""
        if not self.waiting or self.num_running >= self.cfg.max_num_seqs:
            return False
        req = self.waiting[0]
        if self.vllm_allocation:  # the whole prefill must fit
            chain = req.prefill_hashes
            need = -(-req.prefill_len // self.bs)
        else:
            chain = req.block_hashes
            need = -(-(req.prompt_len + req.output_len) // self.bs)
        # optimistic bound: cached prefix blocks need no new space
        return need - min(len(chain), self.cache.match_prefix(chain)[0]) <= self.cache.free

    def run_until_idle(self, limit: float = math.inf) -> None:
        while self.has_work() and self.now < limit:
            self.advance(limit)

"""Cache affinity with a work guard, on top of kv routing (policy ``affinity`` in the simulator).

kv routing (Dynamo's cost: ``prefill_scale * max(prefill - credit * overlap, 0) + decode``) moves a
follow-up request away from the engine holding its prefix whenever that engine's queue or active
KV is somewhat longer. Each move recomputes the prefix elsewhere (fleet work, a duplicate copy
that pushes other prefixes out), so kv stays short of what one shared LRU of the fleet's memory
would hit. Raising the credit does not fix it: past 1 the clamp at 0 makes every engine holding
most of the prompt cost the same prefill, and the decode term (active KV blocks, often hundreds)
decides.

This policy keeps kv's pick ``b`` unless another engine holds a longer prefix. Let ``a`` be the
engine with the longest cached prefix (ties: least work), and per engine

    wait = queued uncached prefill blocks + this prompt's uncached blocks
    work = wait + memory * active KV blocks

(the inputs kv's own cost uses, read from the router's preview). The request goes to ``a`` when
``a`` holds at least ``min_share`` of the prompt and

    work[a] - work[b] <= guard * (overlap[a] - overlap[b])   and   wait[a] - wait[b] <= cap

i.e. staying may cost up to ``guard`` times the prefill it saves the fleet, and never more than
``cap`` blocks of extra prefill ahead of the request (its TTFT); otherwise kv's pick stands (a hot
engine still sheds load). The saving
is counted more than once (``guard`` > 1) because a move also costs every later turn of the
conversation: the new engine starts with one copy, the old one keeps a stale one.

With ``tail`` > 0 the block ``cap`` gives way to a guard in seconds of predicted time to first
token. Per engine, ``ttft = queued prefill seconds + this prompt's prefill seconds`` from the
shipped prefill model (:class:`kvplug.prefill_model.CalibratedPrefillModel`), applied chunk by
chunk at the engine's token budget, because a long prompt's later chunks attend over its earlier
ones. The request goes to ``a`` only if

    ttft[a] <= max(ttft[b] + slack, tau)

where ``tau`` is the ``tail`` quantile of ``ttft[b]`` (kv's pick) over the last ``window``
decisions that had a choice: a request may wait for its cache as long as it stays out of the
latency tail kv would have, and never more than ``slack`` seconds beyond kv's pick otherwise.

Three options reach further (the named setting ``affinity-rescue`` in the simulator uses all
three; docs/sim.md has what each is worth). ``pool="all"`` takes ``tau`` over every routed
request's ``ttft[b]``: the latency tail is set by cold long prompts, which the choice pool never
sees. ``rescue`` sends a request whose predicted TTFT where it is going reaches ``tau`` to the
engine where it is predicted soonest (kv's cost counts blocks, not seconds). ``spread`` sends a
long cold prompt, among the engines no more loaded than kv's pick, to the one with the fewest
recent follow-ups, since its prefill blocks every session returning to its engine meanwhile.
``rescue_idle`` (the default's) rescues only to an engine with no prefill queued: a rescue to
a busy one adds its prefill (often a cached prefix recomputed) where others wait, to a fleet
already in its tail, and near saturation that feeds on itself.

Four more (the named setting ``affinity-soonest`` adds the first three to ``affinity-rescue``):
``read_ms`` makes the predictions count the decode reads of the engine's active sequences in
every step of a prefill (a long prompt's ten chunks each read the whole batch's KV);
``spread_by="ttft"`` sends a long cold prompt, among the engines where it is predicted to start
soonest, to the one with the fewest recent follow-ups; ``weigh_followups`` counts a follow-up
by its cached blocks (the long sessions are the ones that cannot move cheaply); ``protect``
keeps a request off an engine whose last queued prefill is predicted in the tail (the two
would share that prefill's last step).

Two more (third pass): ``protect_blocks`` is ``protect`` decided by what the move costs (the
blocks the request forgoes at the engine keeping most of its prefix) rather than by its first
chunk's seconds: even a short follow-up's chunk, sharing the last step of a cold prefill that
sits just under the latency tail, pushes it over. ``protect_below`` protects only prefills
predicted below that quantile (one above it is in the top of the tail whatever joins it).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from kvplug.prefill_fit import SPEED_MIN_SHARE, EngineSpeeds, OnlinePrefillFit, chunk_share
from kvplug.prefill_model import H200_LLAMA8B
from kvplug.request import RouteRequest

TAIL_POOLS = ("choice", "all", "cold")
# balance guard: an engine is crowded at no fewer than this many requests over the mean
BALANCE_MIN_EXCESS = 2.0
# balance guard: prefix ends remembered (where a prompt left the longest cached prefix) before
# the memory starts afresh; SHARED marks one that prompts have left in two different ways
BALANCE_MEMORY = 1 << 16
SHARED = -1
SPREAD_BY = ("followups", "ttft")


def _local_blocks(inputs) -> tuple[np.ndarray | None, list[float]]:
    """Per candidate, the prompt's cached blocks in the engine's own tiers (device, then host
    or disk continuing it): what the router books as the request's cached tokens, and what a
    prefill there skips. Device blocks alone would send a request with a host-tier hit away
    from it, or count the reload as a full prefill in the predictions. As an array (None below
    VECTOR_FROM candidates, where nothing reads it) and as a list (the same floats: a float64
    sum is one IEEE addition either way, in the same order; for a few candidates the list
    sums cost less than numpy's per-call overhead)."""
    device = np.asarray(inputs["device"], dtype=np.float64)
    tiers = [
        np.asarray(t, dtype=np.float64)
        for t in (inputs.get("host"), inputs.get("disk"))
        if t is not None
    ]
    if len(device) >= VECTOR_FROM:
        local = device
        for more in tiers:  # adding zeros keeps the floats; cheaper than asking np.any
            local = local + more
        return local, local.tolist()
    overlap = device.tolist()
    for more in tiers:
        overlap = [a + b for a, b in zip(overlap, more.tolist(), strict=True)]
    return None, overlap


@dataclass(frozen=True)
class AffinityParams:
    guard: float = 8.0  # extra work affinity may cost a request, x the prefix blocks it saves
    cap: float = 128.0  # ... and at most this many blocks of extra prefill wait
    memory: float = 0.25  # weight of active KV blocks (kv's decode term) in the work
    min_share: float = 0.1  # the longest cached prefix must cover this share of the prompt
    tail: float = 0.0  # > 0: the TTFT guard (quantile of kv's predicted TTFT) replaces the cap
    slack: float = 0.5  # seconds of predicted TTFT above kv's pick always allowed (tail mode)
    window: int = 2000  # decisions the tail quantile is taken over
    # tau is used once the pool holds this many samples above the tail quantile (window
    # permitting); before, only the slack lets a request wait for its cache. 10 is cautious
    # (500 decisions at tail 0.98, a router's first minutes); 1 trusts a shorter history
    warm: float = 10.0
    # whose predicted TTFT at kv's pick tau is the quantile of: "choice" (decisions where a
    # longer prefix was on offer), "all" (every routed request) or "cold" (requests no engine
    # holds min_share of: the population that sets the TTFT tail and no placement speeds up)
    pool: str = "choice"
    # > 0: a cold prompt (no engine holds min_share of it) whose predicted prefill at kv's pick
    # is at least this many seconds goes, among the engines with no more queued prefill than
    # kv's pick, to the one where the fewest follow-ups (requests with a cached prefix) were
    # routed recently: a long cold prefill blocks the engine's returning sessions while it runs
    spread: float = 0.0
    # seconds: decay of the per-engine follow-up rate (spread) and request rate (balance)
    half_life: float = 60.0
    # spread: ... and at most this many more active KV blocks than kv's pick (their reads slow
    # every step of the long prefill)
    spread_kv: float = 1e9
    # > 0 (tail mode): a request predicted to reach tau where it was going goes to the engine
    # where it is predicted soonest, if that is at least this many seconds sooner
    rescue: float = 0.0
    # True (with rescue): a rescue goes only to an engine with no prefill queued, one that
    # starts the request at once. A rescue to a busy engine adds its prefill (often a cached
    # prefix recomputed) where others wait: near saturation each one lengthens the queues, more
    # requests are then predicted in the tail and rescued, and the fleet recomputes its way
    # into overload (issue 14's forty-second pass: a load the fleet serves at a 6-7 s TTFT p99
    # keeping caches went to 830-2,400 s). Still falling over: letting it go to a busy engine
    # holding as much of the prompt (realistic view), and holding it only while more recent
    # requests than the tail's share are predicted in the tail (a few rescues start it). The
    # cost: a fleet of mixed speeds no longer sends its tail to faster engines with queues
    rescue_idle: bool = False
    # > 0 (tail mode, pool "all"): the saturation hold. When at least this share of the last
    # HOLD_WINDOW requests were predicted at or above tau at kv's pick (the tail's share is
    # 1 - tail, 2 %), the fleet is taken as saturated: every engine has a queue the tail does
    # not cover and tau lags it. Then no request is moved off the engine holding its longest
    # prefix for a shorter queue (the TTFT guard lets it wait there) and protect moves none:
    # each such move recomputes a cached prefix, the work the fleet lacks, and near saturation
    # those recomputes lengthen every queue until the fleet is in overload (issue 14's
    # forty-third pass: at 1.1 tool-loop sessions a second the default hit 59 % of the bound
    # and sglang-router's cache_aware, which moves a request only past its balance thresholds,
    # 82 %)
    hold_share: float = 0.0
    # with hold_share, while the fleet is saturated: a prompt's blocks in requests routed to an
    # engine and not finished (the router's active chains, ``--router-assume-kv-reuse``) count
    # as cached there, for kv's cost and for the holder. Near saturation a session's next turn
    # arrives while its last one still waits in an engine's queue; the engines' events have not
    # shown that turn's blocks yet, so the index sees a cold prompt, and kv's pick put 28.5 % of
    # the tool loops' follow-ups on another engine, recomputing their whole history (issue 14's
    # forty-fourth pass). Behind its own turn on the same engine it finds them computed, as
    # sglang-router's tree of routed text assumes. Not outside a spell: with short queues it
    # cost TTFT p99 (4.8 s against 2.6 s at 0.75 sessions a second) for no hits
    hold_inflight: bool = False
    # > 0: predicted TTFTs count the decode reads a prefill shares its steps with: every step
    # of a prompt's prefill also reads the KV of the engine's active sequences (this many ms
    # per 1,000 tokens of their context; 0.0305 = 128 KiB per token at ~4.3 TB/s, an 8B model
    # on one H200) and each of them takes one token of the step's budget
    read_ms: float = 0.0
    # spread: "followups" (the engine with the fewest recent follow-ups among those no more
    # loaded than kv's pick) or "ttft" (among the engines predicted to start the prompt within
    # spread_eps seconds of the soonest, the one with the fewest recent follow-ups)
    spread_by: str = "followups"
    spread_eps: float = 0.0
    # spread: a follow-up counts its cached prefix blocks (True) rather than 1 (False): the
    # sessions that hurt behind a long cold prefill are the long ones (their move recomputes)
    weigh_followups: bool = False
    # > 0 (tail mode): a request whose first chunk costs at least this many seconds does not
    # join an engine whose last queued prefill is predicted in the tail (>= tau): it would share
    # that prefill's last step and slow it; it goes where it is predicted soonest among the
    # other engines if it stays below tau there
    protect: float = 0.0
    # > 0 (tail mode): like protect, but any request may be kept off an engine whose last queued
    # prefill is predicted in the tail, if the engine it goes to instead (predicted below tau,
    # the longest prefix among those, then the soonest) holds at most this many fewer of its
    # blocks: a short follow-up's first chunk in that prefill's last step pushes it over the tail
    protect_blocks: float = 0.0
    # > 0: protect_blocks for a pick whose engine caps a prompt's share of a step (its worker's
    # long_prefill_token_threshold): there a follow-up shares every step of the prefill in the
    # tail, not only its last, and slows it by all of its own prefill; 0: protect_blocks
    protect_blocks_capped: float = 0.0
    # protect / protect_blocks: only a prefill predicted below this quantile of the tail pool is
    # protected (0: any in the tail): one predicted above it is in the top of the tail anyway
    protect_below: float = 0.0
    # > 0: the balance guard. A request whose longest cached prefix ends where earlier prompts
    # went on differently (a prefix other sessions share, e.g. a system prompt) does not follow
    # it to an engine that has recently been sent more requests than the fleet's mean plus
    # this share of it (and at least BALANCE_MIN_EXCESS more; rates decaying with
    # ``half_life``): kv's pick stands. A shared prefix must not pin every new session, and
    # with it all its later turns, to the engines that first ran it; replicating the prefix
    # costs one prefill per engine. A session's own history (a prefix no other prompt has left)
    # never moves for it, and a momentary queue is the TTFT guard's business
    balance: float = 0.0
    # > 0: the spread also weighs each candidate's cache churn, the prompt blocks recently
    # written to it (each routed request's uncached blocks, decayed with churn_half_life), at this
    # many times its follow-up rate (in blocks with weigh_followups): an engine that writes more
    # evicts sooner, so a long cold prompt there pushes out blocks the other caches would keep
    spread_churn: float = 0.0
    # > 0 (seconds): the spread counts a follow-up only once it is due back: its follow-up rate
    # is the half_life rate less one decaying with this shorter half-life, so a session that
    # has just had its turn (conversations come back tens of seconds to minutes later) weighs
    # little, and one whose turn was minutes ago weighs most (experimental; docs/sim.md)
    spread_lag: float = 0.0
    # > 0: the spread leaves out candidates whose recently written prompt blocks (as
    # spread_churn counts them) exceed the mean over the request's candidates by more than this
    # share of it: a cache that turns over faster than the others evicts what they would keep,
    # and sending it more long cold prompts makes that self-reinforcing
    churn_cap: float = 0.0
    # seconds (0: half_life): decay of the written blocks spread_churn and churn_cap weigh. A
    # cache's turnover is what fills it over its lifetime (minutes), longer than the memory
    # of follow-ups the spread needs
    churn_half_life: float = 0.0
    # the TTFT guard's prefill model, ms: per new token, per new token squared, per (new,
    # cached) token pair (ms = linear*n + quad*n^2 + ctx*n*cached, chunk by chunk). The
    # shipped fit is one H200 running an 8B model (kvplug.prefill_model); engines of another
    # speed or shape (no attention cost over the cached prefix, say) are better guarded by
    # their own fit
    prefill_linear_ms: float = H200_LLAMA8B[0]
    prefill_quad_ms: float = H200_LLAMA8B[1]
    prefill_ctx_ms: float = H200_LLAMA8B[2]
    # True: the three coefficients above are only the prior of a fit to the engines' own first
    # tokens (kvplug.prefill_fit: requests that prefilled alone, seen as they came), so the
    # guard predicts with the speed of the engines it routes to, not one H200's
    fit_prefill: bool = False
    # > 1 (with fit_prefill): each engine's prefill time relative to the fleet's is learnt from
    # the same first tokens (kvplug.prefill_fit.EngineSpeeds) and scales that engine's
    # predictions once it is more than this many times off: a fleet of different GPUs is not
    # predicted as one. 0: one model for every engine
    fit_speeds: float = 0.0

    def __post_init__(self) -> None:
        if not (self.guard >= 0 and self.cap >= 0 and self.memory >= 0 and self.slack >= 0):
            raise ValueError("affinity: guard, cap, memory and slack must be >= 0")
        if not 0 <= self.min_share <= 1:
            raise ValueError("affinity: min_share must be in [0, 1]")
        if not 0 <= self.protect_below < 1:
            raise ValueError("affinity: protect_below must be in [0, 1)")
        if not 0 <= self.tail < 1:
            raise ValueError("affinity: tail must be in [0, 1)")
        if self.window < 1:
            raise ValueError("affinity: window must be >= 1")
        if not self.warm > 0:
            raise ValueError("affinity: warm must be > 0")
        if self.rescue < 0:
            raise ValueError("affinity: rescue must be >= 0")
        if not 0 <= self.hold_share <= 1:
            raise ValueError("affinity: hold_share must be in [0, 1]")
        if self.hold_share and not (self.tail and self.pool == "all"):
            raise ValueError(
                "affinity: hold_share reads every request's prediction: set tail and pool=all"
            )
        if self.hold_inflight and not self.hold_share:
            raise ValueError("affinity: hold_inflight acts while the hold is on: set hold_share")
        if self.spread < 0 or self.half_life <= 0 or self.spread_kv < 0:
            raise ValueError("affinity: spread and spread_kv must be >= 0 and half_life > 0")
        if self.churn_half_life < 0:
            raise ValueError("affinity: churn_half_life must be >= 0")
        if not min(self.prefill_linear_ms, self.prefill_quad_ms, self.prefill_ctx_ms) >= 0:
            raise ValueError("affinity: prefill_linear_ms, prefill_quad_ms, prefill_ctx_ms >= 0")
        if not self.prefill_linear_ms + self.prefill_quad_ms > 0:
            raise ValueError("affinity: prefill_linear_ms or prefill_quad_ms must be > 0")
        if (
            min(
                self.read_ms,
                self.spread_eps,
                self.protect,
                self.protect_blocks,
                self.protect_blocks_capped,
            )
            < 0
            or min(self.balance, self.spread_churn, self.spread_lag, self.churn_cap) < 0
        ):
            raise ValueError(
                "affinity: read_ms, spread_eps, protect, protect_blocks, protect_blocks_capped, "
                "balance, spread_churn, spread_lag and churn_cap must be >= 0"
            )
        if not (self.fit_speeds == 0 or self.fit_speeds > 1):
            raise ValueError("affinity: fit_speeds must be 0 (off) or > 1")
        if self.fit_speeds and not self.fit_prefill:
            raise ValueError("affinity: fit_speeds learns from the prefill fit: set fit_prefill")
        if self.spread_by not in SPREAD_BY:
            raise ValueError(f"affinity: spread_by must be one of {', '.join(SPREAD_BY)}")
        if self.pool not in TAIL_POOLS:
            raise ValueError(f"affinity: pool must be one of {', '.join(TAIL_POOLS)}")


# the TTFT guard over every request's predicted TTFT, the tail rescue in place of the block
# guard, long cold prompts spread away from returning sessions (docs/sim.md)
_RESCUE: dict[str, Any] = {
    "tail": 0.98,
    "pool": "all",
    "window": 50000,
    "guard": 1000,
    "rescue": 0.1,
    "spread": 3,
    "half_life": 300,
    "spread_kv": 64,
}
# named settings, ``NAME[:key=value,...]`` (``--router-affinity``, the simulator's policies)
AFFINITY_PRESETS: dict[str, dict[str, Any]] = {
    "affinity": {},  # the block guard (guard, cap): no prefill model, no clock
    "affinity-rescue": _RESCUE,
    # affinity-rescue with predictions that count the decode reads sharing a prefill's steps,
    # long cold prompts sent where they start soonest, follow-ups weighed by their cached
    # blocks (docs/sim.md: the second pass)
    "affinity-soonest": {
        **_RESCUE,
        "read_ms": 0.0305,
        "spread_by": "ttft",
        "weigh_followups": True,
    },
}
# affinity-soonest keeping short follow-ups off the last step of a cold prefill just under the
# tail, with a shorter memory of follow-ups (docs/sim.md: the third pass's best setting)
AFFINITY_PRESETS["affinity-protect"] = {
    **AFFINITY_PRESETS["affinity-soonest"],
    "half_life": 120,
    "protect_blocks": 24,
    "protect_below": 0.99,
}
# affinity-protect with the balance guard: a prefix other sessions share (a system prompt, tool
# definitions) does not pin new sessions to an engine already sent half again its share of
# requests (docs/sim.md: issue 14's sixth pass; the default routing until its twenty-fourth)
AFFINITY_PRESETS["affinity-balance"] = {
    **AFFINITY_PRESETS["affinity-protect"],
    "balance": 0.5,
    # the tail taken after 50 decisions, not 500: until then only the 0.5 s slack lets a
    # follow-up wait for its cache, and the sessions scattered then stay scattered (issue 14's
    # seventh pass)
    "warm": 1,
    # a long cold prompt is not spread to an engine whose cache has been written a tenth more
    # than the fleet's mean over the last minutes: spreading by follow-ups alone sent cold
    # prompts to the same few engines, whose caches then turned over ~2x faster and evicted
    # documents read again minutes later (Mooncake's synthetic trace; issue 14's sixteenth
    # pass). Written blocks decay over 300 s, about a cache's lifetime there
    "churn_cap": 0.1,
    "churn_half_life": 300,
}
# affinity-balance predicting with a prefill model fitted to the engines' first tokens (issue
# 14's twenty-second pass; the default routing since its twenty-fourth: it meets the routing bar
# in more runs, docs/sim.md, *The default since issue 14's twenty-fourth pass*), each engine at
# its own speed once it is a tenth off the fleet's (issue 14's twenty-fifth pass: the estimates
# of engines that are alike stay within 1-6 % of the fleet's in replays, so there it routes as
# one model does; a fleet of mixed speeds is predicted engine by engine, docs/sim.md, *Mixed
# fleets*)
AFFINITY_PRESETS["affinity-fitted"] = {
    **AFFINITY_PRESETS["affinity-balance"],
    "fit_prefill": True,
    "fit_speeds": 1.1,
    # engines run with vLLM's --long-prefill-token-threshold let a follow-up start beside a
    # long prefill instead of behind it; sharing all its steps, it slows a prefill in the tail
    # more, so more follow-ups are kept off one (issue 14's twenty-seventh pass: on the
    # conversation trace, 13 of 16 runs meet the bar at 96 blocks, 6 at protect_blocks' 24)
    "protect_blocks_capped": 96,
    # the tail rescue sends a request only to an engine with no prefill queued (issue 14's
    # forty-second pass: near saturation the rescue recomputed the fleet into overload)
    "rescue_idle": True,
    # the saturation hold: once a tenth of the last 500 requests (5x the tail's share) were
    # predicted in the tail at kv's pick, nothing moves a request off its cache (issue 14's
    # forty-third pass: tool loops at 1.1 sessions a second hit 74-80 % of the bound, not
    # 59-64 %; a tenth did better than a quarter in 5 of the 7 runs tried, 0.9-1.25 sessions
    # a second on two draws)
    "hold_share": 0.1,
    # and while it holds, a prompt's blocks routed to an engine and not finished count as cached
    # there (issue 14's forty-fourth pass: the tool loops at 1.1 sessions a second hit 90 % of
    # the bound, not 74 %)
    "hold_inflight": True,
}
AFFINITY_KEYS = tuple(f.name for f in fields(AffinityParams))
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_affinity(text: str) -> AffinityParams:
    """``affinity-rescue:tail=0.97,spread=0`` -> AffinityParams (a named setting, then keys
    that change it); ValueError saying what is wrong otherwise."""
    name, _, rest = text.strip().partition(":")
    if name not in AFFINITY_PRESETS:
        raise ValueError(f"affinity setting {name!r} is not one of {', '.join(AFFINITY_PRESETS)}")
    values: dict[str, Any] = dict(AFFINITY_PRESETS[name])
    types = {f.name: type(getattr(AffinityParams(), f.name)) for f in fields(AffinityParams)}
    for term in filter(None, (t.strip() for t in rest.split(","))):
        key, sep, raw = (x.strip() for x in term.partition("="))
        key = key.replace("-", "_")
        if not sep or key not in types:
            raise ValueError(
                f"affinity {text!r}: {term!r} is not KEY=VALUE, KEY one of "
                f"{', '.join(AFFINITY_KEYS)}"
            )
        kind = types[key]
        try:
            if kind is bool:
                if raw.lower() not in _TRUE + _FALSE:
                    raise ValueError(raw)
                values[key] = raw.lower() in _TRUE
            else:
                values[key] = kind(raw)
        except ValueError:
            raise ValueError(
                f"affinity {text!r}: {key} takes a {kind.__name__}, not {raw!r}"
            ) from None
    return AffinityParams(**values)  # ValueError on a value out of range


def affinity_setting(params: AffinityParams) -> str:
    """The ``--router-affinity`` text that :func:`parse_affinity` reads back as ``params``:
    every field spelled out (``repr`` of a float reads back as the same float)."""
    terms = []
    for f in fields(AffinityParams):
        value = getattr(params, f.name)
        terms.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value!r}")
    return "affinity:" + ",".join(t.replace("'", "") for t in terms)


def chunked_prefill_seconds(
    new: float, cached: float, chunk: float, model: tuple[float, float, float] = H200_LLAMA8B
) -> float:
    """Predicted prefill time of ``new`` tokens over ``cached`` ones, computed in chunks of
    ``chunk`` tokens (0 = one pass): ``a*n + b*n^2 + c*n*context`` ms per chunk (``model``:
    (a, b, c), by default the shipped H200 fit), each chunk's context being the cached prefix
    plus the earlier chunks."""
    a, b, c = model
    n, p = max(float(new), 0.0), max(float(cached), 0.0)
    if n <= 0:
        return 0.0
    if chunk <= 0 or chunk >= n:
        return (a * n + b * n * n + c * n * p) / 1000.0
    full, rem = divmod(n, chunk)
    quad = full * chunk * chunk + rem * rem
    ctx = n * p + chunk * chunk * full * (full - 1) / 2 + rem * full * chunk
    return (a * n + b * quad + c * ctx) / 1000.0


# _predicted_ttft asks the compiled core for this many engines' predictions or more at once
# (kvplug._core.predicted_ttfts; one Python call per engine otherwise)
VECTOR_FROM = 8
# fit_prefill: the tail prompts a refit's effect on the tail is measured over
TAIL_PROMPTS = 256
# hold_share: the recent requests whose predictions at kv's pick tell a saturated fleet (a few
# hundred: longer than a burst the tail covers, short enough to see a fleet falling behind
# within a minute or two of requests)
HOLD_WINDOW = 500


class RecentQuantile:
    """Quantiles of the last ``window`` values added, kept sorted (``SortedList``: an update is
    two O(log n) steps, where ``np.quantile`` over a 50,000-value window costs most of a
    routing decision and a plain sorted list's shift ~6 us). Same result as ``np.quantile``
    (its linear method). Tried instead this round: only the tail kept sorted, over a max-heap of
    the rest (~1.5 us an update against ~4). With lazy deletions it stalled one decision every
    ~50,000 for an O(window) compaction (~60 ms); with the heap cut into blocks of adds and
    (value, seq) pairs it never compacts, but the pairs are objects the garbage collector
    tracks, and in kvplug serve the two measured within noise of each other."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._order: deque[float] = deque()
        self._sorted: SortedList = SortedList()
        self._asked: dict[float, float] = {}  # quantiles since the last add (asked repeatedly)

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float) -> None:
        value = float(value)
        self._order.append(value)
        self._sorted.add(value)
        if len(self._order) > self.window:
            self._sorted.remove(self._order.popleft())
        self._asked.clear()

    def extend(self, values) -> None:
        for v in values:
            self.add(v)

    def quantile(self, q: float) -> float:
        known = self._asked.get(q)
        if known is None:
            known = self._asked[q] = self._quantile(q)
        return known

    def _quantile(self, q: float) -> float:
        values, n = self._sorted, len(self._sorted)
        if not n:
            raise ValueError("no values")
        virtual = (n - 1) * q
        if virtual >= n - 1:
            return values[-1]
        lo = math.floor(virtual)
        a, b, gamma = values[lo], values[lo + 1], virtual - lo
        diff = b - a
        return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


class RescaledQuantile:
    """A window of TTFT predictions made with a prefill model that changes (``fit_prefill``):
    ``rescale(r)`` multiplies every value held by ``r`` at once, so the tail quantile compares
    with predictions made by the model now, not a mix of the models each was made with. Values
    are kept divided by the scale in force when added (one scale for the whole window: O(1)
    per rescale; a quantile's order is unchanged by it)."""

    __slots__ = ("_inner", "scale")

    def __init__(self, inner) -> None:
        self._inner = inner
        self.scale = 1.0

    def __len__(self) -> int:
        return len(self._inner)

    def add(self, value: float) -> None:
        self._inner.add(value / self.scale)

    def quantile(self, q: float) -> float:
        return self._inner.quantile(q) * self.scale

    def rescale(self, ratio: float) -> None:
        if ratio > 0 and math.isfinite(ratio):
            self.scale *= ratio


class PrefillSummaries:
    """Per endpoint, the router's requests in prefill summed (``Affinity._summarise``: seconds,
    steps, the oldest one's routing time and seconds, the latest routing time, seconds per
    prefill token), each kept while the load tracker's version of the endpoint's prefills and
    its chunk are the ones summarised. Arrays, so the compiled core reads many endpoints' in
    one call; an endpoint without prefills is summarised as (0, 0, inf, 0, -inf, 0), which
    predicts no queue."""

    __slots__ = (
        "version",
        "chunk",
        "seconds",
        "steps",
        "oldest_at",
        "oldest_seconds",
        "latest",
        "rate",
    )

    def __init__(self) -> None:
        self.version = np.zeros(0, dtype=np.int64)
        self.chunk = np.zeros(0)
        self.seconds = np.zeros(0)
        self.steps = np.zeros(0)
        self.oldest_at = np.zeros(0)
        self.oldest_seconds = np.zeros(0)
        self.latest = np.zeros(0)
        self.rate = np.zeros(0)

    def fit(self, n: int) -> None:
        """Room for endpoints below ``n``; a new one's version, -1, is never the tracker's."""
        if n <= len(self.version):
            return
        cap = max(n, 2 * len(self.version), 16)
        for name in self.__slots__:
            old = getattr(self, name)
            new = np.full(cap, -1 if name == "version" else 0, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def stale(self, load, ep: int, chunk: float) -> bool:
        if ep >= len(self.version):
            return True
        return (
            self.version.item(ep) != load.prefilling_versions.item(ep)
            or self.chunk.item(ep) != chunk
        )

    def store(self, ep: int, load, chunk: float, summary: tuple | None) -> None:
        """``summary`` (``Affinity._summarise``'s, or None: no prefills) for ``ep``."""
        self.fit(ep + 1)
        self.version[ep] = load.prefilling_versions.item(ep)
        self.chunk[ep] = chunk
        if summary is None:
            summary = (0.0, 0.0, math.inf, 0.0, -math.inf, 0.0)
        seconds, steps, oldest_at, oldest_seconds, latest, rate = summary
        self.seconds[ep] = seconds
        self.steps[ep] = steps
        self.oldest_at[ep] = oldest_at
        self.oldest_seconds[ep] = oldest_seconds
        self.latest[ep] = latest
        self.rate[ep] = rate


class Affinity:
    """The affinity decision over kv's pick, with what it remembers between decisions (the
    TTFT tail, the follow-up rates). ``choose`` is asked once per routed request: by
    :class:`kvplug.policies.affinity.AffinityPolicy` (``--router-mode affinity``, inside the
    router's pick stage) or by :class:`AffinityRouter` (a wrapper around a kv-mode router)."""

    def __init__(self, router, params: AffinityParams | None = None) -> None:
        self._router = router
        self.params = params or AffinityParams()
        p = self.params
        self._prefill_model = (p.prefill_linear_ms, p.prefill_quad_ms, p.prefill_ctx_ms)
        self._prefill_fit = OnlinePrefillFit(self._prefill_model) if p.fit_prefill else None
        # fit_speeds: each engine's step times over the fitted model's, per endpoint (1.0 past
        # the end); None: every engine runs at the model's speed
        self._speeds = EngineSpeeds(p.fit_speeds) if p.fit_speeds else None
        self._slowdowns: np.ndarray | None = None
        # kept_kv, affinity (moved), guarded; rescued, rescue_held (rescue_idle: only busy
        # engines were sooner), spread, protected once those fire
        self.affinity_counters: Counter[str] = Counter(kept_kv=0, affinity=0, guarded=0)
        if self._speeds is not None:  # engines whose predictions run at their own speed
            self.affinity_counters["engines_off_speed"] = 0
        core = getattr(router, "_core", None)
        # tail mode: the last ``window`` predicted TTFTs at kv's pick (of the pool's requests);
        # the compiled core's twin where it is built (the same floats)
        window = getattr(core, "SlidingQuantile", None) or RecentQuantile
        self._kv_ttft = window(self.params.window)
        # fit_prefill: the window's predictions are rescaled when the model is solved again
        # (RescaledQuantile), by what the change does to the prompts that make up the tail: the
        # (new, cached, chunk) of the latest predictions at kv's pick at or above tau
        self._tail_prompts: deque[tuple[float, float, float]] = deque(maxlen=TAIL_PROMPTS)
        self._rescaled: RescaledQuantile | None = None
        if self._prefill_fit is not None:
            self._kv_ttft = self._rescaled = RescaledQuantile(self._kv_ttft)
        # _tau: the samples the pool needs first (warm samples above the tail quantile, the
        # window permitting; "choice" as first measured: its pool fills slowly, and a warm-up
        # costs it hits)
        p = self.params
        self._tau_from = (
            1 if p.pool == "choice" else min(p.window, math.ceil(p.warm / (1 - p.tail)))
        )
        self._followups: dict[int, tuple[float, float]] = {}  # spread: endpoint -> (rate, at)
        # spread_lag: the same follow-ups, decayed with the shorter half-life (not yet due back)
        self._followups_lag: dict[int, tuple[float, float]] = {}
        # _queue_of in the decision under way (its trace): per endpoint, computed when asked
        self._queued_for: Any = None
        self._queue_memo: dict[int, tuple[float, float]] = {}
        self._queue_now = 0.0
        # _predicted_ttft of the decision under way, per candidate index
        self._ttft_for: Any = None
        self._ttft: dict[int, float] = {}
        self._all_for: Any = None  # _predicted_all of the decision under way
        self._all: list[float] = []
        # per endpoint, its prefills summed (_summarise), kept while router.load's version of
        # them and the chunk are those summarised: arrays, so a decision reads many at once
        self._summaries = PrefillSummaries()
        # the compiled core's (stale_prefill_summaries, predicted_ttfts); None: Python only
        stale = getattr(core, "stale_prefill_summaries", None)
        predicted = getattr(core, "predicted_ttfts", None)
        self._kernel: tuple[Any, Any] | None = (
            (stale, predicted) if stale is not None and predicted is not None else None
        )
        # balance guard: prefix end (the sequence hash of a cached prefix's last block) -> the
        # next block's hash of the first prompt that went on from there, or SHARED
        self._went_on: dict[int, int] = {}
        # balance guard: endpoint -> (decayed count of requests routed there, at), and the sum
        self._routed: dict[int, tuple[float, float]] = {}
        self._routed_sum = (0.0, 0.0)
        # spread_churn, churn_cap: endpoint -> (decayed count of prompt blocks written there, at)
        self._written: dict[int, tuple[float, float]] = {}
        # hold_share: whether each of the last HOLD_WINDOW requests was predicted at or above
        # tau at kv's pick, how many were, and whether that makes the fleet saturated
        self._recent_over: deque[bool] = deque(maxlen=HOLD_WINDOW)
        self._over_count = 0
        self._saturated = False

    def choose(self, trace, b: int, blocks: int, hashes=None) -> int | None:
        """The candidate (an index into ``trace``'s) this request goes to instead of kv's pick
        ``b``, or None to keep ``b``; ``blocks`` is the prompt's length in blocks, ``hashes``
        its full blocks' sequence hashes (the balance guard's; None: that guard stays off).
        Counted in ``affinity_counters``."""
        inputs = trace.inputs if trace is not None else None
        overlap: list[float] = []
        local = None
        if inputs and "device" in inputs and "prefill_blocks" in inputs:
            local, overlap = _local_blocks(inputs)
        if len(overlap) < 2:
            self.affinity_counters["kept_kv"] += 1
            return None
        pick = self._holder_pick(inputs, trace, local, overlap, blocks, b, hashes)
        if self.params.rescue and self.params.tail:
            pick = self._rescue(trace, overlap, blocks, b if pick is None else pick)
        if (
            self.params.protect or self.params.protect_blocks or self.params.protect_blocks_capped
        ) and self.params.tail:
            pick = self._protect(trace, overlap, blocks, b if pick is None else pick)
        final = b if pick is None else pick  # where the request goes
        if self.params.balance:
            self._count_routed(trace, final)
        if self.params.spread_churn or self.params.churn_cap:
            self._count_written(trace, final, blocks - overlap[final])
        if pick is None or pick == b:
            self.affinity_counters["kept_kv"] += 1
            return None
        self.affinity_counters["affinity"] += 1
        return pick

    def heard_first_token(self, request, now: float) -> None:
        """``fit_prefill``: a request that prefilled alone on its engine (``request.alone``)
        teaches the fit its prefill time; a new model replaces the predictions' and the
        prefill sums made with the old one."""
        fit = self._prefill_fit
        if fit is None or not request.alone or request.prefill_tokens <= 0:
            return
        new = float(request.prefill_tokens)
        ep = request.endpoint
        chunk = self._prefill_chunk(ep, request.others_inflight)
        # with read_ms the predictions add the decode reads sharing the prefill's steps
        # themselves: the fit must learn the prefill without them, or they count twice (the
        # engine's active sequences now, as a decision would read them)
        seconds = now - request.routed_at - self._read_seconds(ep, new, chunk)
        self.affinity_counters["prefill_samples"] += 1
        cached = request.prompt_tokens - new
        if self._speeds is not None:
            self._learn_speed(ep, new, cached, chunk, seconds)
        solved = fit.add(new, cached, chunk, seconds)
        # first tokens too fast for their prefill (a cache the router did not know of), counted
        # at the fit's floor: shown, as the fit keeps them
        self.affinity_counters["prefill_fast_samples"] = fit.fast_samples
        if solved:
            old, self._prefill_model = self._prefill_model, fit.model
            if self._rescaled is not None:
                self._rescaled.rescale(self._tail_ratio(old, fit.model))
            self._summaries = PrefillSummaries()  # every endpoint summed again when asked
            self.affinity_counters["prefill_fits"] += 1
            if self._speeds is not None:  # the fleet's mean moved: every engine's relative to it
                for other in self._speeds.endpoints():
                    self._set_slowdown(other, self._speeds.slowdown(other))

    def _prefill_chunk(self, ep: int, others: int) -> float:
        """The chunk ``ep`` prefills a prompt in, routed there with ``others`` of the router's
        requests in flight: its worker's ``max_num_batched_tokens``, or its long-prefill cap
        if that is less and others run beside it. The one rule for the predictions
        (``_predicted_ttft``) and the fit: fitted at the whole budget, a capped engine's extra
        steps were learnt as a slower model and predicted over again in the capped chunks."""
        router = self._router
        chunk = router.chunk_tokens(ep)
        if others > 0:
            cap = router.long_prefill_tokens(ep, others)
            if cap > 0:
                chunk = min(chunk, cap) if chunk > 0 else cap
        return chunk

    def _learn_speed(
        self, ep: int, new: float, cached: float, chunk: float, seconds: float
    ) -> None:
        """``fit_speeds``: one first token of ``ep`` against the model's prediction, weighed as
        the fit weighs it; the engine's slowdown follows. A prompt under a quarter of a chunk
        is left out: its first token is timed by the step it joins, and at under 1/16 of a
        sample's weight it would cost a chat workload's every first token for next to nothing."""
        assert self._speeds is not None
        share = chunk_share(new, chunk)
        if share < SPEED_MIN_SHARE:
            return
        predicted = chunked_prefill_seconds(new, cached, chunk, self._prefill_model)
        self._speeds.add(ep, seconds, predicted, min(1.0, share) ** 2)
        self._set_slowdown(ep, self._speeds.slowdown(ep))

    def _set_slowdown(self, ep: int, factor: float) -> None:
        """``ep``'s predictions from now on at ``factor`` times the model's (``_slow``)."""
        table = self._slowdowns
        if table is None or ep >= len(table):
            if factor == 1.0:
                return  # what an endpoint past the table's end has
            grown = np.ones(max(ep + 1, 2 * (0 if table is None else len(table)), 16))
            if table is not None:
                grown[: len(table)] = table
            self._slowdowns = table = grown
        old = table.item(ep)
        if old != factor:
            table[ep] = factor
            if (old == 1.0) != (factor == 1.0):  # an engine joins or leaves those off speed
                self.affinity_counters["engines_off_speed"] += 1 if old == 1.0 else -1

    def _slow(self, ep: int) -> float:
        """``ep``'s step times over the prefill model's (``fit_speeds``; else 1.0)."""
        table = self._slowdowns
        return table.item(ep) if table is not None and ep < len(table) else 1.0

    def _tail_ratio(self, old: tuple, new: tuple) -> float:
        """What replacing the prefill model ``old`` by ``new`` does to the tail's predictions:
        the tail prompts' own prefills summed under each (1.0 before any is known)."""
        before = after = 0.0
        for n, cached, chunk in self._tail_prompts:
            before += chunked_prefill_seconds(n, cached, chunk, old)
            after += chunked_prefill_seconds(n, cached, chunk, new)
        return after / before if before > 0 else 1.0

    def _remember_tail_prompt(self, trace, overlap, blocks: int, b: int, t_b: float) -> None:
        """``fit_prefill``: keep kv's pick's prompt (its new and cached tokens, the chunk) if its
        prediction is in the tail (every one while there is no tau yet)."""
        tau = self._tau()
        if t_b >= tau:
            router = self._router
            cached = float(overlap[b]) * router.block_size
            new = blocks * router.block_size - cached
            ep = int(trace.endpoints[b])
            self._tail_prompts.append(
                (new, cached, self._prefill_chunk(ep, router.load.inflight.item(ep)))
            )

    def _protect(self, trace, overlap: Sequence[float], blocks: int, pick: int) -> int:
        """Protect mode: if ``pick``'s last queued prefill is predicted in the tail (its elapsed
        wait plus what is queued up to it reaches tau), this request's first chunk would share
        that prefill's last step and slow it: the engine where it is predicted soonest among
        those with no prefill in the tail instead, if it stays below tau there."""
        tau = self._tau() if self._kv_ttft else 0.0
        if not tau:
            return pick
        router = self._router
        n = len(overlap)
        pick_ep = int(trace.endpoints[pick])
        at_pick = self._queue_of(trace, pick_ep)[1]
        if at_pick < tau:
            return pick  # the common case: no engine's prediction is needed
        if self._saturated:
            self.affinity_counters["protect_held"] += 1
            return pick  # hold_share: a move recomputes, and every engine has a queue
        if self.params.protect_below:
            if at_pick >= self._kv_ttft.quantile(self.params.protect_below):
                return pick
        limit = self.params.protect_blocks
        if self.params.protect_blocks_capped and router.long_prefill_tokens(pick_ep) > 0:
            limit = self.params.protect_blocks_capped
        if not limit and not self.params.protect:
            return pick  # only protect_blocks_capped is set, and this engine has no cap
        t = self._predicted_all(trace, overlap, blocks)
        eps = trace.endpoints.tolist()
        prefilling = router.load.prefilling  # an engine without prefills has none in the tail
        others = [
            i
            for i in range(n)
            if eps[i] not in prefilling or self._queue_of(trace, eps[i])[1] < tau
        ]
        if limit:
            safe = [i for i in others if t[i] < tau]
            if not safe:
                return pick
            alt = max(safe, key=lambda i: (overlap[i], -t[i]))
            if overlap[pick] - overlap[alt] > limit:
                return pick
            self.affinity_counters["protected"] += 1
            return alt
        bs = router.block_size
        chunk = router.chunk_tokens(eps[pick])
        cached = float(overlap[pick]) * bs
        new = blocks * bs - cached
        first = chunked_prefill_seconds(
            min(new, chunk) if chunk > 0 else new, cached, 0.0, self._prefill_model
        ) * self._slow(eps[pick])
        if first < self.params.protect:
            return pick
        if not others:
            return pick
        alt = min(others, key=lambda i: t[i])
        if t[alt] >= tau:
            return pick
        self.affinity_counters["protected"] += 1
        return alt

    def _holder_pick(
        self,
        inputs,
        trace,
        local: np.ndarray | None,
        overlap: Sequence[float],
        blocks: int,
        b: int,
        hashes=None,
    ) -> int | None:
        """The engine holding the longest prefix if the guards let the request wait for it
        there, a cold prompt's spread pick, else None (kv's pick ``b``). ``local`` is each
        candidate's cached blocks (``_local_blocks``), ``overlap`` the same as a list."""
        params = self.params
        best = float(max(overlap))
        cold = best < params.min_share * max(blocks, 1)
        if params.tail and (params.pool == "all" or (params.pool == "cold" and cold)):
            t_b = self._predicted_ttft(trace, overlap, blocks, b)
            if params.hold_share:
                self._note_saturation(t_b[0])
            if self._prefill_fit is not None:
                self._remember_tail_prompt(trace, overlap, blocks, b, t_b[0])
            self._remember(t_b)
        if cold:
            return self._spread_pick(inputs, trace, overlap, blocks, b)
        if best <= overlap[b]:
            self._count_followup(trace, b, overlap[b])
            return None
        # waits and work of the holders and kv's pick only (not of every candidate: at 512
        # engines the per-candidate lists cost most of the decision), the same floats
        prefill = np.asarray(inputs["prefill_blocks"], dtype=np.float64)
        decode = np.asarray(inputs["decode_blocks"], np.float64) if params.memory else None
        if local is not None:  # VECTOR_FROM candidates or more
            holders = np.flatnonzero(local == best).tolist()
        else:
            holders = [i for i, o in enumerate(overlap) if o == best]
        wait: dict[int, float] = {}
        work: dict[int, float] = {}
        for i in (*holders, b):
            wait[i] = prefill.item(i) - overlap[i]
            work[i] = wait[i] if decode is None else wait[i] + params.memory * decode.item(i)
        a = min(holders, key=work.__getitem__)  # the first of equals, as argmin
        if (
            params.balance
            and hashes is not None
            and self._shared_end(hashes, int(best))
            and self._crowded(trace, a)
        ):
            self.affinity_counters["balanced"] += 1
            self._count_followup(trace, b, overlap[b])
            return None
        if work[a] - work[b] > params.guard * (overlap[a] - overlap[b]) or (
            not params.tail and wait[a] - wait[b] > params.cap
        ):
            self.affinity_counters["guarded"] += 1
            self._count_followup(trace, b, overlap[b])
            return None
        if params.tail and not self._within_tail(trace, overlap, blocks, a, b):
            self.affinity_counters["guarded"] += 1
            self._count_followup(trace, b, overlap[b])
            return None
        self._count_followup(trace, a, overlap[a])
        return a

    def _shared_end(self, hashes, best: int) -> bool:
        """Balance guard: did earlier prompts leave this prompt's longest cached prefix (its
        first ``best`` blocks) in two different ways? Remembers how this one leaves it."""
        if best <= 0 or best >= len(hashes):
            return False
        end, went_on = int(hashes[best - 1]), int(hashes[best])
        memory = self._went_on
        before = memory.get(end)
        if before is None:
            if len(memory) >= BALANCE_MEMORY:
                memory.clear()  # start afresh: shared prefixes show again within two prompts
            memory[end] = went_on
            return False
        if before != went_on:  # a second way on (or a later one): other sessions share it
            memory[end] = SHARED
            return True
        return False

    def _decayed(self, value: tuple[float, float], now: float, half_life: float = 0.0) -> float:
        """A (count, at) pair decayed to ``now`` with ``half_life`` (0: the params'): the
        follow-up rates (spread; spread_lag's with its own), the request counts (balance) and
        the written blocks (spread_churn, churn_cap; with churn_half_life)."""
        count, at = value
        return count * 0.5 ** ((now - at) / (half_life or self.params.half_life))

    def _rate(
        self, table: dict[int, tuple[float, float]], ep: int, now: float, half_life: float = 0.0
    ) -> float:
        """``ep``'s decayed count in one of the per-engine tables (0 if never counted)."""
        return self._decayed(table.get(ep, (0.0, now)), now, half_life)

    def _add(
        self,
        table: dict[int, tuple[float, float]],
        ep: int,
        amount: float,
        now: float,
        half_life: float = 0.0,
    ) -> None:
        table[ep] = (self._rate(table, ep, now, half_life) + amount, now)

    def _count_routed(self, trace, i: int) -> None:
        now = self._router._clock()
        self._add(self._routed, int(trace.endpoints[i]), 1.0, now)
        self._routed_sum = (self._decayed(self._routed_sum, now) + 1.0, now)

    def _count_written(self, trace, i: int, blocks: float) -> None:
        now = self._router._clock()
        self._add(self._written, int(trace.endpoints[i]), blocks, now, self.params.churn_half_life)

    def _not_churning(self, eps: list[int], candidates: list[int], now: float) -> list[int]:
        """churn_cap: the candidates whose caches have been written no more than the
        ``churn_cap`` share above the mean over every candidate of the request (``eps``, the
        engines its filters left: removed engines and other models' do not count)."""
        hl = self.params.churn_half_life
        written = [self._rate(self._written, ep, now, hl) for ep in eps]
        limit = sum(written) / len(written) * (1.0 + self.params.churn_cap)
        return [i for i in candidates if written[i] <= limit]

    def _crowded(self, trace, i: int) -> bool:
        """Balance guard: has candidate ``i`` been sent more requests recently than the fleet's
        mean per candidate by the ``balance`` share of it, and by at least BALANCE_MIN_EXCESS?"""
        now = self._router._clock()
        mean = self._decayed(self._routed_sum, now) / len(trace.endpoints)
        mine = self._rate(self._routed, int(trace.endpoints[i]), now)
        return mine > mean + max(BALANCE_MIN_EXCESS, self.params.balance * mean)

    def _rescue(self, trace, overlap: Sequence[float], blocks: int, pick: int) -> int:
        """Rescue mode: if the request's predicted TTFT at ``pick`` reaches tau (the latency
        tail), the engine where it is predicted soonest instead."""
        if not self._kv_ttft:
            return pick
        tau = self._tau()
        if not tau:
            return pick
        if self._predicted_ttft(trace, overlap, blocks, pick)[0] < tau:
            return pick  # the common case: the other engines' predictions are not needed
        t = self._predicted_all(trace, overlap, blocks)
        best = self._soonest(t, pick)
        if t[best] >= t[pick] - self.params.rescue:
            return pick
        if self.params.rescue_idle and not self._idle(trace, best):
            allowed = [
                x if i == pick or self._idle(trace, i) else math.inf for i, x in enumerate(t)
            ]
            best = self._soonest(allowed, pick)
            if allowed[best] >= t[pick] - self.params.rescue:
                self.affinity_counters["rescue_held"] += 1
                return pick
        self.affinity_counters["rescued"] += 1
        return best

    @staticmethod
    def _soonest(t: list[float], pick: int) -> int:
        """The first of equals, kv's pick first: argmin over [pick, the others in order]."""
        soonest = min(t)
        return pick if t[pick] == soonest else t.index(soonest)

    def _idle(self, trace, i: int) -> bool:
        """``rescue_idle``: whether candidate ``i`` has no prefill queued (it would start the
        request at once)."""
        ep = int(trace.endpoints[i])
        return ep not in self._router.load.prefilling or self._queue_of(trace, ep)[0] <= 0

    def _tau(self) -> float:
        """The ``tail`` quantile of the remembered TTFT predictions at kv's pick (0 = none
        yet: a quantile of a handful of samples is their maximum, so none until the tail has
        ``warm`` samples above it or the window is full)."""
        history = self._kv_ttft
        return history.quantile(self.params.tail) if len(history) >= self._tau_from else 0.0

    def _count_followup(self, trace, i: int, blocks: float = 1.0) -> None:
        if not self.params.spread:
            return
        weight = blocks if self.params.weigh_followups else 1.0
        ep, now = int(trace.endpoints[i]), self._router._clock()
        self._add(self._followups, ep, weight, now)
        if self.params.spread_lag:
            self._add(self._followups_lag, ep, weight, now, self.params.spread_lag)

    def _spread_pick(
        self, inputs, trace, overlap: Sequence[float], blocks: int, b: int
    ) -> int | None:
        """A long cold prompt: among the candidate engines (``spread_by="followups"``: no more
        queued prefill than kv's pick and at most ``spread_kv`` more active KV blocks;
        ``"ttft"``: predicted to start it within ``spread_eps`` seconds of the soonest), the one
        with the fewest recent follow-ups, plus ``spread_churn`` times its recently written
        blocks; with ``churn_cap``, only among those whose caches do not turn over faster than
        the fleet's by more than that share (None: kv's pick stands, ties included)."""
        params = self.params
        if not params.spread:
            return None
        router = self._router
        n = len(overlap)
        chunk = router.chunk_tokens(int(trace.endpoints[b]))
        cached = float(overlap[b]) * router.block_size
        own = chunked_prefill_seconds(
            blocks * router.block_size - cached, cached, chunk, self._prefill_model
        ) * self._slow(int(trace.endpoints[b]))
        if own < params.spread:
            return None
        eps = trace.endpoints.tolist()
        if params.spread_by == "ttft":
            t = self._predicted_all(trace, overlap, blocks)
            soonest = min(t) + params.spread_eps + 1e-9
            candidates = [i for i in range(n) if t[i] <= soonest]
        else:
            limit = self._queue_of(trace, eps[b])[0] + 1e-9
            decode = np.asarray(inputs["decode_blocks"], dtype=np.float64)
            decode_limit = decode[b] + params.spread_kv
            candidates = [
                i
                for i in range(n)
                if self._queue_of(trace, eps[i])[0] <= limit and decode[i] <= decode_limit
            ]
        now = router._clock()
        if params.churn_cap:
            candidates = self._not_churning(eps, candidates, now)
        if b in candidates:
            candidates.insert(0, b)  # min() keeps the first of equals: a tie keeps kv's pick
        elif not candidates:
            # every engine where it starts soonest turns over fast: the spread has nowhere
            # better to send it, and kv's pick stands as it does without the spread
            return None
        churn, followups, written = params.spread_churn, self._followups, self._written
        churn_hl = params.churn_half_life
        lagged = self._followups_lag
        best = min(
            candidates,
            key=lambda i: (
                self._rate(followups, eps[i], now)
                - (self._rate(lagged, eps[i], now, params.spread_lag) if params.spread_lag else 0.0)
                + (churn * self._rate(written, eps[i], now, churn_hl) if churn else 0.0)
            ),
        )
        if best == b:
            return None
        self.affinity_counters["spread"] += 1
        return best

    def _predicted_ttft(
        self, trace, overlap: Sequence[float], blocks: int, *idx: int
    ) -> list[float]:
        """Predicted TTFT of this prompt on each engine of ``idx`` (indices into the preview):
        its queued prefill seconds plus its own chunked prefill over its cached prefix (with
        ``read_ms``: plus the decode reads of the engine's active sequences in its steps).
        Each engine's is computed once per decision (``trace``), however many stages ask."""
        if self._ttft_for is not trace:
            self._ttft_for = trace
            self._ttft = {}
        known = self._ttft
        missing = [i for i in idx if i not in known]
        if len(missing) >= VECTOR_FROM and self._kernel is not None:
            vector = self._predicted_many(trace, overlap, blocks, missing)
            known.update(zip(missing, vector, strict=True))
        elif missing:
            router = self._router
            bs = router.block_size
            n = blocks * bs
            for i in missing:
                ep = int(trace.endpoints[i])
                cached = float(overlap[i]) * bs
                inflight = router.load.inflight.item(ep)
                chunk = self._prefill_chunk(ep, inflight)
                slow = self._slow(ep)
                queued = self._queue_of(trace, ep)[0]
                if queued > 0 and inflight > 0:
                    # the engine caps every prompt's share of a step (vLLM's
                    # --long-prefill-token-threshold): this one starts at once, in chunks of at
                    # most cap, and waits only for what the others compute beside it: at most
                    # cap tokens of each of them in each of its steps (_shared_seconds)
                    cap = router.long_prefill_tokens(ep, inflight)
                    if cap > 0:
                        queued = min(queued, self._shared_seconds(ep, n - cached, cap) * slow)
                own = chunked_prefill_seconds(n - cached, cached, chunk, self._prefill_model) * slow
                known[i] = queued + own + self._read_seconds(ep, n - cached, chunk) * slow
        return [known[i] for i in idx]

    def _shared_seconds(self, ep: int, new: float, cap: float) -> float:
        """Predicted seconds of ``ep``'s other prefills computed in the steps of a ``new``-token
        prompt there, each prompt taking at most ``cap`` tokens a step: each one's seconds per
        token (summed in the summary's ``rate``) times those steps' share, ``cap`` tokens a
        step. A prefill shorter than that share counts more than its whole time here; the
        caller takes the queue's whole prediction where it is less."""
        return math.ceil(new / cap) * cap * self._summaries.rate.item(ep)

    def _predicted_all(self, trace, overlap, blocks: int) -> list[float]:
        """``_predicted_ttft`` of every candidate, in their order (the same floats)."""
        if self._all_for is not trace:
            n = len(overlap)
            if n >= VECTOR_FROM and self._kernel is not None:
                self._all = self._predicted_many(trace, overlap, blocks, None)
            else:
                self._all = self._predicted_ttft(trace, overlap, blocks, *range(n))
            self._all_for = trace
        return self._all

    def _predicted_many(self, trace, overlap, blocks: int, idx: list[int] | None) -> list[float]:
        """``_predicted_ttft``'s loop for many engines at once, in the compiled core: the same
        operations in the same order on doubles, so the same floats (tests/test_affinity.py
        checks it). ``idx``: candidate indices (None: every candidate)."""
        router = self._router
        load = router.load
        now = self._queue_clock(trace)
        summaries = self._summaries
        summaries.fit(len(load.prefilling_versions))
        assert self._kernel is not None  # the callers' condition
        stale, predicted = self._kernel
        for ep, chunk in stale(
            trace.endpoints, idx, router.max_batched, summaries, load.prefilling_versions
        ):
            self._resummarise(ep, chunk)
        return predicted(
            trace.endpoints,
            idx,
            overlap,
            float(blocks * router.block_size),
            float(router.block_size),
            router.max_batched,
            summaries,
            load.inflight,
            load.context_tokens,
            now,
            self.params.read_ms,
            self._prefill_model,
            self._slowdowns,
            router.long_prefill_now(),
        )

    def _read_seconds(self, ep: int, new: float, chunk: float) -> float:
        """``read_ms``: seconds of decode reads over the steps of a ``new``-token prefill on
        ``ep`` (its active sequences' context read once per step)."""
        if not self.params.read_ms or new <= 0:
            return 0.0
        count, context = self._context(ep)
        steps = 1.0 if chunk <= 0 else math.ceil(new / max(chunk - count, 1.0))
        return steps * self.params.read_ms * context / 1e6

    def _context(self, ep: int) -> tuple[int, float]:
        """``ep``'s active sequences and their context tokens (prompts and outputs so far)."""
        load = self._router.load
        return load.inflight.item(ep), float(load.context_tokens.item(ep))

    def _remember(self, t_b: list[float]) -> None:
        self._kv_ttft.add(t_b[0])

    def _within_tail(self, trace, overlap: Sequence[float], blocks: int, a: int, b: int) -> bool:
        """Tail mode: is ``a``'s predicted TTFT within ``max(kv's + slack, tau)``?"""
        if self._saturated:
            self.affinity_counters["held_saturated"] += 1
            return True  # hold_share (pool "all": nothing to remember): the holder stands
        t_a, t_b = self._predicted_ttft(trace, overlap, blocks, a, b)
        if self.params.pool == "choice":
            self._remember([t_b])
        return t_a <= max(t_b + self.params.slack, self._tau())

    def _note_saturation(self, t_b: float) -> None:
        """hold_share: count whether kv's pick's predicted TTFT ``t_b`` reaches tau, and
        whether the last HOLD_WINDOW requests' did often enough to call the fleet saturated."""
        tau = self._tau()
        over = bool(tau) and t_b >= tau
        recent = self._recent_over
        if len(recent) == HOLD_WINDOW:
            self._over_count -= recent[0]  # the append below drops it (maxlen)
        recent.append(over)
        self._over_count += over
        saturated = (
            len(recent) == HOLD_WINDOW and self._over_count >= self.params.hold_share * HOLD_WINDOW
        )
        if saturated != self._saturated:
            self.affinity_counters["saturated_spells" if saturated else "saturated_ends"] += 1
            self._saturated = saturated

    def inflight_as_held(self, device, shared, active_depth):
        """hold_inflight: ``(device, shared_beyond)`` with each candidate's blocks of the prompt
        in its requests in flight (``active_depth``) counted as device blocks, while the fleet
        is saturated (as of the decisions before this one); None otherwise or when no
        candidate gains a block."""
        if not self._saturated or active_depth is None or device is None:
            return None
        held = np.maximum(device, active_depth)
        extra = held - device
        if not extra.any():
            return None
        self.affinity_counters["inflight_held"] += 1
        return held, np.maximum(shared - extra, 0.0)

    def _queue_of(self, trace, ep: int) -> tuple[float, float]:
        """Endpoint ``ep``'s predicted seconds of prefill still queued (requests routed there
        without a first token yet, the oldest one's elapsed time taken off; with ``read_ms``
        the decode reads in their steps too) and the last queued prefill's predicted TTFT
        (protect); (0.0, 0.0) without prefills. Computed for the endpoints a decision asks
        about, once each, at one ``now`` per decision (``trace``): most decisions ask about kv's
        pick and one or two others, not every endpoint with prefills."""
        now = self._queue_clock(trace)
        memo = self._queue_memo
        known = memo.get(ep)
        if known is None:
            known = memo[ep] = self._endpoint_queue(ep, now)
        return known

    def _queue_clock(self, trace) -> float:
        """The one ``now`` of the decision under way (``trace``) the queues are taken at."""
        if self._queued_for is not trace:
            self._queued_for = trace
            self._queue_memo = {}
            self._queue_now = self._router._clock()
        return self._queue_now

    def _endpoint_queue(self, ep: int, now: float) -> tuple[float, float]:
        """``_queue_of`` computed: the endpoint's prefills are summed once per change of them
        (``_summarise``); the elapsed time and decode reads are applied at ``now``."""
        router = self._router
        load = router.load
        if ep not in load.prefilling:
            return 0.0, 0.0
        chunk = router.chunk_tokens(ep)
        s = self._summaries
        if s.stale(load, ep, chunk):
            self._resummarise(ep, chunk)
        seconds_sum = s.seconds.item(ep)
        read_ms = self.params.read_ms
        if read_ms:
            seconds_sum += s.steps.item(ep) * read_ms * float(load.context_tokens.item(ep)) / 1e6
        slow = self._slow(ep)  # fit_speeds: summed at the model's speed, taken at the engine's
        seconds_sum = seconds_sum * slow
        # the oldest has been in prefill for part of its predicted time already
        elapsed = min(max(now - s.oldest_at.item(ep), 0.0), s.oldest_seconds.item(ep) * slow)
        seconds_sum = max(seconds_sum - elapsed, 0.0)
        # and the last queued prefill's predicted TTFT (protect)
        return seconds_sum, seconds_sum + now - s.latest.item(ep)

    def _resummarise(self, ep: int, chunk: float) -> None:
        """Sum ``ep``'s prefills again (at ``chunk``) into the summaries."""
        load = self._router.load
        queued = load.prefilling.get(ep)
        summary = None if queued is None else self._summarise(queued, chunk, self._prefill_model)
        self._summaries.store(ep, load, chunk, summary)

    @staticmethod
    def _summarise(
        queued: dict, chunk: float, model: tuple[float, float, float]
    ) -> tuple[float, float, float, float, float, float]:
        """An endpoint's requests in prefill, summed in their routing order: predicted
        seconds, steps, the oldest one's routing time and seconds, the latest routing time,
        and the sum of their predicted seconds per prefill token (an engine capping a prompt's
        share of a step computes that much of them per token of each prompt's share).
        Kept per endpoint until its requests in prefill change (``prefilling_version``)."""
        seconds_sum = steps = rate = 0.0
        oldest_at, oldest_seconds = math.inf, 0.0
        latest = -math.inf
        for r in queued.values():
            estimate = r.prefill_estimate
            # keyed by the chunk and the prefill model: two guards over one router's requests
            # (different prefill models) must not read each other's estimates
            if estimate is None or estimate[0] != chunk or estimate[3] != model:
                prefill = r.prefill_tokens
                estimate = r.prefill_estimate = (
                    chunk,
                    chunked_prefill_seconds(prefill, r.prompt_tokens - prefill, chunk, model),
                    1.0 if chunk <= 0 else math.ceil(prefill / chunk),
                    model,
                )
            seconds = estimate[1]
            steps += estimate[2]
            seconds_sum += seconds
            if r.prefill_tokens > 0:
                rate += seconds / r.prefill_tokens
            at = r.routed_at
            if at > latest:
                latest = at
            if at < oldest_at:
                oldest_at, oldest_seconds = at, seconds
        return seconds_sum, steps, oldest_at, oldest_seconds, latest, rate


class AffinityRouter(Affinity):
    """Wraps a kv-mode :class:`kvplug.router.Router`: same interface, affinity-guarded picks.
    A pick that differs from kv's is booked through the router as a pinned route, so load
    tracking, dedup and decisions stay the router's. (``--router-mode affinity`` makes the
    same choice inside the router's pick stage, in one pass.)"""

    def __init__(self, router, params: AffinityParams | None = None) -> None:
        if router.config.router_mode != "kv":
            raise ValueError("the affinity policy wraps a kv-mode router")
        if params is not None and params.hold_inflight:
            # it changes kv's scores, which the wrapper reads from a preview
            raise ValueError("hold_inflight needs --router-mode affinity, not the wrapper")
        super().__init__(router, params)

    def __getattr__(self, name: str) -> Any:  # everything else is the router's
        return getattr(self._router, name)

    def route(self, req: RouteRequest):
        router = self._router
        if not req.hints.is_empty() or req.exclude_workers:
            return router.route(req)  # the caller constrains placement: kv as is
        preview = router.preview(req)
        pick = self.choose(preview.trace, int(preview.chosen_index), preview.request_blocks)
        worker = None if pick is None else self._worker_at(preview.trace, pick)
        if worker is None:
            return router.route(req)
        hints = replace(req.hints, pinned_worker_id=worker[0], pinned_dp_rank=worker[1])
        return router.route(replace(req, hints=hints))

    def _worker_at(self, trace, i: int) -> tuple[str, int] | None:
        ep = int(trace.endpoints[i])
        wid = self._router.ep_worker[ep]
        if wid is None:
            return None
        return wid, int(self._router.ep_rank[ep])

    def stats(self) -> dict[str, Any]:
        return {**self._router.stats(), "affinity": dict(self.affinity_counters)}

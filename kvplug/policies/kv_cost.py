"""``kv``: the routing seed's cost (PROTOCOLS.md §4.1), lowest wins.

``cost = scale * max(prefill - credit*device - w_host*host - w_disk*disk - m*shared, 0)
+ decode`` (linear; lmetric multiplies by ``decode + 1`` instead), computed by the core over
all candidates in one call. The same cost backs the profile's ``kv-cost-scorer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvplug import pickers
from kvplug.decision import CandidateTrace
from kvplug.pipeline import RouteContext
from kvplug.policies.base import RoutingPolicy, register_policy

if TYPE_CHECKING:
    from kvplug.router import Router


class SeedCost:
    """The seed's cost per candidate, from what the overlap and load stages reported."""

    def __init__(self, router: Router) -> None:
        cfg = router.config
        self.router = router
        self.block_size = router.block_size
        self.lmetric = cfg.router_selection_policy == "lmetric"
        self.credit_decay = cfg.router_kv_overlap_score_credit_decay
        self.request_weight = cfg.router_decode_active_request_weight
        self.costs = router.core.costs
        # the default terms and the cost in one compiled call (the reference has no twin: it
        # takes the numpy path below, which the compiled call matches bit for bit); the
        # router-wide options it does not cover are settled here, once
        plain = not self.lmetric and self.credit_decay <= 0 and self.request_weight <= 0
        self.fused = getattr(router.core, "seed_load_costs", None) if plain else None
        # the compiled core returns float64 arrays already; the reference returns lists
        self.as_array = _float_array if router.backend == "reference" else _same

    def __call__(
        self, ctx: RouteContext, inputs: dict[str, np.ndarray] | None = None
    ) -> np.ndarray:
        """Costs per candidate; ``inputs`` (if given) receives the terms, for the trace."""
        dev, host, disk, shared = ctx.device, ctx.host, ctx.disk, ctx.shared
        assert dev is not None and host is not None and disk is not None and shared is not None
        rules = ctx.rules
        if self.fused is not None and rules.default_terms:  # the defaults: one compiled call
            prefill_vec, decode_vec, cost = self.fused(
                ctx.prefill_tokens,
                ctx.decode_blocks,
                ctx.cands,  # the endpoint ids ctx.sel gathers (a slice when they are 0..n-1)
                dev,
                host,
                disk,
                shared,
                ctx.active_depth,
                ctx.n_tokens,
                ctx.full_blocks,
                self.block_size,
                rules.params,
            )
            if inputs is not None:
                inputs["prefill_blocks"] = prefill_vec
                inputs["decode_blocks"] = decode_vec
                if ctx.active_depth is not None:
                    inputs["active_prefix"] = ctx.active_depth
            return cost
        prefill_vec, decode_vec = self.load_vectors(ctx, dev)
        if inputs is not None:
            inputs["prefill_blocks"] = prefill_vec
            inputs["decode_blocks"] = decode_vec
            if ctx.active_depth is not None:
                inputs["active_prefix"] = ctx.active_depth
        credited = dev
        if self.credit_decay > 0 and rules.credit > 0:
            # Dynamo's credit decay: 1/(1 + decay * excess), excess = active prefill tokens
            # over the least-loaded candidate's, in units of this request's size
            pt = ctx.prefill_tokens[ctx.sel]
            factor = 1.0 / (1.0 + self.credit_decay * (pt - pt.min()) / max(ctx.n_tokens, 1))
            credited = dev * factor
            if inputs is not None:
                inputs["credit_factor"] = factor
        if self.lmetric:  # the core's cost with no decode term is the scaled adjusted prefill
            zeros = np.zeros(len(decode_vec))
            prefill_cost = self.costs(
                prefill_vec, credited, host, disk, shared, zeros, rules.params
            )
            return self.as_array(prefill_cost) * (decode_vec + 1.0)
        return self.as_array(
            self.costs(prefill_vec, credited, host, disk, shared, decode_vec, rules.params)
        )

    def load_vectors(self, ctx: RouteContext, dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prefill blocks, decode blocks) per candidate, the seed's load terms:
        prefill = active uncached prompt tokens / block size + the request's tokens / block size;
        decode = active blocks + the request's blocks, minus, when KV reuse is assumed, those of
        its chain already active on the endpoint (Dynamo's dedup by block hash) or, with the
        resident credit, already cached on its device (whichever prefix is longer)."""
        bs = self.block_size
        n = len(dev)
        sel = ctx.sel
        n_tokens = ctx.n_tokens
        rules = ctx.rules
        active_depth = ctx.active_depth
        # few numpy ops on purpose: each costs ~1 us at these sizes
        if rules.prefill_term and rules.track_prefill:
            prefill_vec = ctx.prefill_tokens[sel] * (1.0 / bs)
            prefill_vec += n_tokens / bs
        elif rules.prefill_term:
            prefill_vec = np.full(n, n_tokens / bs)
        else:
            prefill_vec = np.zeros(n)
        if rules.track_decode:
            decode_blk = ctx.decode_blocks
            if not rules.assume_reuse:
                decode_vec = decode_blk[sel] + 0.0
            elif rules.resident_credit:  # cached or in flight: either way no new KV memory
                held = dev if active_depth is None else np.maximum(active_depth, dev)
                decode_vec = decode_blk[sel] - held
            elif active_depth is not None:
                decode_vec = decode_blk[sel] - active_depth
            else:
                decode_vec = decode_blk[sel] + 0.0
            decode_vec += ctx.full_blocks
            if self.request_weight > 0:
                decode_vec += self.request_weight * self.router.load.inflight[sel]
        else:
            decode_vec = np.zeros(n)
        return prefill_vec, decode_vec


def _float_array(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _same(values: np.ndarray) -> np.ndarray:
    return values


@register_policy
class KvCostPolicy(RoutingPolicy):
    """Lowest seed cost; ``--router-temperature`` > 0 samples a softmax over the costs."""

    name = "kv"
    uses_overlap = True

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self.cost = SeedCost(router)
        self.temperature = router.config.router_temperature
        self.missing_penalty = router.config.router_missing_attribute_penalty
        self.select = router.core.select
        self.rng = router.rng
        self.as_sequence = router.backend == "reference"  # the reference takes lists

    def score(self, ctx: RouteContext) -> CandidateTrace:
        inputs = {
            "device": ctx.device,
            "host": ctx.host,
            "disk": ctx.disk,
            "shared_beyond": ctx.shared,
        }
        values = self.cost(ctx, inputs)  # type: ignore[arg-type]
        if ctx.penalised is not None:
            values = np.where(ctx.penalised, values * (1.0 + self.missing_penalty), values)
        router = self.router
        return CandidateTrace(
            router.ep_worker,
            router.ep_rank,
            ctx.cands,
            "cost",
            values,
            inputs,  # type: ignore[arg-type]
            ctx.rules.params_dict,
            None,
            ctx.penalised,
        )

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        values = trace.values
        u = self.rng.random()
        idx = int(self.select(values.tolist() if self.as_sequence else values, self.temperature, u))
        if self.temperature > 0:
            trace.probabilities = pickers.softmax_cost_probs(values, self.temperature)
        return idx

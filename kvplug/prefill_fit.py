"""The affinity guard's prefill model, fitted online to the engines' own first tokens.

The TTFT guard (:mod:`kvplug.affinity`) predicts a prompt's prefill as
``a·n + b·n² + c·n·context`` ms, chunk by chunk; the shipped coefficients are one H200 running
an 8B model. Engines of another speed, or whose attention over a cached prefix costs less, are
mispredicted, and the guard then lets follow-ups wait where they should not, or moves them
where they need not go. :class:`OnlinePrefillFit` learns the three coefficients from requests
the router has already served: one that started prefilling on an engine with nothing else of
the router's in prefill (``ActiveRequest.alone``) and whose first token was seen as it came
(a stream's first event, not the end of a whole answer) took about its own prefill to its first
token. Its features are those :func:`kvplug.affinity.chunked_prefill_seconds` sums.

The fit is least squares in relative errors, prompts shorter than a chunk weighed down by their
share of one squared (a short prompt's first token is timed by the step it joins more than by
its prefill), over the three terms and a constant per request
(the step a request waits to join, the report's way back: fitted so the three are not bent to
carry it, and left out of ``model``), with the shipped coefficients as a prior worth
``PRIOR_WEIGHT`` samples timed by them (so a handful of first tokens cannot swing it),
non-negative coefficients, and samples forgotten with a half-life of ``HALF_LIFE`` samples (an
engine replaced by a faster one is learnt again). A first token faster than ``FAST_FLOOR`` of the
current model's prefill is counted at that floor (``fast_samples``): it is most likely a prefix
the engine had cached and the router did not know of, and in relative errors one such sample
outweighs thousands of true ones. It is solved from 4x4 running sums every ``REFIT_EVERY``
samples: no sample is kept.
"""

from __future__ import annotations

import math

import numpy as np

PRIOR_WEIGHT = 50.0  # the shipped coefficients count as this many samples
REFIT_EVERY = 50  # samples between two solves
HALF_LIFE = 5000.0  # samples after which a sample weighs half
# a prompt weighs fully from one chunk of new tokens; without a known chunk, from this many (vLLM's
# default max_num_batched_tokens for an API server on a large GPU)
FULL_WEIGHT_TOKENS = 8192.0
# a first token is counted as at least this share of the current model's prediction for its
# prefill. Faster ones are mostly cache hits the router did not know of (lost events, an engine's
# own tiers): relative errors weigh a sample by 1 / y^2, so one of them outweighed thousands of
# true ones, and with 2 % of them long prefills were predicted at 3 % of their time
# (tests/test_prefill_fit.py). An engine truly faster than the model is still learnt: the floor
# follows the model down as it solves
FAST_FLOOR = 0.25
_N = 4  # fitted terms: a constant per request, then the three of the prefill model


def chunk_share(new: float, chunk: float) -> float:
    """A prompt's new tokens as a share of its engine's chunk (of FULL_WEIGHT_TOKENS when the
    chunk is unknown): the fit weighs a first token by its square up to one, the speed estimate
    also leaves out those under SPEED_MIN_SHARE."""
    return new / (chunk if chunk > 0 else FULL_WEIGHT_TOKENS)


def prefill_features(new: float, cached: float, chunk: float) -> tuple[float, float, float]:
    """(new tokens, the sum of each chunk's new tokens squared, the (new, context) token pairs
    over the chunks): the terms ``chunked_prefill_seconds`` multiplies by a, b and c. That
    function keeps its own arithmetic: the compiled predictions repeat its operations, in its
    order, to the same floats."""
    n, p = max(float(new), 0.0), max(float(cached), 0.0)
    if chunk <= 0 or chunk >= n:
        return n, n * n, n * p
    full, rem = divmod(n, chunk)
    quad = full * chunk * chunk + rem * rem
    ctx = n * p + chunk * chunk * full * (full - 1) / 2 + rem * full * chunk
    return n, quad, ctx


class OnlinePrefillFit:
    """``model``: (a, b, c) in ms, the prior's until enough first tokens have been added."""

    def __init__(
        self,
        prior: tuple[float, float, float],
        prior_weight: float = PRIOR_WEIGHT,
        refit_every: int = REFIT_EVERY,
        half_life: float = HALF_LIFE,
        weigh_short: bool = True,
    ) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.prior_weight = float(prior_weight)
        self.refit_every = max(int(refit_every), 1)
        self._decay = 0.5 ** (1.0 / half_life) if half_life > 0 else 1.0
        # False: every prompt in full, as the fit first did (benchmarks/prefill_fit_accuracy.py)
        self.weigh_short = weigh_short
        self.model = (float(prior[0]), float(prior[1]), float(prior[2]))
        self.samples = 0  # first tokens added
        self.fast_samples = 0  # of them, counted at FAST_FLOOR of the model's prediction
        self.solves = 0  # times the model was solved
        # what a request costs on top, whatever its prefill (ms): the step it waits to join, the
        # report's way back. Fitted beside the three so they are not bent to carry it, and left
        # out of the predictions, which it would shift alike on every engine
        self.overhead_ms = 0.0
        # weighted, decayed sums of x xᵀ (upper triangle, row by row) and of x y over the features
        # (1, the three prefill terms), and the decayed number of samples, in Python floats: an
        # add is a first token's cost, and numpy's per-call overhead on 4-vectors is ten times
        # the arithmetic
        self._sums = [0.0] * (_N * (_N + 1) // 2 + _N)
        self._count = 0.0

    def add(self, new: float, cached: float, chunk: float, seconds: float) -> bool:
        """One request's prefill (``new`` tokens over ``cached``, in chunks of ``chunk``) and its
        observed time to first token; True when the model was solved again."""
        if not (new > 0 and math.isfinite(seconds) and seconds > 0):
            return False
        x = (1.0, *prefill_features(new, cached, chunk))
        y = seconds * 1000.0
        # relative errors: weighed by its square, every sample counts by how far off the model
        # is in proportion (in absolute ms the long prompts decide alone, and their per-token
        # and per-square terms are nearly one: a long prompt's chunks all have the same size)
        scale = y
        predicted = self.model[0] * x[1] + self.model[1] * x[2] + self.model[2] * x[3]
        if y < FAST_FLOOR * predicted:
            # too fast for its prefill: counted at the floor, and in proportion to the prediction
            # rather than to itself, so it weighs as one sample, not thousands
            y, scale = FAST_FLOOR * predicted, predicted
            self.fast_samples += 1
        w = 1.0 / max(scale, 1.0) ** 2
        # and a prompt under a chunk by its share of one, squared: a short prompt's first token
        # is timed mostly by the step it waits for and what shares it, not by its own prefill
        # (in replays of the conversation trace, prompts under 2,000 new tokens came 3-12x late
        # at the median against any prefill model, and counted in full they bent the fit to
        # predict the long prefills the guard turns on 3-9 % short, its context cost 6-36 %
        # low; docs/sim.md)
        if self.weigh_short:
            w *= min(1.0, chunk_share(new, chunk)) ** 2
        terms = [w * x[i] * x[j] for i in range(_N) for j in range(i, _N)]
        terms += [w * v * y for v in x]
        d = self._decay
        self._sums = [s * d + t for s, t in zip(self._sums, terms, strict=True)]
        self._count = self._count * d + 1.0
        self.samples += 1
        if self.samples % self.refit_every:
            return False
        return self._solve()

    def _solve(self) -> bool:
        sums_xx = np.zeros((_N, _N))
        sums_xx[np.triu_indices(_N)] = self._sums[:-_N]
        sums_xx = sums_xx + np.triu(sums_xx, 1).T
        sums_xy = np.asarray(self._sums[-_N:])
        scale = np.sqrt(np.diag(sums_xx) / max(self._count, 1e-300))
        # a term no sample has exercised (no cached prefix seen yet, say) keeps the prior's
        # coefficient: the samples say nothing of it
        seen = [j for j in range(_N) if scale[j] > 0]
        # solved in units of each feature's typical size (its root mean square): the raw sums
        # span ~11 orders of magnitude (tokens against token pairs), too many for a plain solve
        unit = np.where(scale > 0, scale, 1.0)
        xx = sums_xx / np.outer(unit, unit)
        xy = sums_xy / unit
        # the prior as prior_weight more samples at the prompts seen, timed by the prior: the
        # solution is the least-squares one pulled towards the prior by weight / (weight +
        # samples). (A ridge on the coefficients would instead decide the direction the data
        # hardly constrain, the split between the n^2 and context terms of long prompts, and
        # with it a wrong per-token cost once that split is held non-negative.)
        prior = np.concatenate([[0.0], self.prior])
        k = self.prior_weight / max(self._count, 1e-300)
        lhs = (1.0 + k) * xx + 1e-9 * self._count * np.eye(_N)
        rhs = xy + k * (xx @ (prior * unit))
        theta = prior.copy()
        active = seen
        while active:  # non-negative: a coefficient solved below zero is held at zero
            sub = np.ix_(active, active)
            try:
                solved = np.linalg.solve(lhs[sub], rhs[active])
            except np.linalg.LinAlgError:
                return False
            theta[seen] = 0.0
            theta[active] = solved / unit[active]
            negative = [j for j in active if theta[j] < 0]
            if not negative:
                break
            active = [j for j in active if j not in negative]
        theta = np.maximum(theta, 0.0)
        if not (np.all(np.isfinite(theta)) and theta[1] + theta[2] > 0):
            return False  # a model must charge for new tokens (AffinityParams' own rule)
        self.overhead_ms = float(theta[0])
        self.model = (float(theta[1]), float(theta[2]), float(theta[3]))
        self.solves += 1
        return True


# EngineSpeeds: an engine's first tokens count as this many fleet samples' worth of doubt before
# its own speed is believed (its estimate is shrunk towards the fleet's by prior / (prior + its
# weight)); its samples are forgotten with a half-life of SPEED_HALF_LIFE of its own (an engine
# replaced by another is learnt again), the fleet's with HALF_LIFE
SPEED_PRIOR_WEIGHT = 20.0
SPEED_HALF_LIFE = 500.0
# and a first token teaches its engine's speed only from a quarter of a chunk of new tokens up
SPEED_MIN_SHARE = 0.25


class EngineSpeeds:
    """Each engine's prefill time relative to the fleet's, learnt from the first tokens the fit
    learns from: a fleet of different GPUs (or of engines serving at different parallelism) is
    one model fitted to all of them, which predicts the slower ones short and the faster ones
    long. Per sample, the log of its time over the current model's prediction, weighed as the
    caller says (the affinity guard: as the fit weighs a prompt, by its share of a chunk squared,
    prompts under a quarter of a chunk left out) and held within
    ``1 / MAX_RATIO`` .. ``MAX_RATIO``; an engine's slowdown is its weighted mean log ratio less
    the fleet's, shrunk towards the fleet's and applied only once it is more than ``band``
    times off (so engines that are alike, whose estimates scatter by a few per cent, keep 1.0
    and route exactly as with one model)."""

    MAX_RATIO = 4.0

    def __init__(
        self,
        band: float,
        prior_weight: float = SPEED_PRIOR_WEIGHT,
        half_life: float = SPEED_HALF_LIFE,
        fleet_half_life: float = HALF_LIFE,
    ) -> None:
        if not band > 1.0:
            raise ValueError(f"EngineSpeeds: band must be > 1, got {band!r}")
        self._log_band = math.log(band)
        self.prior_weight = float(prior_weight)
        self._decay = 0.5 ** (1.0 / half_life)
        self._fleet_decay = 0.5 ** (1.0 / fleet_half_life)
        self._engines: dict[int, list[float]] = {}  # endpoint -> [weighted log sum, weight]
        self._fleet = [0.0, 0.0]

    def add(self, ep: int, seconds: float, predicted: float, weight: float) -> None:
        """One first token of ``ep``: ``seconds`` observed where the fleet's model predicted
        ``predicted``, the sample weighing ``weight`` (0..1)."""
        if not (seconds > 0 and predicted > 0 and weight > 0 and math.isfinite(seconds)):
            return
        bound = math.log(self.MAX_RATIO)
        x = min(max(math.log(seconds / predicted), -bound), bound)
        sums = self._engines.setdefault(ep, [0.0, 0.0])
        d = self._decay
        sums[0] = sums[0] * d + weight * x
        sums[1] = sums[1] * d + weight
        f = self._fleet
        fd = self._fleet_decay
        f[0] = f[0] * fd + weight * x
        f[1] = f[1] * fd + weight

    def slowdown(self, ep: int) -> float:
        """``ep``'s step times over the fleet model's (1.0 within the band, or unknown)."""
        sums = self._engines.get(ep)
        if sums is None or self._fleet[1] <= 0:
            return 1.0
        fleet_mean = self._fleet[0] / self._fleet[1]
        # shrunk: weight / (weight + prior) of the way from the fleet's mean to its own
        off = (sums[0] - sums[1] * fleet_mean) / (sums[1] + self.prior_weight)
        return math.exp(off) if abs(off) > self._log_band else 1.0

    def endpoints(self) -> list[int]:
        return list(self._engines)

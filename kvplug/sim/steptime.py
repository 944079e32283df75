"""Step-time model of one engine iteration (continuous batching, chunked prefill).

Reference setup: a Llama-3-8B-shaped model (bf16) on one H200, from
``kvplug/sim/data/prefill_calib_h200.json`` (copied from the team's calibration run); the prefill
constants below are :func:`kvplug.sim.calibration.fit_prefill` of that file, rounded (a test
keeps them in step):

* prefill of ``n`` new tokens on top of ``p`` tokens already in the KV cache (cached prefix or
  earlier chunks of the same prompt)::

      prefill_ms(n, p) = LINEAR_MS * n + QUAD_MS * n**2 + ctx_ms * n * p

  ``LINEAR_MS`` and ``QUAD_MS`` are the cold fit (0.0282·L + 4.36e-7·L², within 2 % for
  2k–32k tokens). ``ctx_ms`` is the per (new, cached) token pair attention cost. The data allow
  a range: ``CTX_CAUSAL_MS`` = 2·``QUAD_MS`` (the causal kernel's per-pair rate, what a serving
  engine running one FlashAttention kernel over cached and new keys pays; the default) up to
  ``CTX_CACHED_MS`` (the fit of the measured cached-prefill points, 2.8× higher, paid by the
  calibration's masked SDPA fallback kernel). ``--steptime`` picks either end (:data:`PRESETS`).
* decode: each step reads the weights once (``WEIGHTS_MS`` ≈ 16 GB at 4.3 TB/s) and the KV cache
  of every decoding sequence (``KV_READ_MS_PER_1K`` per 1,000 cached tokens, 128 KiB per token).
  This is a roofline *assumption*, not a measurement (the calibration's decode numbers are eager
  framework overhead).
* one step = max(weights read, prefill compute + per-token compute of the decode tokens)
  + KV read of decoding sequences + host-tier reload time + a fixed overhead (assumed 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

LINEAR_MS = 0.0282  # per new token (cold fit)
QUAD_MS = 4.36e-7  # per new token squared (cold fit: causal attention within the chunk)
CTX_CAUSAL_MS = 2 * QUAD_MS  # per (new x cached) token pair at the causal rate (default)
CTX_CACHED_MS = 2.45e-6  # per pair, fit of the measured cached-prefill points (high end)
WEIGHTS_MS = 3.7  # one read of 16 GB of weights at ~4.3 TB/s (assumption, roofline)
KV_READ_MS_PER_1K = 0.0305  # 128 KiB per token at ~4.3 TB/s (assumption, roofline)
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16


@dataclass(frozen=True)
class StepTimeModel:
    """Parameters of the step-time model; defaults are the 8B / H200 reference setup."""

    linear_ms: float = LINEAR_MS
    quad_ms: float = QUAD_MS
    ctx_ms: float = CTX_CAUSAL_MS
    weights_ms: float = WEIGHTS_MS
    kv_read_ms_per_1k: float = KV_READ_MS_PER_1K
    overhead_ms: float = 0.0  # launch + sampling per step (assumed 0: folded into the rooflines)
    # fixed cost of a step that runs prefill / of one that has sequences decoding, added (not
    # overlapped): 0 in the H200 model, measured in Dynamo's mocker (MOCKER below)
    prefill_step_ms: float = 0.0
    decode_step_ms: float = 0.0
    host_reload_gbps: float = 40.0  # host->device copy for host-tier hits (assumption: PCIe 5 x16)
    transfer_gbps: float = (
        25.0  # P/D KV transfer prefill->decode engine (assumption: ~200 Gb/s RDMA)
    )
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN

    def slowed(self, factor: float) -> StepTimeModel:
        """This engine's model on hardware ``factor`` times slower (> 1) or faster (< 1): every
        compute and memory-read time scaled alike; the host and P/D links' rates unchanged."""
        if not factor > 0:
            raise ValueError(f"a step-time factor must be > 0, got {factor!r}")
        return replace(
            self,
            linear_ms=self.linear_ms * factor,
            quad_ms=self.quad_ms * factor,
            ctx_ms=self.ctx_ms * factor,
            weights_ms=self.weights_ms * factor,
            kv_read_ms_per_1k=self.kv_read_ms_per_1k * factor,
            overhead_ms=self.overhead_ms * factor,
            prefill_step_ms=self.prefill_step_ms * factor,
            decode_step_ms=self.decode_step_ms * factor,
        )

    def prefill_ms(self, n: int, cached: int) -> float:
        """Compute time of ``n`` new prompt tokens on top of ``cached`` tokens of context."""
        if n <= 0:
            return 0.0
        return self.linear_ms * n + self.quad_ms * n * n + self.ctx_ms * n * cached

    def decode_kv_ms(self, context_tokens: int) -> float:
        """KV-cache read time of decoding sequences holding ``context_tokens`` tokens in total."""
        return self.kv_read_ms_per_1k * context_tokens / 1000.0

    def reload_ms(self, tokens: int) -> float:
        """Host-to-device copy time of ``tokens`` tokens of KV."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / (self.host_reload_gbps * 1e9) * 1e3

    def transfer_ms(self, tokens: int) -> float:
        """Prefill-to-decode engine KV transfer time of ``tokens`` tokens (P/D)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9) * 1e3

    def step_ms(
        self,
        prefill_compute_ms: float,
        n_decode: int,
        decode_context: int,
        reload_ms: float = 0.0,
    ) -> float:
        """One iteration: ``prefill_compute_ms`` from :meth:`prefill_ms` summed over the chunks
        scheduled, ``n_decode`` sequences decoding one token each over ``decode_context`` tokens."""
        compute = prefill_compute_ms + self.linear_ms * n_decode
        return (
            max(self.weights_ms, compute)
            + self.decode_kv_ms(decode_context)
            + reload_ms
            + self.overhead_ms
            + (self.prefill_step_ms if prefill_compute_ms > 0 else 0.0)
            + (self.decode_step_ms if n_decode > 0 else 0.0)
        )

    def decode_only_ms(self, n_decode: int) -> float:
        """Per-step constant part of a decode-only step (excludes the KV read)."""
        fixed = self.overhead_ms + (self.decode_step_ms if n_decode > 0 else 0.0)
        return max(self.weights_ms, self.linear_ms * n_decode) + fixed


REFERENCE = StepTimeModel()

# The step timing of NVIDIA Dynamo's mocker engine (ai-dynamo-runtime 1.6.1, its default
# polynomial model), measured by replaying single requests and batches through its offline trace
# replay (benchmarks/fit_mocker_steptime.py; tests/test_sim_steptime.py re-measures it):
# a step that runs n prefill tokens costs 16.50 + 0.015183 n + 4.21e-7 n^2 ms (the preset within
# 0.02 ms of the mocker at 512-24,576 tokens) whatever the cached prefix (no context term); a
# step with decoding sequences adds 5.86 ms + 0.0152 ms per sequence + 0.0432 ms per 1,000
# tokens of their context (the mocker's decode time is concave in the context: within 13 % over
# 1-128 sequences of 0.5-8 k tokens); the two add up when a step has both. Lets kvplug's
# policies decide closed loop with the timing Dynamo's simulator judges them by
# (benchmarks/bench_dynamo_replay.py)
MOCKER = StepTimeModel(
    linear_ms=0.015183,
    quad_ms=4.21e-7,
    ctx_ms=0.0,
    weights_ms=0.0,
    kv_read_ms_per_1k=0.0432,
    overhead_ms=0.0,
    prefill_step_ms=16.50,
    decode_step_ms=5.86,
)

# --steptime presets: the two ends of what the calibration data allow for the context term, and
# Dynamo's mocker
PRESETS = {"causal": CTX_CAUSAL_MS, "cached": CTX_CACHED_MS}
MODEL_PRESETS = {"mocker": MOCKER}


def parse_steptime(text: str) -> StepTimeModel:
    """``causal`` | ``cached`` | ``ctx=MS_PER_PAIR`` | ``mocker`` -> a model (ValueError
    otherwise)."""
    text = text.strip()
    if text in PRESETS:
        return StepTimeModel(ctx_ms=PRESETS[text])
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    key, sep, raw = text.partition("=")
    if sep and key.strip() == "ctx":
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value >= 0:
            return StepTimeModel(ctx_ms=value)
    raise ValueError(
        f"--steptime {text!r}: expected one of {', '.join([*PRESETS, *MODEL_PRESETS])} or "
        "ctx=MS_PER_TOKEN_PAIR (>= 0)"
    )


def parse_slowdowns(text: str) -> tuple[float, ...]:
    """``1,2`` -> (1.0, 2.0) (``--slowdowns``; '' -> (): every engine alike); ValueError unless
    every factor is finite and > 0."""
    if not text.strip():
        return ()
    factors = tuple(float(x) for x in text.split(","))  # ValueError on a word or a gap
    check_slowdowns(factors)
    return factors


def check_slowdowns(factors: tuple[float, ...]) -> None:
    """ValueError unless every factor is finite and > 0 (NaN is not)."""
    if not all(0 < f < math.inf for f in factors):
        raise ValueError(f"slowdowns must be finite and > 0, got {factors!r}")


def engine_model(model: StepTimeModel, slowdowns: tuple[float, ...], i: int) -> StepTimeModel:
    """Engine ``i``'s step-time model in a fleet of ``slowdowns`` (the list repeated over the
    engines; empty: every engine runs ``model``)."""
    factor = slowdowns[i % len(slowdowns)] if slowdowns else 1.0
    return model if factor == 1.0 else model.slowed(factor)


# KV capacity of the reference setup: ~110 GB of the H200's 141 GB for KV at 128 KiB per token
# ≈ 840k tokens (assumption: vLLM gpu_memory_utilization 0.9 minus weights and activations).
REFERENCE_KV_TOKENS = 840_000


def capacity_blocks(block_size: int, kv_tokens: int = REFERENCE_KV_TOKENS) -> int:
    return kv_tokens // block_size

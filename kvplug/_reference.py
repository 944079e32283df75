"""Pure-Python reference of kvplug's core: the contract the C core (``kvplug._core``) must match.

Slow and obvious on purpose. Every test of the core runs on both implementations, and a
Hypothesis state machine drives random event streams through both demanding identical
answers. Read this file to learn what the core does; read ``csrc/`` to learn how it is fast.

Contract summary
----------------
Hashing (``kph1``, kvplug's own 64-bit hash; no third-party source):

* tokens are unsigned 32-bit values (ids outside ``[0, 2**32)`` are an error);
* ``local_hash(block, seed=0)``: one full block of tokens → u64;
* ``chain_hash(prev, local, extra)``: block i's sequence hash folds in block i-1's;
* ``hash_blocks(tokens, block_size, seed, extra)`` → (local[], seq[]) for every *full* block;
  a trailing partial block is not hashed. ``seed`` is the chain root (namespace: model, LoRA,
  cache salt — see ``kvplug.hashing.namespace_seed``); ``extra[i]`` (u64, 0 = none) folds
  per-block keys such as multimodal hashes into block i's sequence hash.

Index (``Index``): per endpoint (an int id the caller assigns to one (worker, dp_rank)), which
kvplug block hashes it holds and in which tier (0 device, 1 host, 2 disk); endpoint ``SHARED``
is the shared tier readable by all endpoints. Engine block hashes are opaque u64 per endpoint,
mapped to kvplug hashes with a refcount per tier. See each method for the exact rules.

Costs: ``costs()`` is exactly the routing seed's formula; ``select()`` is argmin with a random
tie-break or softmax sampling over normalised cost logits with a temperature.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvplug.errors import InvalidArgument, InvalidTokens, KvplugError

MASK64 = (1 << 64) - 1
K0 = 0x9E3779B97F4A7C15
K1 = 0xBF58476D1CE4E5B9
K2 = 0x94D049BB133111EB
K3 = 0xD6E8FEB86659FD93

DEVICE, HOST, DISK = 0, 1, 2
N_TIERS = 3
SHARED = 0xFFFFFFFF  # pseudo-endpoint id of the shared tier
MAX_ENDPOINT = 1 << 20  # endpoint ids must be < MAX_ENDPOINT (or == SHARED)


# The core's errors are kvplug.errors' classes (both backends raise the same ones).
CoreError = KvplugError
__all__ = ["CoreError", "InvalidArgument", "InvalidTokens"]


# --------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------


def _mum(a: int, b: int) -> int:
    """64x64 -> 128-bit multiply, folded by xor of the halves."""
    p = (a & MASK64) * (b & MASK64)
    return (p & MASK64) ^ (p >> 64)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK64


def fmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return x


def _u64(x: object, what: str = "hash") -> int:
    """An integer folded to u64 (two's complement for negatives, like a uint64 view)."""
    try:
        return operator.index(x) & MASK64  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {type(x).__name__}") from None


def _token_list(tokens: object) -> list[int]:
    """Token ids as ints: bytes-like objects are little-endian u32 tokens; floats are refused."""
    if isinstance(tokens, memoryview) and tokens.format not in ("B", "b", "c"):
        tokens = tokens.tolist()
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise InvalidTokens(f"byte buffer of {len(raw)} bytes is not whole u32 tokens")
        return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    out = []
    for i, t in enumerate(tokens):  # type: ignore[arg-type,var-annotated]
        try:
            out.append(operator.index(t))
        except TypeError:
            raise InvalidTokens(
                f"token at position {i} is a {type(t).__name__}, not an integer"
            ) from None
    return out


def _check_token(t: int, pos: int) -> int:
    if not 0 <= t < (1 << 32):
        raise InvalidTokens(f"token id {t} at position {pos} is outside [0, 2**32)")
    return t


def local_hash(block: Sequence[int], seed: int = 0) -> int:
    """Hash one block of u32 tokens. Eight tokens per round in two lanes of four."""
    toks = [_check_token(t, i) for i, t in enumerate(_token_list(block))]
    n = len(toks)
    seed = _u64(seed, "seed")
    toks += [0] * ((-n) % 8)  # zero padding is unambiguous: n is mixed in below
    a = (seed ^ K0 ^ ((n * K1) & MASK64)) & MASK64
    b = (seed ^ K2 ^ _rotl((n * K3) & MASK64, 29)) & MASK64
    for i in range(0, len(toks), 8):
        w0 = toks[i] | (toks[i + 1] << 32)
        w1 = toks[i + 2] | (toks[i + 3] << 32)
        w2 = toks[i + 4] | (toks[i + 5] << 32)
        w3 = toks[i + 6] | (toks[i + 7] << 32)
        # the xor with the rotated lane keeps state even when a product is zero
        a = _mum(w0 ^ K1 ^ a, w1 ^ K2) ^ _rotl(a, 23)
        b = _mum(w2 ^ K3 ^ b, w3 ^ K0) ^ _rotl(b, 41)
    return fmix64(_mum(a ^ K3, b ^ K0 ^ n) ^ a ^ _rotl(b, 17))


def chain_hash(prev: int, local: int, extra: int = 0) -> int:
    """Sequence hash of a block from its predecessor's sequence hash (or the root seed)."""
    prev &= MASK64
    local &= MASK64
    extra &= MASK64
    return fmix64(
        _mum(prev ^ K2, local ^ K3) ^ _mum(extra ^ K1, prev ^ local ^ K0) ^ _rotl(prev, 31)
    )


def hash_blocks(
    tokens: Iterable[int],
    block_size: int,
    seed: int = 0,
    extra: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of every full block of ``tokens``."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    toks = _token_list(tokens)
    for i, t in enumerate(toks):
        _check_token(t, i)
    n_blocks = len(toks) // block_size
    if extra is not None and len(extra) < n_blocks:
        raise InvalidArgument(f"extra has {len(extra)} entries for {n_blocks} full blocks")
    local: list[int] = []
    seq: list[int] = []
    prev = _u64(seed, "seed")
    for i in range(n_blocks):
        h = local_hash(toks[i * block_size : (i + 1) * block_size])
        prev = chain_hash(prev, h, _u64(extra[i], "extra") if extra is not None else 0)
        local.append(h)
        seq.append(prev)
    return local, seq


def seq_hashes(
    tokens: Iterable[int],
    block_size: int,
    seed: int = 0,
    extra: Sequence[int] | None = None,
) -> list[int]:
    """Sequence hashes of every full block of ``tokens`` (``hash_blocks(...)[1]``)."""
    return hash_blocks(tokens, block_size, seed, extra)[1]


# --------------------------------------------------------------------------------------------
# Index
# --------------------------------------------------------------------------------------------


@dataclass
class _Mapping:
    block: int
    refs: list[int]  # refcount per tier


@dataclass
class QueryResult:
    """Per endpoint id: local prefix length and its split by best tier, shared blocks beyond it.

    Endpoints absent from ``local`` hold no leading block: local 0, shared_beyond = shared_prefix.
    """

    local: dict[int, int]
    device: dict[int, int]
    host: dict[int, int]
    disk: dict[int, int]
    shared_beyond: dict[int, int]
    shared_prefix: int  # run of shared-tier blocks from block 0
    walked: int  # positions the walk visited

    def row(self, ep: int) -> tuple[int, int, int, int, int]:
        if ep in self.local:
            return (
                self.local[ep],
                self.device[ep],
                self.host[ep],
                self.disk[ep],
                self.shared_beyond[ep],
            )
        return (0, 0, 0, 0, self.shared_prefix)

    def scores(self) -> dict[int, int]:
        """ep -> local blocks for every endpoint holding at least the first block."""
        return {ep: n for ep, n in self.local.items() if n > 0}

    def matched(self) -> dict[int, tuple[int, int, int, int, int]]:
        """ep -> row for every endpoint holding at least the first block."""
        return {ep: self.row(ep) for ep in self.local}


class Index:
    """The global prefix index. Rules (the C core implements the same):

    * ``store``: blocks in chain order. Each (endpoint, engine hash) maps to one kvplug hash
      with a refcount per tier; a repeated store of the same (endpoint, engine hash, tier)
      increments the refcount and ``duplicate_stores`` (not stored twice). A store whose engine
      hash is already mapped to a *different* kvplug hash is dropped and counted in
      ``conflicting_stores``.
    * orphan rule (``store_tokens`` only): when ``parent_engine_hash`` is given but the endpoint
      holds no mapping for it, the whole store is rejected, counted in ``orphan_stores``, and
      the index is unchanged (we cannot compute the chained hashes without the parent).
    * re-announcement rule (``store_tokens`` only): a store from the root (no parent) whose
      first blocks the endpoint already holds in that tier (the same engine hash for the same
      block) re-announces them (vLLM's ``kv_cache_report_mode`` "full" sends a request's cache
      hits again, and one removal per block): those leading blocks are touched, not stored
      again, and counted in ``reannounced_blocks``; the rest is stored chained to them.
    * ``remove``: decrements the refcount of that tier (or of every tier holding it when tier is
      None); a hash with no mapping is counted in ``unknown_removes``. At refcount zero the
      mapping goes; a block no endpoint holds goes.
    * ``move``: moves one reference from one tier to another (TRT-LLM offload/onboard).
    * LRU bound: ``max_entries`` (0 = unbounded) bounds the number of (block, endpoint)
      holdings. After a store exceeds it, whole blocks are evicted least recently *touched*
      first (stores and query walks touch blocks, in order), dropping every holding and every
      engine mapping to them; counted in ``evicted_blocks`` / ``evicted_entries``.
    """

    def __init__(self, max_entries: int = 0) -> None:
        if max_entries < 0:
            raise InvalidArgument("max_entries must be >= 0")
        self.max_entries = max_entries
        # block hash -> {endpoint: [count per tier]}; OrderedDict order = LRU (oldest first)
        self._blocks: OrderedDict[int, dict[int, list[int]]] = OrderedDict()
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._n_holdings = 0
        self.counters = {
            "stored_blocks": 0,
            "duplicate_stores": 0,
            "conflicting_stores": 0,
            "orphan_stores": 0,
            "removed_blocks": 0,
            "unknown_removes": 0,
            "moved_blocks": 0,
            "unknown_moves": 0,
            "evicted_blocks": 0,
            "evicted_entries": 0,
            "cleared_endpoints": 0,
            "reannounced_blocks": 0,
        }

    # -- validation -------------------------------------------------------------------------
    @staticmethod
    def _check_ep(ep: int) -> None:
        if not (0 <= ep < MAX_ENDPOINT or ep == SHARED):
            raise InvalidArgument(f"endpoint id {ep} out of range")

    @staticmethod
    def _check_tier(tier: int) -> None:
        if tier not in (DEVICE, HOST, DISK):
            raise InvalidArgument(f"tier {tier} is not 0 (device), 1 (host) or 2 (disk)")

    # -- internals ---------------------------------------------------------------------------
    def _touch(self, h: int) -> None:
        self._blocks.move_to_end(h)

    def _add_ref(self, ep: int, eh: int, h: int, tier: int) -> None:
        m = self._maps.get((ep, eh))
        if m is None:
            m = self._maps[(ep, eh)] = _Mapping(h, [0] * N_TIERS)
        elif m.block != h:
            self.counters["conflicting_stores"] += 1
            return
        if m.refs[tier] > 0:
            self.counters["duplicate_stores"] += 1
        m.refs[tier] += 1
        holders = self._blocks.get(h)
        if holders is None:
            holders = self._blocks[h] = {}
        counts = holders.get(ep)
        if counts is None:
            counts = holders[ep] = [0] * N_TIERS
            self._n_holdings += 1
        counts[tier] += 1
        self.counters["stored_blocks"] += 1
        self._touch(h)

    def _drop_ref(self, ep: int, eh: int, m: _Mapping, tier: int) -> None:
        m.refs[tier] -= 1
        holders = self._blocks[m.block]
        counts = holders[ep]
        counts[tier] -= 1
        if not any(counts):
            del holders[ep]
            self._n_holdings -= 1
            if not holders:
                del self._blocks[m.block]
        if not any(m.refs):
            del self._maps[(ep, eh)]

    def _evict_over_bound(self) -> None:
        if self.max_entries == 0:
            return
        while self._n_holdings > self.max_entries and self._blocks:
            h, holders = next(iter(self._blocks.items()))
            del self._blocks[h]
            self._n_holdings -= len(holders)
            self.counters["evicted_blocks"] += 1
            self.counters["evicted_entries"] += len(holders)
            for key in [k for k, m in self._maps.items() if m.block == h]:
                del self._maps[key]

    # -- operations --------------------------------------------------------------------------
    def store(
        self,
        ep: int,
        tier: int,
        engine_hashes: Sequence[int],
        block_hashes: Sequence[int],
    ) -> None:
        """Store precomputed kvplug hashes (one per engine hash, chain order)."""
        self._check_ep(ep)
        self._check_tier(tier)
        if len(engine_hashes) != len(block_hashes):
            raise InvalidArgument(
                f"{len(engine_hashes)} engine hashes but {len(block_hashes)} block hashes"
            )
        for eh, h in zip(engine_hashes, block_hashes, strict=True):
            self._add_ref(ep, _u64(eh, "engine hash"), _u64(h, "block hash"), tier)
        self._evict_over_bound()

    def resolve(self, ep: int, engine_hash: int) -> int | None:
        """The kvplug hash an endpoint's engine hash maps to, or None."""
        m = self._maps.get((ep, _u64(engine_hash, "engine hash")))
        return None if m is None else m.block

    def store_tokens(
        self,
        ep: int,
        tier: int,
        parent_engine_hash: int | None,
        engine_hashes: Sequence[int],
        tokens: Sequence[int],
        block_size: int,
        seed: int = 0,
        extra: Sequence[int] | None = None,
    ) -> bool:
        """Store blocks given by their tokens, chaining from the parent's kvplug hash.

        ``seed`` is the namespace root used when there is no parent. Returns False (and counts
        an orphan) when the parent is unknown to this endpoint. Tokens must cover exactly
        ``len(engine_hashes)`` full blocks.
        """
        self._check_ep(ep)
        self._check_tier(tier)
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        tokens = _token_list(tokens)
        if len(tokens) != len(engine_hashes) * block_size:
            raise InvalidArgument(
                f"{len(tokens)} tokens for {len(engine_hashes)} blocks of {block_size}"
            )
        root = seed
        if parent_engine_hash is not None:
            parent = self.resolve(ep, parent_engine_hash)
            if parent is None:
                self.counters["orphan_stores"] += 1
                return False
            root = parent
        _, seq = hash_blocks(tokens, block_size, root, extra)
        held = 0
        if parent_engine_hash is None:  # the re-announcement rule
            while held < len(seq):
                m = self._maps.get((ep, _u64(engine_hashes[held], "engine hash")))
                if m is None or m.block != seq[held] or m.refs[tier] == 0:
                    break
                self._touch(seq[held])
                held += 1
            self.counters["reannounced_blocks"] += held
        self.store(ep, tier, engine_hashes[held:], seq[held:])
        return True

    def store_tokens_many(
        self, rows: Sequence[tuple], block_size: int
    ) -> tuple[int, list[tuple[int, Exception]]]:
        """A batch of ``store_tokens`` calls in order: each row is ``(ep, tier,
        parent_engine_hash, engine_hashes, tokens, seed, extra)``.

        A row that fails is skipped (changing nothing, as its single call) and the rest still
        run. Returns ``(blocks, failures)``: the engine hashes in the rows that did not fail,
        and ``[(i, exception), ...]`` in row order. Orphans are not failures.
        """
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        rows = list(rows)
        for i, row in enumerate(rows):
            if type(row) is not tuple or len(row) != 7:
                raise InvalidArgument(f"store_tokens_many: row {i} is not a 7-tuple")
        blocks = 0
        failures: list[tuple[int, Exception]] = []
        for i, (ep, tier, parent, ehs, tokens, seed, extra) in enumerate(rows):
            try:
                self.store_tokens(ep, tier, parent, ehs, tokens, block_size, seed, extra)
            except (KvplugError, ValueError, TypeError, OverflowError) as err:
                failures.append((i, err))
                continue
            blocks += len(ehs)
        return blocks, failures

    def remove(self, ep: int, engine_hashes: Sequence[int], tier: int | None = None) -> None:
        self._check_ep(ep)
        if tier is not None:
            self._check_tier(tier)
        for eh in engine_hashes:
            eh = _u64(eh, "engine hash")
            m = self._maps.get((ep, eh))
            tiers = [t for t in range(N_TIERS) if m is not None and m.refs[t] > 0]
            if tier is not None:
                tiers = [t for t in tiers if t == tier]
            if m is None or not tiers:
                self.counters["unknown_removes"] += 1
                continue
            for t in tiers:
                self._drop_ref(ep, eh, m, t)
            self.counters["removed_blocks"] += 1

    def move(self, ep: int, engine_hashes: Sequence[int], from_tier: int, to_tier: int) -> None:
        self._check_ep(ep)
        self._check_tier(from_tier)
        self._check_tier(to_tier)
        for eh in engine_hashes:
            eh = _u64(eh, "engine hash")
            m = self._maps.get((ep, eh))
            if m is None or m.refs[from_tier] == 0:
                self.counters["unknown_moves"] += 1
                continue
            if from_tier == to_tier:
                continue
            h = m.block
            self._drop_ref(ep, eh, m, from_tier)
            self._add_ref(ep, eh, h, to_tier)
            self.counters["stored_blocks"] -= 1  # a move is not a new store
            self.counters["moved_blocks"] += 1

    def clear(self, ep: int) -> None:
        """Forget everything one endpoint holds (engine restart, cache reset)."""
        self._check_ep(ep)
        for key in [k for k in self._maps if k[0] == ep]:
            del self._maps[key]
        for h in list(self._blocks):
            holders = self._blocks[h]
            if ep in holders:
                del holders[ep]
                self._n_holdings -= 1
                if not holders:
                    del self._blocks[h]
        self.counters["cleared_endpoints"] += 1

    def query(self, block_hashes: Sequence[int]) -> QueryResult:
        """Walk the request's sequence hashes in order; see QueryResult."""
        local: dict[int, int] = {}
        tiers: dict[int, list[int]] = {}
        shared_hit: list[bool] = []
        active: set[int] | None = None  # None = before block 0
        walked = 0
        for i, raw in enumerate(block_hashes):
            # read as the walk reaches it, so an item past the walk's end is never an error
            try:
                h = operator.index(raw) & MASK64
            except TypeError:
                raise InvalidArgument(
                    f"block_hashes[{i}] must be an integer, got {type(raw).__name__}"
                ) from None
            holders = self._blocks.get(h)
            walked += 1
            if holders is not None:
                self._touch(h)
            held = {ep: c for ep, c in (holders or {}).items() if ep != SHARED}
            cont = set(held) if active is None else {ep for ep in active if ep in held}
            for ep in cont:
                local[ep] = i + 1
                best = next(t for t in range(N_TIERS) if held[ep][t] > 0)
                tiers.setdefault(ep, [0, 0, 0])[best] += 1
            shared = holders is not None and SHARED in holders
            shared_hit.append(shared)
            active = cont
            if not cont and not shared:
                break
        # run of shared hits starting at each position (0 past the walk)
        run = [0] * (len(shared_hit) + 1)
        for i in range(len(shared_hit) - 1, -1, -1):
            run[i] = run[i + 1] + 1 if shared_hit[i] else 0
        return QueryResult(
            local=local,
            device={ep: t[0] for ep, t in tiers.items()},
            host={ep: t[1] for ep, t in tiers.items()},
            disk={ep: t[2] for ep, t in tiers.items()},
            shared_beyond={ep: run[n] for ep, n in local.items()},
            shared_prefix=run[0],
            walked=walked,
        )

    # -- introspection -----------------------------------------------------------------------
    def holdings(self, ep: int) -> dict[int, list[int]]:
        """kvplug hash -> count per tier, for one endpoint (tests and debugging)."""
        return {h: list(c[ep]) for h, c in self._blocks.items() if ep in c}

    def held_counts(self, n: int) -> list[int]:
        """Blocks held per endpoint id ``0 .. n-1``."""
        out = [0] * n
        for c in self._blocks.values():
            for ep in c:
                if 0 <= ep < n:
                    out[ep] += 1
        return out

    def held_count(self, ep: int) -> int:
        """Blocks one endpoint holds on any tier."""
        return sum(1 for c in self._blocks.values() if ep in c)

    def stats(self) -> dict[str, int]:
        s = dict(self.counters)
        s["blocks"] = len(self._blocks)
        s["entries"] = self._n_holdings
        s["engine_mappings"] = len(self._maps)
        return s


# --------------------------------------------------------------------------------------------
# Costs and selection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostParams:
    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    prefill_load_scale: float = 1.0


def costs(
    prefill_blocks: Sequence[float],
    device: Sequence[float],
    host: Sequence[float],
    disk: Sequence[float],
    shared_beyond: Sequence[float],
    decode_blocks: Sequence[float],
    p: CostParams,
) -> list[float]:
    """The routing seed's cost, one value per candidate."""
    out = []
    for i in range(len(prefill_blocks)):
        adjusted = max(
            prefill_blocks[i]
            - p.overlap_score_credit * device[i]
            - p.host_cache_hit_weight * host[i]
            - p.disk_cache_hit_weight * disk[i]
            - p.shared_cache_multiplier * shared_beyond[i],
            0.0,
        )
        out.append(p.prefill_load_scale * adjusted + decode_blocks[i])
    return out


def softmax_probs(cost: Sequence[float], temperature: float) -> list[float]:
    """p_i ∝ exp(-((c_i - min) / (max - min)) / T); all-equal costs give uniform."""
    lo, hi = min(cost), max(cost)
    if hi == lo:
        return [1.0 / len(cost)] * len(cost)
    z = [math.exp(-((c - lo) / (hi - lo)) / temperature) for c in cost]
    s = 0.0
    for v in z:  # left-to-right on purpose: sum() is compensated on Python >= 3.12
        s += v
    return [v / s for v in z]


def select(cost: Sequence[float], temperature: float, u: float) -> int:
    """Index of the chosen candidate. ``u`` is one uniform draw in [0, 1) from the caller's RNG.

    T == 0: lowest cost; ties broken by ``u`` among the tied (in candidate order).
    T > 0: inverse-CDF sampling of softmax_probs with ``u``.
    """
    if not cost:
        raise InvalidArgument("no candidates")
    if not 0.0 <= u < 1.0:
        raise InvalidArgument(f"u must be in [0, 1), got {u}")
    if temperature < 0 or math.isnan(temperature):
        raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
    for i, c in enumerate(cost):
        if math.isnan(c):
            raise InvalidArgument(f"cost of candidate {i} is NaN")
    if temperature == 0:
        lo = min(cost)
        tied = [i for i, c in enumerate(cost) if c == lo]
        return tied[min(int(u * len(tied)), len(tied) - 1)]
    acc = 0.0
    probs = softmax_probs(cost, temperature)
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return len(cost) - 1

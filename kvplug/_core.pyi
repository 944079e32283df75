"""Type stubs of the compiled core (kvplug/_core.pyx); the reference is kvplug/_reference.py."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplug._reference import CostParams as CostParams

DEVICE: int
HOST: int
DISK: int
N_TIERS: int
SHARED: int
MAX_ENDPOINT: int

Tokens = Any  # numpy int32/uint32/int64/uint64, array.array, bytes/memoryview (LE u32), sequences
Hashes = npt.NDArray[np.uint64] | npt.NDArray[np.int64] | Sequence[int]

def chain_hash(prev: int, local: int, extra: int = 0) -> int: ...
def local_hash(block: Tokens, seed: int = 0) -> int: ...
def hash_blocks(
    tokens: Tokens,
    block_size: int,
    seed: int = 0,
    extra: Hashes | None = None,
    with_local: bool = True,
) -> tuple[npt.NDArray[np.uint64] | None, npt.NDArray[np.uint64]]: ...
def seq_hashes(
    tokens: Tokens,
    block_size: int,
    seed: int = 0,
    extra: Hashes | None = None,
) -> npt.NDArray[np.uint64]: ...

class QueryResult:
    local: npt.NDArray[np.int32]
    device: npt.NDArray[np.int32]
    host: npt.NDArray[np.int32]
    disk: npt.NDArray[np.int32]
    shared_beyond: npt.NDArray[np.int32]
    def __init__(self, capacity: int = 0) -> None: ...
    def reserve(self, capacity: int) -> None: ...
    @property
    def shared_prefix(self) -> int: ...
    @property
    def walked(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def endpoints(self) -> npt.NDArray[np.uint32]: ...
    def row(self, ep: int) -> tuple[int, int, int, int, int]: ...
    def scores(self) -> dict[int, int]: ...
    def matched(self) -> dict[int, tuple[int, int, int, int, int]]: ...

class Index:
    max_entries: int
    def __init__(self, max_entries: int = 0) -> None: ...
    def reserve(
        self, blocks: int, mappings: int | None = None, endpoints: int | None = None
    ) -> None: ...
    @property
    def endpoint_limit(self) -> int: ...
    def store(self, ep: int, tier: int, engine_hashes: Hashes, block_hashes: Hashes) -> None: ...
    def store_tokens(
        self,
        ep: int,
        tier: int,
        parent_engine_hash: int | None,
        engine_hashes: Hashes,
        tokens: Tokens,
        block_size: int,
        seed: int = 0,
        extra: Hashes | None = None,
    ) -> bool: ...
    def store_tokens_many(
        self,
        rows: Sequence[tuple[int, int, int | None, Hashes, Tokens, int, Hashes | None]],
        block_size: int,
    ) -> tuple[int, list[tuple[int, Exception]]]: ...
    def resolve(self, ep: int, engine_hash: int) -> int | None: ...
    def remove(self, ep: int, engine_hashes: Hashes, tier: int | None = None) -> None: ...
    def move(self, ep: int, engine_hashes: Hashes, from_tier: int, to_tier: int) -> None: ...
    def clear(self, ep: int) -> None: ...
    def query(self, block_hashes: Hashes, out: QueryResult | None = None) -> QueryResult: ...
    def holdings(self, ep: int) -> dict[int, list[int]]: ...
    def held_count(self, ep: int) -> int: ...
    def held_counts(self, n: int) -> npt.NDArray[np.uint64]: ...
    def stats(self) -> dict[str, int]: ...
    def memory_bytes(self) -> int: ...

def costs(
    prefill_blocks: Sequence[float] | npt.NDArray[Any],
    device: Sequence[float] | npt.NDArray[Any],
    host: Sequence[float] | npt.NDArray[Any],
    disk: Sequence[float] | npt.NDArray[Any],
    shared_beyond: Sequence[float] | npt.NDArray[Any],
    decode_blocks: Sequence[float] | npt.NDArray[Any],
    p: CostParams,
    out: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]: ...
def seed_load_costs(
    prefill_tokens: npt.NDArray[Any],
    decode_blocks: npt.NDArray[Any],
    sel: npt.NDArray[Any],
    device: npt.NDArray[Any],
    host: npt.NDArray[Any],
    disk: npt.NDArray[Any],
    shared_beyond: npt.NDArray[Any],
    active_depth: npt.NDArray[Any] | None,
    n_tokens: float,
    full_blocks: float,
    block_size: float,
    p: CostParams,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...
def select(cost: Sequence[float] | npt.NDArray[Any], temperature: float, u: float) -> int: ...
def softmax_probs(cost: Sequence[float], temperature: float) -> list[float]: ...

class _TrieNode:
    @property
    def hashes(self) -> npt.NDArray[np.uint64]: ...

class ActiveBlocks:
    chains: int
    def __init__(self) -> None: ...
    def walk(self, hashes: npt.NDArray[Any]) -> list[tuple[_TrieNode, int]]: ...
    @staticmethod
    def depths(
        walk: list[tuple[_TrieNode, int]], out: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]: ...
    def add(
        self, ep: int, hashes: npt.NDArray[Any], walk: list[tuple[_TrieNode, int]]
    ) -> tuple[_TrieNode | None, int]: ...
    def release(self, ep: int, tail: _TrieNode | None) -> int: ...
    def nodes(self) -> int: ...

def gather_f64(
    sel: slice | npt.NDArray[Any], *arrays: npt.NDArray[Any]
) -> tuple[npt.NDArray[np.float64], ...]: ...
def stale_prefill_summaries(
    endpoints: npt.NDArray[Any],
    idx: list[int] | None,
    max_batched: npt.NDArray[np.float64],
    queues: Any,
    versions: npt.NDArray[np.int64],
) -> list[tuple[int, float]]: ...
def predicted_ttfts(
    endpoints: npt.NDArray[Any],
    idx: list[int] | None,
    overlap: list[float],
    prompt_tokens: float,
    block_size: float,
    max_batched: npt.NDArray[np.float64],
    queues: Any,
    inflight: npt.NDArray[np.int64],
    context_tokens: npt.NDArray[np.int64],
    now: float,
    read_ms: float,
    coeffs: tuple[float, float, float],
) -> list[float]: ...

class SlidingQuantile:
    window: int
    def __init__(self, window: int) -> None: ...
    def __len__(self) -> int: ...
    def add(self, value: float) -> None: ...
    def extend(self, values: Any) -> None: ...
    def quantile(self, q: float) -> float: ...

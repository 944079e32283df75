"""vLLM's own prefix-cache block hashes, so simulated engines publish what a real engine would.

vLLM (v1, ``vllm/v1/core/kv_cache_utils.py``) chains one hash per full block::

    NONE_HASH = hash_fn(seed)            # seed = $PYTHONHASHSEED, else "vllm-none-hash"
    h_i       = hash_fn((h_{i-1} or NONE_HASH, tuple(block_i_tokens), extra_keys_i))

with ``hash_fn`` = ``--prefix-caching-hash-algo``: ``sha256_cbor`` (SHA-256 of canonical CBOR,
language-neutral) or ``sha256`` (SHA-256 of a highest-protocol pickle, vLLM's default). A
text-only request without LoRA or ``cache_salt`` has ``extra_keys = None``; a ``cache_salt``
keys the first block with ``(("cache_salt", salt),)``. Events carry the
32-byte digest, or its low 64 bits as an unsigned int when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
is on (vLLM's default).

The CBOR encoder here covers only what a block key holds (bytes, non-negative ints, text, tuples,
None) and writes it as ``cbor2.dumps(..., canonical=True)`` does, so no CBOR library is needed;
``tests/test_sim_vllm_hashes.py`` checks the digests byte for byte against vLLM's own functions
(fixtures in ``tests/data/vllm/block_hashes-*.json``).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for sha256 / sha256_cbor when PYTHONHASHSEED is unset
ALGORITHMS = ("sha256_cbor", "sha256")
MASK64 = (1 << 64) - 1


def _head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (what canonical encoding requires)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 1 << 8:
        return bytes((m | 24, n))
    if n < 1 << 16:
        return bytes((m | 25,)) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes((m | 26,)) + struct.pack(">I", n)
    if n < 1 << 64:
        return bytes((m | 27,)) + struct.pack(">Q", n)
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit head")


_SMALL_UINT = [_head(0, i) for i in range(256)]  # byte-level token ids: one table lookup each


def cbor_encode(value: Any) -> bytes:
    """Canonical CBOR of a block key: bytes, text, ints, tuples/lists and None."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(v: Any, out: bytearray) -> None:
    if v is None:
        out.append(0xF6)
    elif isinstance(v, bool):
        out.append(0xF5 if v else 0xF4)
    elif isinstance(v, int):
        if v >= 0:
            out += _SMALL_UINT[v] if v < 256 else _head(0, v)
        else:
            out += _head(1, -1 - v)
    elif isinstance(v, (bytes, bytearray)):
        out += _head(2, len(v))
        out += v
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out += _head(3, len(b))
        out += b
    elif isinstance(v, (tuple, list)):
        out += _head(4, len(v))
        for item in v:
            _encode(item, out)
    else:
        raise TypeError(f"no CBOR form here for {type(v).__name__}")


def hash_function(algorithm: str):
    """vLLM's ``hash_fn`` for ``--prefix-caching-hash-algo ALGORITHM``: object -> 32 bytes."""
    if algorithm == "sha256_cbor":
        return lambda obj: hashlib.sha256(cbor_encode(obj)).digest()
    if algorithm == "sha256":
        return lambda obj: hashlib.sha256(
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    raise ValueError(f"hash algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}")


class VllmBlockHasher:
    """One engine's block hasher: its algorithm and NONE_HASH seed."""

    def __init__(self, algorithm: str = "sha256_cbor", seed: str = DEFAULT_SEED) -> None:
        self.algorithm = algorithm
        self.seed = seed
        self._fn = hash_function(algorithm)
        self.none_hash = self._fn(seed)

    def block_hash(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None
    ) -> bytes:
        return self._fn((parent or self.none_hash, tuple(tokens), extra_keys))

    def hashes(
        self, tokens: Sequence[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        """Digests of every full block of a text prompt (``cache_salt`` keys the first block)."""
        out: list[bytes] = []
        parent: bytes | None = None
        toks = [int(t) for t in tokens]
        for i in range(len(toks) // block_size):
            extra = (("cache_salt", cache_salt),) if cache_salt and i == 0 else None
            parent = self.block_hash(parent, toks[i * block_size : (i + 1) * block_size], extra)
            out.append(parent)
        return out


def low64(digest: bytes) -> int:
    """What vLLM publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits."""
    return int.from_bytes(digest, "big") & MASK64

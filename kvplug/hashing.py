"""Request/event hash namespaces and convenience hashing on the active core.

``namespace_seed(lora_name, cache_salt)`` is the chain root of a prompt's first block. Events
and requests must use the same rule so that their hashes meet in the index:

* no LoRA and no salt (``None`` or ``""``) -> 0, the plain chain root;
* otherwise each present string is folded in, LoRA first, then the salt:
  ``root = chain_hash(root, local_hash(utf8_bytes_as_tokens, seed=TAG), TAG)`` with a distinct
  TAG per kind, where every UTF-8 byte is one token. A LoRA named "x" and a salt "x" therefore
  give different roots, and so do (lora="a", salt=None) and (lora=None, salt="a").
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvplug import core

LORA_TAG = 0x6B7670_6C6F7261  # "kvp" "lora"
SALT_TAG = 0x6B7670_73616C74  # "kvp" "salt"


def _fold(root: int, text: str, tag: int) -> int:
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
    return int(core.chain_hash(root, core.local_hash(tokens, tag), tag))


@lru_cache(maxsize=4096)
def namespace_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The u64 chain root for a (LoRA name, cache salt) namespace (0 when neither is set)."""
    root = 0
    if lora_name:
        root = _fold(root, str(lora_name), LORA_TAG)
    if cache_salt:
        root = _fold(root, str(cache_salt), SALT_TAG)
    return root


def hash_tokens(
    tokens,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    extra=None,
) -> np.ndarray:
    """Sequence hashes (numpy uint64) of every full block of ``tokens`` in its namespace."""
    seed = namespace_seed(lora_name, cache_salt)
    if core.backend == "c":
        return core.seq_hashes(tokens, block_size, seed, extra)
    return np.asarray(core.seq_hashes(tokens, block_size, seed, extra), dtype=np.uint64)


__all__ = ["LORA_TAG", "SALT_TAG", "hash_tokens", "namespace_seed"]

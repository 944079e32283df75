"""Quality of kph1 on the C core: avalanche statistics and no collisions on 10M blocks."""

from __future__ import annotations

import numpy as np

from kvplug.core import load_backend

core = load_backend("c")
BS = 16


def popcount64(x: np.ndarray) -> np.ndarray:
    return np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1).sum(axis=1)


def bit_matrix(x: np.ndarray) -> np.ndarray:
    """(n, 64) 0/1 matrix of the bits of u64 values."""
    return np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")


def flip_every_bit(base: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """For each base sequence, one copy per input bit of ``block`` with that bit flipped."""
    n, width = base.shape
    bits = 32 * BS
    reps = np.repeat(base, bits, axis=0)
    tok = np.tile(np.arange(bits) // 32, n) + block * BS
    bit = np.tile(np.arange(bits) % 32, n).astype(np.uint32)
    rows = np.arange(n * bits)
    reps[rows, tok] ^= np.left_shift(np.uint32(1), bit)
    return reps, np.repeat(np.arange(n), bits)


def test_avalanche_local_and_chained():
    rng = np.random.default_rng(7)
    n = 400
    base = rng.integers(0, 2**32, size=(n, 2 * BS), dtype=np.uint32)
    b_local, b_seq = core.hash_blocks(base.ravel(), BS)
    b_local = b_local.reshape(n, 2)
    b_seq = b_seq.reshape(n, 2)
    flipped, owner = flip_every_bit(base, 0)
    f_local, f_seq = core.hash_blocks(flipped.ravel(), BS)
    f_local = f_local.reshape(-1, 2)
    f_seq = f_seq.reshape(-1, 2)
    for got, ref in ((f_local[:, 0], b_local[owner, 0]), (f_seq[:, 1], b_seq[owner, 1])):
        diff = got ^ ref
        # every flip changes the hash, about half of the 64 bits on average
        assert np.all(diff != 0)
        mean = popcount64(diff).mean()
        assert 31.5 < mean < 32.5, mean
        # per output bit: flipped with probability ~1/2 for every input bit
        per_bit = bit_matrix(diff).reshape(n, 32 * BS, 64).mean(axis=0)
        assert np.abs(per_bit - 0.5).max() < 0.12, np.abs(per_bit - 0.5).max()


def test_no_collisions_on_10m_random_blocks():
    rng = np.random.default_rng(11)
    chunks = []
    for _ in range(10):
        toks = rng.integers(0, 2**32, size=1_000_000 * BS, dtype=np.uint32)
        local, _ = core.hash_blocks(toks, BS, with_local=True)
        chunks.append(local)
    allh = np.sort(np.concatenate(chunks))
    assert allh.shape[0] == 10_000_000
    assert not np.any(allh[1:] == allh[:-1])


def test_no_collisions_on_low_entropy_chains():
    """Sequence hashes of one long chain over a small vocabulary, and of near-duplicates."""
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 64, size=2_000_000 * BS // 4, dtype=np.uint32)
    _, seq = core.hash_blocks(toks, BS, with_local=False)
    s = np.sort(seq)
    assert not np.any(s[1:] == s[:-1])
    # all-zero and counting blocks differ only slightly
    ramp = np.arange(1_000_000, dtype=np.uint32).repeat(1)
    local, _ = core.hash_blocks(ramp, 1)
    assert np.unique(local).shape[0] == local.shape[0]

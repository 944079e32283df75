"""Known-answer kph1 vectors (tests/data/kph1_vectors.json), generated from the reference.

Regenerate (only on a deliberate hash change, which invalidates every stored index):
    PYTHONPATH=. python tests/test_hash_vectors.py --write
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from kvplug import _reference as ref
from kvplug.core import load_backend

VECTORS = Path(__file__).parent / "data" / "kph1_vectors.json"


def generate() -> dict:
    rng = random.Random(20251130)
    blocks = []
    for n, bs, seed, with_extra in [
        (0, 16, 0, False),
        (1, 1, 0, False),
        (7, 8, 0, False),
        (8, 8, 0, False),
        (9, 8, 3, False),
        (16, 16, 0, False),
        (33, 16, 0, True),
        (64, 16, 2**64 - 1, False),
        (100, 7, 12345, True),
        (256, 32, 0, False),
    ]:
        toks = [rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32)]) for _ in range(n)]
        nb = n // bs
        extra = [rng.choice([0, rng.randrange(2**64)]) for _ in range(nb)] if with_extra else None
        local, seq = ref.hash_blocks(toks, bs, seed, extra)
        blocks.append(
            {
                "tokens": toks,
                "block_size": bs,
                "seed": seed,
                "extra": extra,
                "local": [str(h) for h in local],
                "seq": [str(h) for h in seq],
            }
        )
    locals_ = []
    for n in range(0, 20):
        toks = [rng.randrange(2**32) for _ in range(n)]
        seed = rng.choice([0, rng.randrange(2**64)])
        locals_.append({"tokens": toks, "seed": seed, "hash": str(ref.local_hash(toks, seed))})
    chains = []
    for _ in range(10):
        a, b, c = (rng.randrange(2**64) for _ in range(3))
        chains.append(
            {"prev": str(a), "local": str(b), "extra": str(c), "hash": str(ref.chain_hash(a, b, c))}
        )
    from kvplug.hashing import namespace_seed

    namespaces = [
        {"lora": lora, "salt": salt, "seed": str(namespace_seed(lora, salt))}
        for lora, salt in [
            (None, None),
            ("a", None),
            (None, "a"),
            ("sql-lora", "tenant-7"),
            ("ü-lora", None),
        ]
    ]
    return {
        "hash": "kph1",
        "blocks": blocks,
        "local": locals_,
        "chain": chains,
        "namespaces": namespaces,
    }


@pytest.fixture(scope="module")
def vectors():
    return json.loads(VECTORS.read_text())


@pytest.fixture(params=["c", "reference"])
def be(request):
    return load_backend(request.param)


def test_reference_still_produces_the_vectors(vectors):
    assert generate() == vectors


def test_block_vectors(be, vectors):
    for v in vectors["blocks"]:
        local, seq = be.hash_blocks(v["tokens"], v["block_size"], v["seed"], v["extra"])
        assert [str(int(h)) for h in local] == v["local"]
        assert [str(int(h)) for h in seq] == v["seq"]
        arr = np.array(v["tokens"], dtype=np.uint32)
        _, seq2 = be.hash_blocks(arr, v["block_size"], v["seed"], v["extra"])
        assert [str(int(h)) for h in seq2] == v["seq"]


def test_local_and_chain_vectors(be, vectors):
    for v in vectors["local"]:
        assert str(be.local_hash(v["tokens"], v["seed"])) == v["hash"]
    for v in vectors["chain"]:
        got = be.chain_hash(int(v["prev"]), int(v["local"]), int(v["extra"]))
        assert str(got) == v["hash"]


def test_namespace_vectors(vectors):
    from kvplug.hashing import namespace_seed

    for v in vectors["namespaces"]:
        assert str(namespace_seed(v["lora"], v["salt"])) == v["seed"]


if __name__ == "__main__":
    if "--write" in sys.argv:
        VECTORS.write_text(json.dumps(generate(), indent=1) + "\n")
        print(f"wrote {VECTORS}")

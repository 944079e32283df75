"""Events in tests: compared as values whatever holds their token ids, and token ids of every
width msgpack gives them.

The compiled decoders hand a store's token ids over as a uint32 numpy array (vLLM's and, for
its token loop, SGLang's) and its hashes as a uint64 array (vLLM's, and SGLang's hash reader
for stores and removals), the msgspec paths as lists; ``==`` on a struct holding an array is
an error, so tests compare ``plain(...)`` of what a decoder returned.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


def plain(value: Any) -> Any:
    """``value`` with every event's array fields as lists (lists and tuples walked): a store's
    token ids and hashes, and the engine hashes of a removal or of SGLang's partial-page
    marker, which the compiled hash reader gives as a uint64 array."""
    if isinstance(value, msgspec.Struct):
        changes = {
            name: getattr(value, name).tolist()
            for name in value.__struct_fields__
            if isinstance(getattr(value, name), np.ndarray)
        }
        return msgspec.structs.replace(value, **changes) if changes else value
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


# msgpack's unsigned forms for token ids: positive fixint (1 byte), uint8 (2), uint16 (3),
# uint32 (5)
ID_FORMS = ((0, 128), (128, 256), (256, 65536), (65536, 2**32))


def mixed_width_ids(rng: Any, n: int, weights: list[int] | None = None) -> list[int]:
    """``n`` token ids whose msgpack forms mix by ``weights`` (one per form in ID_FORMS;
    None: each drawn afresh from 0, 1, 5, never all 0), so some arrays are nearly one width
    and others switch width at random."""
    if weights is None:
        weights = [rng.choice([0, 1, 5]) for _ in ID_FORMS]
        if not any(weights):
            weights[rng.randrange(len(ID_FORMS))] = 1
    return [rng.randrange(lo, hi) for lo, hi in rng.choices(ID_FORMS, weights=weights, k=n)]

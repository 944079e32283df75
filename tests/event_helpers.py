"""Events compared as values, whatever holds their token ids.

The compiled decoders hand a store's token ids over as a uint32 numpy array (vLLM's and, for
its token loop, SGLang's), the msgspec paths as a list; ``==`` on a struct holding an array is
an error, so tests compare ``plain(...)`` of what a decoder returned.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvplug.events import BlockStored


def plain(value: Any) -> Any:
    """``value`` with every BlockStored's array fields as lists (lists and tuples walked)."""
    if isinstance(value, BlockStored):
        changes = {
            name: getattr(value, name).tolist()
            for name in ("token_ids", "engine_hashes", "block_hashes", "block_extra")
            if isinstance(getattr(value, name), np.ndarray)
        }
        return msgspec.structs.replace(value, **changes) if changes else value
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value

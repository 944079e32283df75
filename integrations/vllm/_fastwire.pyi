# Type stub for the compiled one-pass vLLM event decoder (integrations/vllm/_fastwire.pyx).
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvplug.events import KvEvent

class FastDecoder:
    wide_ids: bool  # a 5-byte token id has been read: ids go two a step
    def decode(
        self,
        payload: bytes | memoryview,
        max_tokens: int,
        block_size: int,
        worker_id: str,
        dp_rank: int,
        extra_fn: Callable[[bytes, int, str | None, bool], tuple[Any, Any] | None],
    ) -> tuple[float, int | None, list[KvEvent], int, int, int, int, int] | None: ...
    def parse_only(
        self, payload: bytes | memoryview, max_tokens: int, block_size: int
    ) -> tuple[int, int, int] | None: ...
    def token_array(
        self, raw: bytes | memoryview | msgspec.Raw, max_tokens: int
    ) -> npt.NDArray[np.uint32] | None: ...

def hash_array(
    raw: bytes | memoryview | msgspec.Raw, max_n: int
) -> npt.NDArray[np.uint64] | None: ...

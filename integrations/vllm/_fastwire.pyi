# Type stub for the compiled one-pass vLLM event decoder (integrations/vllm/_fastwire.pyx).
from typing import Any

def decode_batch(
    payload: bytes | memoryview, max_tokens: int, block_size: int
) -> tuple[float, int | None, list[tuple[Any, ...]], int] | None: ...

from collections.abc import Callable, Iterable
from typing import Any

# decide / finish answers: None (hand off), a forward 5-tuple or an answer 3-tuple
Forward = tuple[int, bytes, bytes | None, bytes, Any]
Answer = tuple[int, bytes, bytes]

# count's events: a request the lane closed before it was whole
COUNT_HEAD_TIMEOUT: int
COUNT_BODY_TIMEOUT: int
COUNT_CLIENT_GONE: int

def head_qualifies(
    head: bytes, max_body: int, handoff_headers: Iterable[str | bytes] = ()
) -> tuple[int, int, bool, bytes | None, bytes | None, bytes | None] | None: ...

class Lane:
    def __init__(
        self,
        listen_fds: Iterable[int],
        decide: Callable[
            [int, bytes, bytes | None, bytes | None, bytes | None], Forward | Answer | None
        ],
        first_byte: Callable[[Any], None],
        finish: Callable[[Any, int, int, bytes], Forward | Answer | None],
        handoff: Callable[[int, bytes], None],
        *,
        max_body: int,
        head_timeout: float = 0.0,
        keepalive_timeout: float = 0.0,
        body_timeout: float = 0.0,
        connect_timeout: float = 0.0,
        try_timeout: float = 0.0,
        engine_idle_timeout: float = 0.0,
        pool_idle_timeout: float = 4.0,
        request_timeout: float = 0.0,
        max_stream_duration: float = 0.0,
        head_timeout_answer: bytes = b"",
        body_timeout_answer: bytes = b"",
        handoff_headers: Iterable[str | bytes] = (),
        count: Callable[[int, int, float], None] | None = None,
        stream_bytes: Callable[[Any, bytes], None] | None = None,
    ) -> None: ...
    def fileno(self) -> int: ...
    def poll(self) -> int: ...
    def set_upstream(self, upstream_id: int, host: str, port: int) -> None: ...  # numeric, or ""
    def drop_upstream(self, upstream_id: int) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

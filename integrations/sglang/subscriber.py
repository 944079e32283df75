"""SGLang event streams through the vLLM integration's ZMQ subscriber.

SGLang speaks vLLM's transport (PUB ``[topic, seq, payload]``, ROUTER replay with both reply
framings, port + rank per DP rank), so kvplug reuses ``kvplug.integrations.vllm.subscriber`` —
sequence tracking, gap replay, restart clears, one thread for every engine — and only swaps
the payload decoder per stream for SGLang's (``kvplug.integrations.sglang.wire``). The per-worker
``PartialPageFilter`` runs in the sink, after the subscriber attributed a batch to its worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvplug.integrations.common import coalesce_removes
from kvplug.integrations.vllm.subscriber import EventSource, VllmSubscriber
from kvplug.integrations.vllm.wire import DecodedBatch

from kvplug import KvEvent

from .metrics import KvEventsInfo
from .wire import PartialPageFilter, SglangDecoder


class _DecodeStats:
    """The subset of the vLLM decoder's stats the subscriber reads."""

    def __init__(self, decoder: SglangDecoder) -> None:
        self._decoder = decoder

    @property
    def last_error(self) -> str:
        return self._decoder.last_error

    def as_dict(self) -> dict[str, Any]:
        return self._decoder.stats()

    def drops(self) -> dict[str, int]:
        return dict(self._decoder.drops)


class SglangBatchDecoder:
    """Adapts ``SglangDecoder`` to the batch-decoder interface ``VllmSubscriber`` drives."""

    def __init__(self, worker_id: str, page_size: int) -> None:
        self.decoder = SglangDecoder(worker_id, page_size)
        self.stats = _DecodeStats(self.decoder)

    def decode(self, payload: bytes | memoryview, dp_rank: int = 0) -> DecodedBatch | None:
        before = sum(self.decoder.drops.values())
        decoded = self.decoder.decode_items(bytes(payload), dp_rank=dp_rank)
        if decoded is None:
            return None
        rank, items = decoded
        dropped = sum(self.decoder.drops.values()) - before
        # PartialPages markers ride along as events; the worker's filter consumes them
        return DecodedBatch(ts=0.0, dp_rank=rank, events=items, dropped=dropped)  # type: ignore[arg-type]


class SglangSubscriber(VllmSubscriber):
    """``VllmSubscriber`` whose streams decode SGLang payloads at the source's page size."""

    def _add(self, src: EventSource) -> None:
        super()._add(src)
        stream = self._streams[(src.worker_id, src.dp_rank)]
        stream.decoder = SglangBatchDecoder(src.worker_id, src.block_size)  # type: ignore[assignment]


def filtered_sink(deliver: Callable[[list[KvEvent]], Any]) -> Callable[[list[Any]], None]:
    """A subscriber sink for one worker: partial pages filtered, consecutive removes gathered
    (as ``SglangDecoder.decode`` does), then ``deliver(events)``."""
    partial = PartialPageFilter()

    def sink(items: list[Any]) -> None:
        events = coalesce_removes(partial.apply(items))
        if events:
            deliver(events)

    sink.partial_filter = partial  # type: ignore[attr-defined]
    return sink


def sources_from_info(
    worker_id: str, info: KvEventsInfo, sink: Callable[[list[Any]], Any], dp_start: int = 0
) -> list[EventSource]:
    """One source per DP rank of a discovered publisher; kvplug dials each (SGLang's rule)."""
    out = []
    for rank in range(dp_start, dp_start + info.dp_size):
        # "*" tells the vLLM subscriber that the engine binds: kvplug connects to engine_host
        out.append(
            EventSource(
                worker_id=worker_id,
                endpoint=f"tcp://*:{info.port_base + rank}",
                replay_endpoint=(
                    None
                    if info.replay_port_base is None
                    else f"tcp://*:{info.replay_port_base + rank}"
                ),
                sink=sink,
                topic=info.topic,
                dp_rank=rank,
                engine_host=info.host,
                block_size=info.block_size,
            )
        )
    return out

"""Simulated SGLang and TensorRT-LLM engines for mixed-fleet tests: each speaks its engine's
own event source, so one ``kvplug serve`` indexes all kinds through their real adapters.

* ``SglangSim``: OpenAI completions, ``/server_info`` with the ``kv_events`` descriptor
  (sglang ≥ 0.5.20: ``endpoint_port_base``, ``topic``, ``block_size`` = page size), ``/v1/loads``
  (sglang's shape), and a ZMQ PUB sending ``[topic, seq, KVEventBatch]`` frames encoded by
  ``kvplug.integrations.sglang.wire.encode_batch`` (the 0.5.23 map form, int64 hashes);
* ``TrtllmSim``: OpenAI completions, a draining ``POST /kv_cache_events`` (a ``created`` event,
  then ``stored`` events in ``KVCacheEventSerializer``'s JSON, as in
  ``tests/data/trtllm/v1_events.json``) and ``/prometheus/metrics`` (``trtllm_*`` gauges,
  ``trtllm_kv_cache_tokens_per_block`` among them).

Prompts are token ids (no tokenizer to agree on); the full blocks of every prompt enter the
simulated prefix cache (chained hashes) and are announced once. ``EngineThread`` runs them on
an event loop of their own, for tests that are not async.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from typing import Any

import zmq
from aiohttp import web
from kvplug.integrations.sglang.wire import encode_batch
from kvplug.integrations.trtllm.events import stored_event_data

from kvplug.events import BlockStored
from kvplug.testing import free_ports


def _hash(parent: int | None, tokens: list[int]) -> int:
    """A chained 63-bit block hash (SGLang's hashes are int64; TRT-LLM's uint64)."""
    h = hashlib.blake2b(repr((parent, tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


class _SimEngine:
    """The OpenAI side and the simulated prefix cache both kinds share."""

    kind = ""

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.cached: dict[int, int | None] = {}  # hash -> parent
        self.requests = 0
        self.url = ""
        self.runner: web.AppRunner | None = None

    def _new_blocks(self, tokens: list[int]) -> tuple[int | None, list[tuple[int, list[int]]]]:
        """The prompt's full blocks not cached yet: (parent of the first, [(hash, tokens)])."""
        parent: int | None = None
        first_parent: int | None = None
        new: list[tuple[int, list[int]]] = []
        for i in range(len(tokens) // self.block_size):
            block = tokens[i * self.block_size : (i + 1) * self.block_size]
            h = _hash(parent, block)
            if h not in self.cached:
                if not new:
                    first_parent = parent
                self.cached[h] = parent
                new.append((h, block))
            elif new:  # a cached block after new ones: cannot happen in a prefix cache
                break
            parent = h
        return first_parent, new

    def publish(self, parent: int | None, blocks: list[tuple[int, list[int]]]) -> None:
        raise NotImplementedError

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return web.json_response(
                {"error": {"message": "this simulated engine takes token id prompts"}}, status=400
            )
        self.requests += 1
        parent, new = self._new_blocks(prompt)
        if new:
            self.publish(parent, new)
        n = int(body.get("max_tokens") or 1)
        return web.json_response(
            {
                "id": f"cmpl-{self.kind}-{self.requests}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": " x" * n, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n,
                    "total_tokens": len(prompt) + n,
                },
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)

    async def start(self) -> _SimEngine:
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class SglangSim(_SimEngine):
    kind = "sglang"

    def __init__(self, model: str, block_size: int, topic: str = "kv") -> None:
        super().__init__(model, block_size)
        self.topic = topic
        (self.events_port,) = free_ports(1)
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        self.seq = 0

    def publish(self, parent: int | None, blocks: list[tuple[int, list[int]]]) -> None:
        event = BlockStored(
            worker_id=self.kind,
            engine_hashes=[h for h, _ in blocks],
            parent_engine_hash=parent,
            token_ids=[t for _, block in blocks for t in block],
            block_size=self.block_size,
        )
        payload = encode_batch([event], "0.5.23", ts=time.time())
        self.pub.send_multipart([self.topic.encode(), self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model,
                "page_size": self.block_size,
                "dp_size": 1,
                "version": "0.5.23",
                "kv_events": {
                    "publisher": "zmq",
                    "endpoint_host": "*",
                    "endpoint_port_base": self.events_port,
                    "topic": self.topic,
                    "block_size": self.block_size,
                    "dp_size": 1,
                },
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        used = len(self.cached) * self.block_size
        return web.json_response(
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": 0,
                        "num_waiting_reqs": 0,
                        "num_used_tokens": used,
                        "max_total_num_tokens": 1 << 20,
                        "token_usage": used / (1 << 20),
                    }
                ]
            }
        )

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/v1/loads", self.loads)

    async def stop(self) -> None:
        await super().stop()
        self.pub.close(0)


class TrtllmSim(_SimEngine):
    kind = "trtllm"

    def __init__(self, model: str, block_size: int, window: int = 4096) -> None:
        super().__init__(model, block_size)
        self.window = window
        self.next_id = 0
        self.queue: list[dict[str, Any]] = []
        self._event({"type": "created", "num_blocks_per_cache_level": [1024, 0]})

    def _event(self, data: dict[str, Any]) -> None:
        self.queue.append({"event_id": self.next_id, "data": data, "window_size": self.window})
        self.next_id += 1

    def publish(self, parent: int | None, blocks: list[tuple[int, list[int]]]) -> None:
        self._event(stored_event_data(parent, blocks))

    async def kv_cache_events(self, request: web.Request) -> web.Response:
        drained, self.queue = self.queue, []  # TRT-LLM drains: one reader per worker
        return web.Response(body=json.dumps(drained).encode(), content_type="application/json")

    async def prometheus(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{self.model}",engine_type="trtllm"}}'
        values = {
            "trtllm_num_requests_running": 0.0,
            "trtllm_num_requests_waiting": 0.0,
            "trtllm_kv_cache_utilization": len(self.cached) / 1024,
            "trtllm_kv_cache_tokens_per_block": float(self.block_size),
            "trtllm_kv_cache_max_blocks": 1024.0,
        }
        text = "".join(f"# TYPE {k} gauge\n{k}{labels} {v}\n" for k, v in values.items())
        return web.Response(text=text, content_type="text/plain")

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_post("/kv_cache_events", self.kv_cache_events)
        app.router.add_get("/prometheus/metrics", self.prometheus)


class EngineThread:
    """Simulated engines served from a thread with its own event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines: list[_SimEngine] = []

    def start(self, engine: _SimEngine) -> _SimEngine:
        asyncio.run_coroutine_threadsafe(engine.start(), self.loop).result(30)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for e in self.engines:
            asyncio.run_coroutine_threadsafe(e.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

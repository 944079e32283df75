"""The simulator's server face: each simulated engine looks like a ``vllm serve`` process.

* OpenAI-compatible HTTP (aiohttp): ``/v1/completions``, ``/v1/chat/completions`` (streaming
  SSE or not), ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, ``/version``,
  vLLM-named ``/metrics`` and ``/kv_event_sources``;
* KV events in vLLM's wire format over ZMQ PUB (sequence numbers, replay ROUTER endpoint), via
  the vLLM integration's publisher and encoder;
* the same engine model as the virtual replay (``SimEngine``), stepped in wall time: a step of
  ``d`` modelled seconds takes ``d / speed`` wall seconds.

Tokenisation is byte-level (token id = UTF-8 byte; chat messages rendered as
``<|role|>content\\n`` then ``<|assistant|>``), exposed at ``/tokenize`` so a router can hash the
same tokens the engine reports in its events. Generated text is deterministic filler.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from kvplug.events import BlockMoved, BlockStored, KvEvent
from kvplug.sim.engine import EngineConfig, SimEngine, SimRequest
from kvplug.sim.steptime import REFERENCE, StepTimeModel, capacity_blocks, engine_model
from kvplug.sim.traces import output_tokens
from kvplug.sim.vllm_hashes import DEFAULT_SEED, VllmBlockHasher, low64

log = logging.getLogger("kvplug.sim.server")

MAX_MODEL_LEN = 131_072
WORDS = (
    "the", "cache", "router", "prefix", "block", "token", "engine", "fast", "warm", "hit",
    "decode", "prefill", "batch", "step", "queue", "load",
)  # fmt: skip


def render_chat(messages: Any) -> str:
    """The simulator's chat template. ValueError on a malformed message list."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] needs a role")
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be text")
        parts.append(f"<|{m['role']}|>{content}\n")
    return "".join(parts) + "<|assistant|>"


def tokenize_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tokens_of_prompt(prompt: Any) -> list[int]:
    """OpenAI ``prompt``: a string or a list of token ids (one prompt only)."""
    if isinstance(prompt, str):
        return tokenize_text(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return tokens_of_prompt(prompt[0])
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if any(t < 0 or t >= 1 << 32 for t in prompt):
            raise ValueError("token ids must be in [0, 2**32)")
        return list(prompt)
    raise ValueError("prompt must be a string or a list of token ids")


def detokenize(tokens: list[int]) -> str:
    return bytes(t & 0xFF for t in tokens).decode("utf-8", errors="replace")


def output_text(tokens: np.ndarray) -> list[str]:
    return [WORDS[int(t) % len(WORDS)] + " " for t in tokens]


def chained_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The simulated engine's own block hashes (opaque u64, chained like vLLM's)."""
    out = []
    prev = b"kvplug-sim"
    arr = np.asarray(tokens, dtype=np.uint32)
    for i in range(len(tokens) // block_size):
        d = hashlib.blake2b(
            prev + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=8
        )
        prev = d.digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def _zmq_host(host: str) -> str:
    """--host as a ZMQ bind address: a wildcard is ``*``, an IPv6 literal goes in brackets."""
    if host in ("", "0.0.0.0", "::", "*"):
        return "*"
    return f"[{host}]" if ":" in host else host


@dataclass
class FleetOptions:
    engines: int = 2
    host: str = "127.0.0.1"
    base_port: int = 8100
    events_base_port: int = 9100
    replay_base_port: int = 10100
    events_connect: str | None = None
    topic: str = ""  # vLLM's default (KVEventsConfig.topic); vllm-router's static sources expect it
    vllm_version: str = "0.32"
    block_size: int = 16
    capacity_blocks: int | None = None
    host_blocks: int = 0
    max_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # vLLM's flag of that name (0 = off)
    long_prefill_token_threshold_adaptive: bool = False  # vLLM's flag of that name
    kv_allocation: str = "reserve"  # EngineConfig.kv_allocation: "reserve" or "vllm"
    host_offload: str = "evicted"  # EngineConfig.host_offload: "evicted" or "stored"
    speed: float = 1.0
    model: str = "sim-llama-3-8b"
    # "sim": the simulator's own blake2b chain; "vllm": vLLM's block hashes (hash_algo, with
    # NONE_HASH from the engine's seed: one seed for all engines or one per engine)
    block_hashes: str = "sim"
    hash_algo: str = "sha256"  # vLLM's default --prefix-caching-hash-algo
    hash_seeds: tuple[str, ...] = field(default=(DEFAULT_SEED,))
    # how events carry a vLLM hash: "uint64" (low 64 bits, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1,
    # vLLM's default) or "bytes" (the 32-byte digest)
    hash_form: str = "uint64"
    # a mixed fleet: engine i's step times are the model's times slowdowns[i % len] (empty: alike)
    slowdowns: tuple[float, ...] = ()

    def model_of(self, index: int) -> StepTimeModel:
        """Engine ``index``'s step-time model: the reference, scaled in a mixed fleet."""
        return engine_model(REFERENCE, self.slowdowns, index)

    def seed_of(self, index: int) -> str:
        return self.hash_seeds[index] if len(self.hash_seeds) > 1 else self.hash_seeds[0]


class _Stream:
    """What one HTTP request waits on: the engine's progress on its SimRequest."""

    __slots__ = ("req", "sent", "wake", "done")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.sent = 0
        self.wake = asyncio.Event()
        self.done = False


def _to_vllm_events(events: list[KvEvent]) -> list[KvEvent]:
    """vLLM has no move event: a tier move is a store on the new tier and a removal on the old,
    as offloading connectors publish it (stores without tokens, resolved by engine hash)."""
    from kvplug.events import BlockRemoved

    out: list[KvEvent] = []
    for ev in events:
        if isinstance(ev, BlockMoved):
            out.append(
                BlockStored(
                    worker_id=ev.worker_id,
                    dp_rank=ev.dp_rank,
                    tier=ev.to_tier,
                    engine_hashes=ev.engine_hashes,
                    tier_copy=True,
                )
            )
            out.append(
                BlockRemoved(
                    worker_id=ev.worker_id,
                    dp_rank=ev.dp_rank,
                    tier=ev.from_tier,
                    engine_hashes=ev.engine_hashes,
                )
            )
        else:
            out.append(ev)
    return out


class SimServer:
    """One simulated engine: HTTP app + event publisher + the stepping task."""

    def __init__(self, index: int, opts: FleetOptions) -> None:
        from kvplug.integrations.vllm.publisher import VllmEventPublisher

        self.index = index
        self.opts = opts
        self.worker_id = f"sim-{index}"
        cap = opts.capacity_blocks or capacity_blocks(opts.block_size)
        self.engine = SimEngine(
            self.worker_id,
            EngineConfig(
                block_size=opts.block_size,
                capacity_blocks=cap,
                host_capacity_blocks=opts.host_blocks,
                max_batched_tokens=opts.max_batched_tokens,
                long_prefill_token_threshold=opts.long_prefill_token_threshold,
                long_prefill_token_threshold_adaptive=opts.long_prefill_token_threshold_adaptive,
                kv_allocation=opts.kv_allocation,
                host_offload=opts.host_offload,
                events_with_tokens=True,
                fast_forward=False,
                model=opts.model_of(index),
            ),
        )
        self.port = opts.base_port + index
        self.topic = opts.topic
        # the sockets bind on --host only; what /v1/kv_events_sources advertises is vLLM's
        # wildcard form ("the engine binds; connect to its host"), as a real engine reports it
        bind_host = _zmq_host(opts.host)
        events_port = opts.events_base_port + index
        replay_port = opts.replay_base_port + index
        if opts.events_connect:
            # every engine connects to one router-bound SUB: the topic tells them apart
            self.endpoint = opts.events_connect
            self.topic = f"{opts.topic}.{self.worker_id}" if opts.topic else self.worker_id
            pub_bind = None
        else:
            self.endpoint = f"tcp://*:{events_port}"
            pub_bind = f"tcp://{bind_host}:{events_port}"
        self.replay_endpoint = f"tcp://*:{replay_port}"
        self.bound = [pub_bind or self.endpoint, f"tcp://{bind_host}:{replay_port}"]
        self.hasher: VllmBlockHasher | None = None
        if opts.block_hashes == "vllm":
            self.hasher = VllmBlockHasher(opts.hash_algo, opts.seed_of(index))
        elif opts.block_hashes != "sim":
            raise ValueError(f"block_hashes must be sim or vllm, not {opts.block_hashes!r}")
        # the engine keys blocks by the digest's low 64 bits; events in the bytes form need the
        # whole digest back: kept for the most recently used blocks (a cache-sized window)
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        self._digest_window = 4 * (cap + opts.host_blocks) + 65_536
        self.publisher = VllmEventPublisher(
            pub_bind or self.endpoint,
            replay_endpoint=self.bound[1],
            topic=self.topic,
            version=opts.vllm_version,
            bind=True if pub_bind else None,
            hash_form=opts.hash_form if self.hasher is not None else "uint64",
        )
        self.streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._wall0 = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self.counters = {
            "requests": 0,
            "bad_requests": 0,
            "event_batches": 0,
            "aborted": 0,
            "engine_errors": 0,
            "digest_fallbacks": 0,
        }
        self.runner: web.AppRunner | None = None

    # -- time ------------------------------------------------------------------------------------
    def virtual_now(self) -> float:
        return (time.monotonic() - self._wall0) * self.opts.speed

    # -- engine loop -----------------------------------------------------------------------------
    async def run_engine(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                eng.step()
            except Exception:  # a model bug must not hang every open request: fail them all
                log.exception("%s: engine step failed; aborting in-flight requests", self.worker_id)
                self.counters["engine_errors"] += 1
                for req in [*eng.waiting, *eng.prefilling, *eng.decoding]:
                    try:
                        eng.abort(req, eng.now)
                    except Exception:
                        log.exception("%s: abort of %s failed", self.worker_id, req.request_id)
                eng.waiting.clear()
                eng.prefilling.clear()
                eng.decoding.clear()
                self._dispatch()
                continue
            delay = self._wall0 + eng.now / self.opts.speed - time.monotonic()
            await asyncio.sleep(max(0.0, delay))
            self._dispatch()

    async def serve_replay(self) -> None:
        while True:
            self.publisher.serve_replay()
            await asyncio.sleep(0.02)

    def _dispatch(self) -> None:
        eng = self.engine
        events: list[KvEvent] = []
        for kind, _t, payload in eng.outputs:
            if kind == "kv":
                events.append(payload)
            elif kind == "finish":
                st = self.streams.get(payload.request_id)
                if st is not None:
                    st.done = True
                    st.wake.set()
        eng.outputs.clear()
        if events:
            out = _to_vllm_events(events)
            if self.hasher is not None and self.opts.hash_form == "bytes":
                out = [self._with_digests(ev) for ev in out]
            self.publisher.publish(out, ts=time.time())
            self.counters["event_batches"] += 1
        for st in self.streams.values():
            if st.req.generated > st.sent:
                st.wake.set()

    def _digest(self, h: int) -> bytes:
        d = self._digests.get(int(h))
        if d is None:
            # a block of generated tokens (request-unique in the simulator, never a prefix hit):
            # a stand-in digest with the same low 64 bits, so every consumer folds it alike
            self.counters["digest_fallbacks"] += 1
            d = hashlib.sha256(int(h).to_bytes(8, "big")).digest()[:24] + int(h).to_bytes(8, "big")
        return d

    def _with_digests(self, ev: KvEvent) -> KvEvent:
        hashes = getattr(ev, "engine_hashes", None)
        if not hashes:
            return ev
        changes: dict[str, Any] = {"engine_hashes": [self._digest(h) for h in hashes]}
        parent = getattr(ev, "parent_engine_hash", None)
        if parent is not None:
            changes["parent_engine_hash"] = self._digest(parent)
        return msgspec.structs.replace(ev, **changes)

    def block_hashes_of(self, tokens: list[int]) -> list[int]:
        """The engine's block hashes of a prompt, as its cache and its events key them."""
        bs = self.opts.block_size
        if self.hasher is None:
            return chained_block_hashes(tokens, bs)
        digests = self.hasher.hashes(tokens, bs)
        out = [low64(d) for d in digests]
        if self.opts.hash_form != "bytes":
            return out
        for h, d in zip(out, digests, strict=True):
            self._digests[h] = d
            self._digests.move_to_end(h)
        while len(self._digests) > self._digest_window:
            self._digests.popitem(last=False)
        return out

    # -- requests --------------------------------------------------------------------------------
    def _submit(self, request_id: str, tokens: list[int], max_tokens: int) -> _Stream:
        if not tokens:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(tokens) + max_tokens > MAX_MODEL_LEN:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"maximum context length {MAX_MODEL_LEN}"
            )
        if request_id in self.streams:
            raise ValueError(f"request id {request_id} is already running")
        salt = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")
        req = SimRequest(
            request_id=request_id,
            arrival=self.virtual_now(),
            prompt_len=len(tokens),
            output_len=max_tokens,
            block_hashes=self.block_hashes_of(tokens),
            token_ids=np.asarray(tokens, dtype=np.uint32),
            salt=salt,
        )
        st = _Stream(req)
        self.streams[request_id] = st
        self.engine.add_request(req, req.arrival)
        if req.rejected:
            del self.streams[request_id]
            out = self.engine.outputs
            out[:] = [o for o in out if o[2] is not req]
            raise ValueError(req.rejected)
        self.counters["requests"] += 1
        self._wake.set()
        return st

    async def _tokens(self, st: _Stream):
        """Yield lists of newly generated text pieces until the request finishes."""
        try:
            while True:
                await st.wake.wait()
                st.wake.clear()
                n = st.req.generated
                if n > st.sent:
                    toks = output_tokens(st.req.salt, st.sent, n - st.sent)
                    st.sent = n
                    yield output_text(toks)
                if st.done:
                    return
        finally:
            self.streams.pop(st.req.request_id, None)
            if not st.done:  # the client went away mid-request: free the engine, as vLLM aborts
                self.engine.abort(st.req, self.virtual_now())
                self.counters["aborted"] += 1

    # -- HTTP ------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_post("/v1/chat/completions", self.h_chat)
        app.router.add_post("/tokenize", self.h_tokenize)
        app.router.add_post("/detokenize", self.h_detokenize)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/version", self.h_version)
        app.router.add_get("/metrics", self.h_metrics)
        app.router.add_get("/kv_event_sources", self.h_sources)
        return app

    def _error(self, status: int, msg: str) -> web.Response:
        self.counters["bad_requests"] += 1
        return web.json_response(
            {"error": {"message": msg, "type": "BadRequestError", "code": status}}, status=status
        )

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        return body

    def _request_id(self, request: web.Request, prefix: str) -> str:
        return request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def _max_tokens(body: dict, default: int) -> int:
        v = body.get("max_completion_tokens", body.get("max_tokens", default))
        if v is None:
            v = default
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError("max_tokens must be an integer")
        return v

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            if body.get("n", 1) != 1:
                raise ValueError("only n=1 is supported")
            if chat:
                tokens = tokenize_text(render_chat(body.get("messages")))
                max_tokens = self._max_tokens(body, 64)
            else:
                if "prompt" not in body:
                    raise ValueError("prompt is required")
                tokens = tokens_of_prompt(body["prompt"])
                max_tokens = self._max_tokens(body, 16)
            rid = self._request_id(request, "chatcmpl" if chat else "cmpl")
            st = self._submit(rid, tokens, max_tokens)
        except ValueError as exc:
            return self._error(400, str(exc))
        created = int(time.time())
        model = body.get("model") or self.opts.model
        obj = "chat.completion" if chat else "text_completion"
        kv_params = self._kv_transfer_params(body, rid)

        def usage() -> dict:
            req = st.req
            return {
                "prompt_tokens": req.prompt_len,
                "completion_tokens": req.generated,
                "total_tokens": req.prompt_len + req.generated,
                "prompt_tokens_details": {
                    "cached_tokens": (req.hit_device + req.hit_host) * self.opts.block_size
                },
            }

        def finish_reason() -> str:
            return "abort" if st.req.rejected else "length"  # the simulator never samples EOS

        if body.get("stream"):
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": rid,
                }
            )
            await resp.prepare(request)
            first = True
            async for pieces in self._tokens(st):
                for piece in pieces:
                    if chat:
                        delta: dict[str, Any] = {"content": piece}
                        if first:
                            delta["role"] = "assistant"
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece, "finish_reason": None}
                    first = False
                    chunk = {
                        "id": rid,
                        "object": obj + ".chunk" if chat else obj,
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            final_choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason()}
            if chat:
                final_choice["delta"] = {}
            else:
                final_choice["text"] = ""
            final = {
                "id": rid,
                "object": obj + ".chunk" if chat else obj,
                "created": created,
                "model": model,
                "choices": [final_choice],
            }
            if (body.get("stream_options") or {}).get("include_usage"):
                final["usage"] = usage()
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = []
        async for pieces in self._tokens(st):
            text.extend(pieces)
        content = "".join(text)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason(),
            }
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish_reason()}
        out = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(),
        }
        if kv_params is not None:
            out["kv_transfer_params"] = kv_params
        return web.json_response(out, headers={"X-Request-Id": rid})

    def _kv_transfer_params(self, body: dict, rid: str) -> dict | None:
        """P/D shape only: a prefill request (``do_remote_decode``) answers with the params a
        decode engine would pull with. The simulator transfers nothing: the decode engine
        recomputes the prompt (stated in docs/sim.md)."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.worker_id,
            "remote_request_id": rid,
            "remote_block_ids": [],
            "remote_host": self.opts.host,
            "remote_port": self.port,
        }

    async def h_tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            if "messages" in body:
                tokens = tokenize_text(render_chat(body["messages"]))
            elif isinstance(body.get("prompt"), str):
                tokens = tokenize_text(body["prompt"])
            else:
                raise ValueError("give prompt (string) or messages")
        except ValueError as exc:
            return self._error(400, str(exc))
        return web.json_response(
            {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}
        )

    async def h_detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = tokens_of_prompt(body.get("tokens"))
        except ValueError as exc:
            return self._error(400, str(exc))
        return web.json_response({"prompt": detokenize(tokens)})

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.opts.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "kvplug-sim",
                        "root": self.opts.model,
                        "parent": None,
                        "max_model_len": MAX_MODEL_LEN,
                    }
                ],
            }
        )

    async def h_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def h_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.opts.vllm_version, "engine": "kvplug-sim"})

    def _hash_algo_label(self) -> str:
        return self.opts.hash_algo if self.hasher is not None else "kvplug-sim-blake2b"

    async def h_sources(self, request: web.Request) -> web.Response:
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.publisher.buffer.maxlen,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": self.topic,
        }
        return web.json_response({"0": cfg})

    async def h_metrics(self, request: web.Request) -> web.Response:
        e = self.engine
        st = e.stats
        labels = f'engine="0",model_name="{self.opts.model}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {e.num_running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {e.num_waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {e.kv_usage():.6f}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {st['prompt_tokens']}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {st['cached_tokens']}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {st['prompt_tokens']}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {st['generated_tokens']}",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {st['preemptions']}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.opts.block_size}",enable_prefix_caching="True",'
            f'effective_attention_block_size="{self.opts.block_size}",'
            f'num_gpu_blocks="{e.cache.capacity}",num_cpu_blocks="{e.cache.host_capacity}",'
            f'prefix_caching_hash_algo="{self._hash_algo_label()}",{labels}}} 1.0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._wall0 = time.monotonic()
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.opts.host, self.port)
        await site.start()
        self._tasks = [
            asyncio.create_task(self.run_engine()),
            asyncio.create_task(self.serve_replay()),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        if self.runner is not None:
            await self.runner.cleanup()
        self.publisher.close()


async def start_fleet(opts: FleetOptions) -> list[SimServer]:
    servers = []
    try:
        for i in range(opts.engines):
            s = SimServer(i, opts)
            servers.append(s)
            await s.start()
    except BaseException:
        for s in servers:
            await s.stop()
        raise
    return servers


def describe(servers: list[SimServer]) -> str:
    lines = []
    for s in servers:
        lines.append(
            f"{s.worker_id}: http://{s.opts.host}:{s.port}  events {s.bound[0]} topic "
            f"{s.topic!r}  replay {s.bound[1]}  block size {s.opts.block_size}, "
            f"{s.engine.cache.capacity} blocks"
        )
    return "\n".join(lines)


def run_fleet(opts: FleetOptions) -> None:
    async def main() -> None:
        servers = await start_fleet(opts)
        print(describe(servers), flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            for s in servers:
                await s.stop()

    asyncio.run(main())

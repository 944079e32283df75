"""A small in-process OpenAI-compatible engine, for tests and benchmarks of the frontend.

It is not a simulator (see ``kvplug.sim`` for that): it answers at once (or with a fixed delay
per token) and records what it was sent. What it does for real:

* ``/v1/completions`` and ``/v1/chat/completions``, streamed (SSE in vLLM's chunk shapes, with
  ``stream_options.include_usage``) or not; ``/v1/models``, ``/health``, ``/tokenize``;
* a prefix cache: the full blocks of each prompt become held blocks, published as kvplug
  ``BlockStored`` events (engine hashes chained from the parent, token ids included) to its
  listeners - the frontend's ``stub`` adapter hands them to ``Router.apply_event``;
* the P/D handshakes: vLLM NIXL pull mode (the prefill stub answers with
  ``kv_transfer_params``; the decode stub refuses a request without them, or whose
  ``remote_request_id`` differs from its ``X-Request-Id``, and "pulls" the blocks from the
  shared ``TransferBoard``) and SGLang bootstrap (both hops carry the same
  ``bootstrap_room``; the decode stub waits for its prefill partner on the board);
* batches as vLLM answers them: ``prompt`` as a list of prompts, ``n`` choices each, choice
  ``j`` of prompt ``i`` numbered ``i * n + j`` (streamed: a step's chunks prompt by prompt),
  usage summed; ``tag_text = True`` makes each choice's text name its prompt and choice;
* failures on demand: ``fail = "reset"`` (connection closed before any byte), ``"midstream"``
  (closed after two chunks), ``"http500"``, ``"empty503"`` (a 503 without a body, as a
  restarting engine's own server may answer), ``"http400"``, ``"hang"`` (never answers),
  ``"trickle"`` (a 200 JSON answer that sends one space every ``trickle_interval`` seconds and
  never ends), ``"unhealthy"`` (``/health`` answers 503); ``cancelled`` counts the requests
  whose connection kvplug closed before the answer was done.

Tokenizer: one token per Unicode code point; chat renders ``role: content`` lines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from kvplug.adapters import SglangHttpAdapter, VllmHttpAdapter, register_adapter
from kvplug.events import BlockStored


def stub_tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def stub_render_chat(messages: list[dict[str, Any]]) -> str:
    return "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant: "


class TransferBoard:
    """Where prefill stubs leave KV "transfers" and decode stubs pull them (NIXL / bootstrap)."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str], list[int]] = {}
        self.rooms: dict[int, asyncio.Future] = {}
        self.pulled = 0

    def room(self, room: int) -> asyncio.Future:
        fut = self.rooms.get(room)
        if fut is None:
            fut = self.rooms[room] = asyncio.get_running_loop().create_future()
        return fut


_MAX_N = 16
_MAX_OUTPUT_TOKENS = 4096


def _bounded_int(value: Any, name: str, lo: int, hi: int) -> None:
    if value is not None and (type(value) is not int or not lo <= value <= hi):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r:.50}")


def _check_body(body: Any, chat: bool) -> None:
    """The fields the stub reads, checked as vLLM's pydantic models would (ValueError)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects")
    else:
        prompt = body["prompt"]
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and (
                all(type(t) is int for t in prompt)
                or all(isinstance(p, str) for p in prompt)
                or all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt)
            )
        )
        if not ok:
            raise ValueError("prompt must be a string, token ids, strings or token-id lists")
    _bounded_int(body.get("n"), "n", 1, _MAX_N)
    for name in ("max_tokens", "max_completion_tokens"):
        _bounded_int(body.get(name), name, 0, _MAX_OUTPUT_TOKENS)
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise ValueError("stream must be a boolean")
    for name in ("kv_transfer_params", "stream_options"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise ValueError(f"{name} must be an object")


class StubEngine:
    def __init__(
        self,
        worker_id: str,
        *,
        block_size: int = 16,
        output_tokens: int = 8,
        token_delay: float = 0.0,
        role: str = "both",
        pd: str = "vllm",
        model: str = "stub-model",
        board: TransferBoard | None = None,
        tokens_per_chunk: int = 1,
        tag_text: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.output_tokens = output_tokens
        self.token_delay = token_delay
        self.role = role
        self.pd = pd
        self.model = model
        self.board = board or TransferBoard()
        self.tokens_per_chunk = tokens_per_chunk
        self.fail: str | None = None
        self.tag_text = tag_text  # output text names the prompt and choice it answers
        self.gate: asyncio.Event | None = None  # when set: requests wait for it once recorded
        # EOS as output token number eos_at (finish_reason "stop"); a prefill stub then hands
        # off no KV, as vLLM's NixlConnector does for a request that was not length-capped
        self.eos_at: int | None = None
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body"}
        self.sent: dict[str, bytes] = {}  # X-Request-Id -> the exact body bytes written
        self.record_sent = True  # benchmarks turn recording off
        self.record_requests = True
        self.held: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, block) -> hash
        self.track_cache = True  # benchmarks turn the prefix cache off
        self.listeners: list[Callable[[list], None]] = []
        self.running = 0
        self.has_tokenize = True  # False: /tokenize answers 404, as engines without it do
        self.trickle_interval = 0.05
        self.cancelled = 0  # requests whose client (kvplug) hung up before the answer ended
        self.tokenize_delay = 0.0
        self.tokenize_calls = 0
        self.tokenize_auth: list[str | None] = []  # each /tokenize call's Authorization
        self.tokenize_running = 0
        self.tokenize_peak = 0  # most /tokenize calls at once
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_get("/metrics", self._metrics)

    # -- server ---------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # handler_cancellation: a request kvplug abandons is cancelled here, as vLLM aborts it
        self._runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True, backlog=1024)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- cache and events -----------------------------------------------------------------
    def _store_prefix(self, tokens: list[int]) -> int:
        """Hold the prompt's full blocks; publish the new ones. Returns blocks already held.

        A block is keyed by (its parent's engine hash, its tokens), so its hash names the
        whole prefix - as in vLLM - at O(prompt) cost.
        """
        if not self.track_cache:
            return 0
        bs = self.block_size
        hit = 0
        parent = 0
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        first_parent: int | None = None
        for i in range(len(tokens) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            key = (parent, block)
            ehash = self.held.get(key)
            if ehash is not None and not new_hashes:
                hit += 1
                parent = ehash
                continue
            if ehash is None:
                digest = hashlib.blake2b(repr((self.worker_id, key)).encode(), digest_size=8)
                ehash = int.from_bytes(digest.digest(), "little") >> 1
                self.held[key] = ehash
            if not new_hashes:
                first_parent = parent if i > 0 else None
            new_hashes.append(ehash)
            new_tokens.extend(block)
            parent = ehash
        if new_hashes and self.listeners:
            event = BlockStored(
                worker_id=self.worker_id,
                parent_engine_hash=first_parent,
                engine_hashes=new_hashes,
                token_ids=new_tokens,
                block_size=bs,
            )
            for listener in self.listeners:
                listener([event])
        return hit

    # -- handlers -------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self.fail == "unhealthy":
            return web.Response(status=503)
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "stub"}]}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        text = f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {self.running}\n'
        return web.Response(text=text)

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        self.tokenize_auth.append(request.headers.get("Authorization"))
        if not self.has_tokenize:
            raise web.HTTPNotFound()
        self.tokenize_running += 1
        self.tokenize_peak = max(self.tokenize_peak, self.tokenize_running)
        try:
            if self.tokenize_delay:
                await asyncio.sleep(self.tokenize_delay)
            return await self._tokenize_now(request)
        finally:
            self.tokenize_running -= 1

    async def _tokenize_now(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            tokens = stub_tokenize(stub_render_chat(body["messages"]))
        else:
            tokens = stub_tokenize(body.get("prompt", ""))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _error(self, status: int, message: str) -> web.Response:
        return web.json_response(
            {"error": {"message": message, "type": "BadRequestError", "code": status}},
            status=status,
        )

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            return await self._generate_or_fail(request, chat)
        except asyncio.CancelledError:
            if self.fail != "reset":  # a reset is the stub's own doing
                self.cancelled += 1
            raise

    async def _generate_or_fail(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            _check_body(body, chat)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
            # as vLLM's request validation answers a malformed body
            return self._error(400, f"invalid request: {type(exc).__name__}: {exc}"[:500])
        if self.record_requests:
            self.requests.append(
                {"path": request.path, "headers": CIMultiDict(request.headers), "body": body}
            )
        if self.gate is not None:
            await self.gate.wait()
        if self.fail == "reset":
            request.transport.close()  # type: ignore[union-attr]
            raise asyncio.CancelledError  # nothing may be written any more
        if self.fail == "http500":
            return self._error(500, "stub engine failure")
        if self.fail == "empty503":
            return web.Response(status=503)
        if self.fail == "hang":
            await asyncio.Event().wait()
        if self.fail == "trickle":  # alive by every per-read timeout, never done
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            while True:
                await resp.write(b" ")
                await asyncio.sleep(self.trickle_interval)
        if self.fail == "http400":
            return self._error(400, "stub engine refuses this request")
        if chat:
            batch = [stub_tokenize(stub_render_chat(body["messages"]))]
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                batch = [stub_tokenize(prompt)]
            elif isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
                batch = [prompt]
            else:
                batch = [p if isinstance(p, list) else stub_tokenize(p) for p in prompt]
        tokens = batch[0]
        n_choices = int(body.get("n") or 1)

        kv_params: dict[str, Any] | None = None
        asked = body.get("kv_transfer_params")
        asked = asked if isinstance(asked, dict) else {}
        # a "both" stub plays either part, as vLLM's kv_both connector role does
        if self.role == "prefill" or (self.role == "both" and asked.get("do_remote_decode")):
            check = self._check_prefill(request, body)
            if isinstance(check, web.Response):
                return check
            kv_params = check
        elif self.role == "decode" or (self.role == "both" and asked.get("do_remote_prefill")):
            problem = await self._check_decode(request, body, tokens)
            if problem is not None:
                return self._error(400, problem)

        cached = sum(self._store_prefix(t) for t in batch)
        n_out = int(
            body.get("max_tokens") or body.get("max_completion_tokens") or self.output_tokens
        )
        finish = "length"
        if self.eos_at is not None and self.eos_at <= n_out:
            n_out, finish, kv_params = self.eos_at, "stop", None
        rid = request.headers.get("X-Request-Id", "stub")
        if kv_params is not None:
            self.board.pending[(self.worker_id, rid)] = tokens
        self.running += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, chat, n_out, rid, finish, batch, n_choices)
            if self.token_delay:
                await asyncio.sleep(self.token_delay * n_out)
            choices = []
            for i, prompt_tokens in enumerate(batch):
                for j in range(n_choices):
                    text = self._text(prompt_tokens, j, 0, n_out)
                    choice: dict[str, Any] = {
                        "index": i * n_choices + j,
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                    if chat:
                        choice["message"] = {"role": "assistant", "content": text}
                    else:
                        choice["text"] = text
                    choices.append(choice)
            n_prompt = sum(len(t) for t in batch)
            n_gen = n_out * n_choices * len(batch)
            answer = {
                "id": f"cmpl-{rid}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model", self.model),
                "choices": choices,
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_gen,
                    "total_tokens": n_prompt + n_gen,
                    "prompt_tokens_details": {"cached_tokens": cached * self.block_size},
                },
                "kv_transfer_params": kv_params,
            }
            raw_answer = json.dumps(answer).encode()
            if self.record_sent:
                self.sent[rid] = raw_answer
            if self.fail == "midstream":  # half the body, then the connection drops
                partial = web.StreamResponse(headers={"Content-Type": "application/json"})
                partial.content_length = len(raw_answer)
                await partial.prepare(request)
                await partial.write(raw_answer[: len(raw_answer) // 2])
                request.transport.close()  # type: ignore[union-attr]
                return partial
            return web.Response(body=raw_answer, content_type="application/json")
        finally:
            self.running -= 1

    def _text(self, prompt_tokens: list[int], choice: int, start: int, count: int) -> str:
        """Output tokens ``start .. start+count`` of one choice, as text."""
        if self.tag_text:
            tag = f"{prompt_tokens[0] if prompt_tokens else 0}/{len(prompt_tokens)}/{choice}"
            return "".join(f"t{start + i}@{tag} " for i in range(count))
        return "".join(f"t{start + i} " for i in range(count))

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        chat: bool,
        n_out: int,
        rid: str,
        last_finish: str = "length",
        batch: list[list[int]] | None = None,
        n_choices: int = 1,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        record = self.record_sent
        sent = bytearray()
        if record:
            self.sent[rid] = sent  # type: ignore[assignment]  # grows as chunks are written
        write = resp.write

        async def emit(data: bytes) -> None:
            if record:
                sent.extend(data)
            await write(data)

        created = int(time.time())
        model = body.get("model", self.model)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": f"cmpl-{rid}",
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        batch = batch or [[]]
        if chat:
            for j in range(n_choices):
                await emit(
                    event(
                        [
                            {
                                "index": j,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ]
                    )
                )
        n_sent = 0
        step = max(1, self.tokens_per_chunk)
        while n_sent < n_out:
            if self.fail == "midstream" and n_sent >= 2:
                request.transport.close()  # type: ignore[union-attr]
                return resp
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            k = min(step, n_out - n_sent)
            finish = last_finish if n_sent + k >= n_out else None
            for i, prompt_tokens in enumerate(batch):
                for j in range(n_choices):
                    text = self._text(prompt_tokens, j, n_sent, k)
                    index = i * n_choices + j
                    if chat:
                        choice = {
                            "index": index,
                            "delta": {"content": text},
                            "finish_reason": finish,
                        }
                    else:
                        choice = {
                            "index": index,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    if step > 1:
                        choice["token_ids"] = list(range(n_sent, n_sent + k))
                    await emit(event([choice]))
            n_sent += k
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            n_gen = n_out * n_choices * len(batch)
            n_prompt = sum(len(t) for t in batch)
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen}
            await emit(event([], {**usage, "total_tokens": n_prompt + n_gen}))
        await emit(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- P/D handshakes -------------------------------------------------------------------
    def _check_prefill(self, request: web.Request, body: dict) -> dict | web.Response:
        if self.pd == "sglang":
            if not isinstance(body.get("bootstrap_room"), int):
                return self._error(400, "prefill stub: no bootstrap_room")
            partner = self.board.room(body["bootstrap_room"])
            if not partner.done():
                partner.set_result(self.worker_id)
            return {}
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
            return self._error(400, "prefill stub: kv_transfer_params.do_remote_decode missing")
        if body.get("stream") or body.get("max_tokens") != 1 or "stream_options" in body:
            return self._error(
                400,
                "prefill stub: prefill hop must be stream=false, max_tokens=1, no stream_options",
            )
        rid = request.headers.get("X-Request-Id")
        if not rid:
            return self._error(400, "prefill stub: no X-Request-Id")
        host, port = (self.url or "http://127.0.0.1:0").rsplit(":", 1)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.worker_id,
            "remote_request_id": rid,
            "remote_block_ids": [[1, 2, 3]],
            "remote_host": host.split("//")[-1],
            "remote_port": int(port),
            "tp_size": 1,
        }

    async def _check_decode(
        self, request: web.Request, body: dict, tokens: list[int]
    ) -> str | None:
        if self.pd == "sglang":
            room = body.get("bootstrap_room")
            if not isinstance(room, int):
                return "decode stub: no bootstrap_room"
            try:
                await asyncio.wait_for(asyncio.shield(self.board.room(room)), 5.0)
            except asyncio.TimeoutError:
                return f"decode stub: no prefill partner for room {room}"
            self.board.pulled += 1
            return None
        params = body.get("kv_transfer_params")
        if params is None:
            return None  # a plain request (decode-only fallback): served whole, like vLLM
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return "decode stub: kv_transfer_params are not from a prefill worker"
        rid = request.headers.get("X-Request-Id")
        if params.get("remote_request_id") != rid:
            return (
                f"decode stub: X-Request-Id {rid!r} != remote_request_id "
                f"{params.get('remote_request_id')!r}"
            )
        pulled = self.board.pending.pop((str(params.get("remote_engine_id")), str(rid)), None)
        if pulled is None:
            return "decode stub: nothing to pull for this request"
        if pulled != tokens:
            return "decode stub: pulled KV is for another prompt"
        self.board.pulled += 1
        return None


# ------------------------------------------------------------------------------------------
# The "stub" engine kind: events straight from an in-process StubEngine to the router


_engines_by_url: dict[str, StubEngine] = {}


def publish(engine: StubEngine) -> None:
    """Make a started stub findable by the ``stub`` adapter (by its URL)."""
    assert engine.url is not None, "start the engine first"
    _engines_by_url[engine.url] = engine


class StubAdapter(VllmHttpAdapter):
    """``stub``: subscribes the worker's sink to an in-process stub's events; P/D as vLLM."""

    kind = "stub"

    def __init__(self) -> None:
        self._subs: dict[str, tuple[StubEngine, Callable]] = {}

    async def start_worker(self, worker, sink) -> None:
        engine = _engines_by_url.get(worker.url or "")
        if engine is None:
            return  # a stub in another process: no events
        engine.listeners.append(sink.apply_many)
        self._subs[worker.worker_id] = (engine, sink.apply_many)

    async def stop_worker(self, worker_id: str) -> None:
        sub = self._subs.pop(worker_id, None)
        if sub is not None and sub[1] in sub[0].listeners:
            sub[0].listeners.remove(sub[1])

    def events_ready(self, worker_id: str) -> bool | None:
        return True if worker_id in self._subs else None


class SglangStubAdapter(StubAdapter):
    """``stub-sglang``: the same, with SGLang's concurrent bootstrap P/D."""

    kind = "stub-sglang"
    pd_style = SglangHttpAdapter.pd_style
    tokenize_path = "/tokenize"
    prefill_request = SglangHttpAdapter.prefill_request
    decode_request = SglangHttpAdapter.decode_request
    _bootstrap = SglangHttpAdapter._bootstrap


register_adapter("stub", StubAdapter, replace=True)
register_adapter("stub-sglang", SglangStubAdapter, replace=True)

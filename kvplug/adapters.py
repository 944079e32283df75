"""Engine adapters: everything the frontend needs to know about one engine kind.

An engine kind (``vllm``, ``sglang``, ``trtllm``, ``openai``...) is an adapter object, never an
``if engine == ...`` branch in the frontend. An adapter owns, for the workers of its kind:

* the **event source**: ``start_worker(worker, sink)`` starts whatever feeds the router (a ZMQ
  subscriber, a poller) and ``stop_worker(worker_id)`` stops it. Events go to ``sink.apply`` /
  ``sink.apply_many`` (or ``sink.apply_threadsafe`` from another thread), which count them per
  worker and call ``Router.apply_event``. ``events_ready(worker_id)`` says whether the source
  is up (``None``: this kind publishes no events);
* **metrics** scraping: done from ``start_worker`` too, reported with ``sink.set_attributes``;
* the **token endpoint** (``tokenize_path``, ``tokenize_body``, ``tokens_from_response``);
* the **health path** probed by the frontend;
* the **disaggregated (P/D) transforms**: ``pd_style`` says how the two stages run, and
  ``prefill_request`` / ``decode_request`` / ``request_headers`` build the two hops' bodies and
  headers (vLLM ``kv_transfer_params``, SGLang ``bootstrap_*``, TRT-LLM ``disaggregated_params``);
  ``final_answer`` says when a ``SEQUENTIAL`` prefill answer already is the client's whole
  answer (a stop condition on the first token), so no decode hop is sent.

Registering a kind (an integration does this at import time)::

    from kvplug.adapters import EngineAdapter, register_adapter

    class VllmAdapter(EngineAdapter):
        kind = "vllm"
        ...

    register_adapter("vllm", VllmAdapter, replace=True)

``create_adapter(kind)`` first imports ``kvplug.integrations.<kind>.adapter`` if that module exists
(so an installed integration replaces the built-in minimal adapter), then builds one adapter
instance from the registered factory. The frontend makes one instance per kind and per serving
process, so an adapter may keep per-process state (one bound ZMQ socket for many engines).
The built-ins here speak each engine's HTTP and P/D wire format but start no event source:
with them the router runs on whatever other event path is configured, or approximate mode.
"""

from __future__ import annotations

import copy
import importlib
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from kvplug.errors import ConfigError

if TYPE_CHECKING:  # imported for annotations only: adapters must not need the router at import
    from kvplug.events import KvEvent
    from kvplug.workers import Worker


class PDStyle(str, Enum):
    """How an engine kind runs disaggregated prefill/decode."""

    NONE = "none"  # no disaggregated mode: prefill-role workers of this kind are an error
    SEQUENTIAL = "sequential"  # prefill first; its answer carries transfer metadata (vLLM, TRT)
    CONCURRENT = "concurrent"  # both hops at once, paired by router-made ids (SGLang)


class WorkerSink(Protocol):
    """What an adapter feeds for one worker. The frontend's implementation counts and times
    events per worker (for ``/ready`` and metrics) before handing them to the router."""

    worker_id: str
    block_size: int

    def apply(self, event: KvEvent) -> None: ...

    def apply_many(self, events: Iterable[KvEvent]) -> None: ...

    def apply_threadsafe(self, events: Iterable[KvEvent]) -> None: ...

    def set_attributes(self, values: dict[str, float], ts: float | None = None) -> None: ...

    def update_capacity(
        self, kv_capacity_blocks: int | None = None, max_batched_tokens: int | None = None
    ) -> None:
        """What the engine says about its size (e.g. vLLM's ``num_gpu_blocks``), for the busy
        thresholds; values given in the worker config are not overridden."""
        ...


class ReportsCapacity(Protocol):
    capacity_reported: int  # the KV blocks per rank last handed to the sink


def report_capacity(run: ReportsCapacity, sink: Any, blocks: int | None) -> None:
    """An engine's KV capacity, in the router's blocks per DP rank, to a sink that takes it
    (``update_capacity``: the frontend re-registers the worker with it unless configured, for
    the busy thresholds and the index's pre-sizing); only a change is reported."""
    update = getattr(sink, "update_capacity", None)
    if update is None or not blocks or blocks < 0 or blocks == run.capacity_reported:
        return
    run.capacity_reported = blocks
    update(kv_capacity_blocks=blocks)


@dataclass
class PDContext:
    """One disaggregated request as the adapter sees it.

    ``decode_worker`` is known before the prefill hop only for ``PDStyle.CONCURRENT``.
    ``options`` are the per-worker adapter options from the worker config (``options:`` in YAML,
    e.g. SGLang's ``bootstrap_port``). ``scratch`` is the adapter's own per-request state.
    """

    request_id: str
    path: str  # "/v1/completions" or "/v1/chat/completions"
    prefill_worker: Worker
    prefill_dp_rank: int = 0
    prefill_options: Mapping[str, Any] = field(default_factory=dict)
    decode_worker: Worker | None = None
    decode_dp_rank: int = 0
    decode_options: Mapping[str, Any] = field(default_factory=dict)
    token_ids: list[int] | None = None
    scratch: dict[str, Any] = field(default_factory=dict)


class PDProtocolError(ValueError):
    """A prefill response that lacks what the decode hop needs (e.g. no ``kv_transfer_params``)."""


class EngineAdapter:
    """Base adapter: a plain OpenAI-compatible engine with no events and no P/D mode.

    Subclass and override what your engine does differently. Every method has a safe default.
    """

    kind: str = "openai"
    pd_style: PDStyle = PDStyle.NONE
    health_path: str = "/health"
    tokenize_path: str | None = "/tokenize"  # None: the engine has no token endpoint
    # headers for the adapter's own requests to the engines (discovery, loads, metrics): the
    # frontend puts ``--engine-api-key``'s bearer here, before any worker starts
    engine_headers: dict[str, str] = {}  # noqa: RUF012 - replaced, never mutated

    # -- lifecycle of one worker ---------------------------------------------------------------
    async def start_worker(self, worker: Worker, sink: WorkerSink) -> None:
        """Start the worker's event source and metrics scraping. Default: neither."""

    async def stop_worker(self, worker_id: str) -> None:
        """Stop what ``start_worker`` started. Must be idempotent."""

    async def engine_ranks(self, url: str) -> range | None:
        """The data-parallel ranks the engine at ``url`` runs behind that one URL, each with
        its own KV cache, when the engine says; ``None`` when it does not (or this kind cannot
        tell). Asked before a worker given without ``dp_start``/``dp_size`` registers, so that
        ``--worker URL`` in front of a DP engine indexes and routes every rank."""
        return None

    def events_ready(self, worker_id: str) -> bool | None:
        """Whether the worker's event source is up; ``None`` when this kind has none."""
        return None

    def event_drops(self) -> dict[str, dict[str, int]]:
        """What this kind's event sources dropped or rejected, for ``/metrics``: worker id
        ("" for what no worker can be named for) -> reason -> count since start."""
        return {}

    async def close(self) -> None:
        """Release per-process resources (shared sockets) at shutdown."""

    def add_liveness_listener(self, fn: Callable[[str, bool], Any]) -> None:
        """Register ``fn(worker_id, alive)``, to be called (from any thread) when the adapter's
        own checks (metrics scrapes, event silence) change a worker's verdict. The frontend
        marks the worker unhealthy / healthy. Default: this kind has no such checks."""

    # -- tokens ------------------------------------------------------------------------------
    def tokenize_body(
        self, model: str, *, prompt: str | None = None, messages: list | None = None
    ) -> dict[str, Any]:
        """Body of ``POST tokenize_path`` (vLLM's shape: ``prompt`` or chat ``messages``)."""
        if messages is not None:
            return {"model": model, "messages": messages, "add_generation_prompt": True}
        return {"model": model, "prompt": prompt}

    def tokens_from_response(self, payload: Any) -> list[int]:
        """Token ids from the token endpoint's JSON answer."""
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("token endpoint answered without a 'tokens' list of ints")
        return tokens

    # -- disaggregated serving -----------------------------------------------------------------
    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        """Body sent to the prefill worker, derived from the client's body (not mutated)."""
        raise PDProtocolError(f"engine kind {self.kind!r} has no disaggregated prefill mode")

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        """Body sent to the decode worker: the client's body plus the transfer metadata.

        ``prefill_response`` is the prefill worker's JSON answer for ``SEQUENTIAL`` kinds and
        ``None`` for ``CONCURRENT`` ones (both hops are built before either is sent)."""
        raise PDProtocolError(f"engine kind {self.kind!r} has no disaggregated decode mode")

    def final_answer(
        self, body: dict[str, Any], prefill_response: dict[str, Any], ctx: PDContext
    ) -> dict[str, Any] | None:
        """The client's answer when the prefill answer already is the whole answer, else
        ``None`` (then ``decode_request`` builds the decode hop).

        Asked for ``SEQUENTIAL`` kinds after the prefill answer arrives and before
        ``decode_request``. The answer returned goes to the client as it is (rendered as an
        SSE stream for a streaming client) and no decode stage is routed. Only claim an answer
        final when the client's own request would have ended there too: the prefill hop ran a
        modified request (one token, no ``min_tokens``). A raised exception means "no P/D for
        this request" (decode-only fallback), as from the other transforms."""
        return None

    def request_headers(self, ctx: PDContext) -> dict[str, str]:
        """Extra headers for both hops (vLLM pairs P and D by ``X-Request-Id``)."""
        return {"X-Request-Id": ctx.request_id}


# -------------------------------------------------------------------------------------------
# Built-in adapters: wire formats only (see the module docstring)


def min_tokens_over_one(body: Mapping[str, Any]) -> bool:
    """Whether the client asked for more than one token before a stop may end the output:
    a prefill hop run without ``min_tokens`` / ``min_completion_tokens`` (they fight
    ``max_tokens: 1``) that stopped at once then does not answer the client's request."""
    return any(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1
        for v in (body.get("min_tokens"), body.get("min_completion_tokens"))
    )


# vLLM NixlConnector: "prefill only, a remote decoder pulls the KV" (the decoder's fields are
# filled in by the prefill engine's answer)
VLLM_PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prefill hop: not streamed, one token, remote decode (the client's body is kept)."""
    out = _strip_for_prefill(body)
    out["kv_transfer_params"] = dict(VLLM_PREFILL_KV_TRANSFER_PARAMS)
    return out


def vllm_transfer_params(answer: Any) -> dict[str, Any] | None:
    """A vLLM prefill answer's ``kv_transfer_params`` (top level; some builds nest it in the
    first choice), or None."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    if params is None:
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            params = choices[0].get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def _strip_for_prefill(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)  # as upstream's P/D proxy does
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class OpenAIAdapter(EngineAdapter):
    """Any OpenAI-compatible server (no events, no P/D)."""

    kind = "openai"


class VllmHttpAdapter(EngineAdapter):
    """vLLM's HTTP side: ``/tokenize`` and NIXL pull-mode P/D (``kv_transfer_params``).

    Hop 1 sends the request with ``do_remote_decode: true``, not streamed, one output token;
    hop 2 sends the client's request with the prefill answer's ``kv_transfer_params`` unchanged
    (opaque JSON) and the same ``X-Request-Id``. The vLLM integration replaces this adapter with
    one that also subscribes to the engine's KV events and scrapes its metrics.
    """

    kind = "vllm"
    pd_style = PDStyle.SEQUENTIAL

    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        return vllm_prefill_body(body)

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        params = vllm_transfer_params(prefill_response)
        if params is None:
            raise PDProtocolError(
                f"prefill worker {ctx.prefill_worker.worker_id} answered without "
                "kv_transfer_params (is it started with a kv_producer NixlConnector?)"
            )
        out = dict(body)
        out["kv_transfer_params"] = params
        return out

    def final_answer(
        self, body: dict[str, Any], prefill_response: dict[str, Any], ctx: PDContext
    ) -> dict[str, Any] | None:
        """A prefill that stopped (EOS or a stop string as its one token) and answers with
        ``finish_reason: "stop"`` and no ``kv_transfer_params`` (a connector that hands off
        length-capped prefills only) is the client's answer. With
        ``kv_transfer_params`` present (0.32 hands off stopped prefills too) the decode hop is
        sent anyway: the decoder pulls the KV and stops the same way, and the prefill's blocks
        are released rather than held until their lease expires."""
        if not isinstance(prefill_response, dict):
            return None
        if vllm_transfer_params(prefill_response) is not None:
            return None
        choices = prefill_response.get("choices")
        if not isinstance(choices, list) or not choices:
            return None
        if not all(isinstance(c, dict) and c.get("finish_reason") == "stop" for c in choices):
            return None
        if min_tokens_over_one(body):
            return None
        return prefill_response


class SglangHttpAdapter(EngineAdapter):
    """SGLang PD: the same body to P and D at once with ``bootstrap_host/port/room``.

    ``bootstrap_port`` comes from the prefill worker's ``options.bootstrap_port`` (SGLang's
    default 8998; ``null`` to omit); the room is a random 63-bit integer shared by both hops.
    """

    kind = "sglang"
    pd_style = PDStyle.CONCURRENT
    tokenize_path: str | None = None  # no /tokenize in the OpenAI server across versions

    def _bootstrap(self, ctx: PDContext) -> dict[str, Any]:
        if "bootstrap" not in ctx.scratch:
            host = urlsplit(ctx.prefill_worker.url or "").hostname
            port = ctx.prefill_options.get("bootstrap_port", 8998)
            ctx.scratch["bootstrap"] = {
                "bootstrap_host": host,
                "bootstrap_port": port,
                "bootstrap_room": random.getrandbits(63),
            }
        return ctx.scratch["bootstrap"]

    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        out = dict(body)
        out.update(self._bootstrap(ctx))
        return out

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        out = dict(body)
        out.update(self._bootstrap(ctx))
        return out


class TrtllmHttpAdapter(EngineAdapter):
    """TRT-LLM HTTP disaggregation: ``disaggregated_params`` with ``request_type`` flipped.

    Hop 1: ``request_type: context_only``, not streamed, one token. Hop 2: the context answer's
    ``choices[0].disaggregated_params`` verbatim with ``request_type: generation_only``, and the
    prompt replaced by the context answer's ``prompt_token_ids`` when it returns them.
    """

    kind = "trtllm"
    pd_style = PDStyle.SEQUENTIAL
    tokenize_path = None

    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        out = _strip_for_prefill(body)
        out["disaggregated_params"] = {"request_type": "context_only"}
        return out

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        choices = (prefill_response or {}).get("choices") or [{}]
        params = choices[0].get("disaggregated_params") if isinstance(choices[0], dict) else None
        if not isinstance(params, dict):
            raise PDProtocolError(
                f"context worker {ctx.prefill_worker.worker_id} answered without "
                "choices[0].disaggregated_params"
            )
        finished = choices[0].get("finish_reason") not in ("length", "not_finished")
        if finished and min_tokens_over_one(body):
            # finished, but not the client's answer (final_answer said no): served whole
            raise PDProtocolError(
                f"context worker {ctx.prefill_worker.worker_id} finished the request "
                f"({choices[0].get('finish_reason')!r}) but the client asked min_tokens > 1"
            )
        out = dict(body)
        out["disaggregated_params"] = {**params, "request_type": "generation_only"}
        prompt_ids = (prefill_response or {}).get("prompt_token_ids")
        if prompt_ids is None and isinstance(choices[0], dict):
            prompt_ids = choices[0].get("prompt_token_ids")
        if isinstance(prompt_ids, list) and "prompt" in out:
            out["prompt"] = prompt_ids
        return out

    def final_answer(
        self, body: dict[str, Any], prefill_response: dict[str, Any], ctx: PDContext
    ) -> dict[str, Any] | None:
        """``finish_reason`` not ``length`` / ``not_finished``: the context answer is the whole
        answer (``openai_disagg_service.py`` returns it); its ``disaggregated_params`` go."""
        choices = prefill_response.get("choices") if isinstance(prefill_response, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None  # decode_request says what is wrong with it
        if choices[0].get("finish_reason") in ("length", "not_finished"):
            return None
        if min_tokens_over_one(body):
            return None
        out = copy.deepcopy(prefill_response)
        out["choices"][0].pop("disaggregated_params", None)
        return out


# -------------------------------------------------------------------------------------------
# Registry

AdapterFactory = Callable[[], EngineAdapter]

_lock = threading.Lock()
_registry: dict[str, AdapterFactory] = {
    "openai": OpenAIAdapter,
    "vllm": VllmHttpAdapter,
    "sglang": SglangHttpAdapter,
    "trtllm": TrtllmHttpAdapter,
}
_plugins_tried: set[str] = set()


def register_adapter(kind: str, factory: AdapterFactory, *, replace: bool = False) -> None:
    """Register the adapter factory of an engine kind.

    A built-in kind may always be replaced (an integration supersedes the wire-only built-in);
    replacing a kind another integration registered needs ``replace=True``.
    """
    if not kind or not isinstance(kind, str):
        raise ConfigError(f"adapter kind must be a non-empty string, got {kind!r}")
    if not callable(factory):
        raise ConfigError(f"adapter factory for {kind!r} is not callable")
    with _lock:
        current = _registry.get(kind)
        if current is not None and not replace and current is not _builtin_factory(kind):
            raise ConfigError(f"engine adapter {kind!r} is already registered ({current!r})")
        _registry[kind] = factory


def _builtin_factory(kind: str) -> AdapterFactory | None:
    return {
        "openai": OpenAIAdapter,
        "vllm": VllmHttpAdapter,
        "sglang": SglangHttpAdapter,
        "trtllm": TrtllmHttpAdapter,
    }.get(kind)


def unregister_adapter(kind: str) -> None:
    """Forget a registered kind (tests); a built-in kind goes back to its built-in adapter."""
    with _lock:
        builtin = _builtin_factory(kind)
        if builtin is not None:
            _registry[kind] = builtin
        else:
            _registry.pop(kind, None)


def _load_plugin(kind: str) -> None:
    """Import ``kvplug.integrations.<kind>.adapter`` once, if it exists; it registers itself."""
    if kind in _plugins_tried or not kind.isidentifier():
        return
    _plugins_tried.add(kind)
    module = f"kvplug.integrations.{kind}.adapter"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in (module, f"kvplug.integrations.{kind}", "kvplug.integrations"):
            raise  # the integration exists but a dependency of it is missing: say so


def adapter_kinds() -> list[str]:
    """Engine kinds that can be created (built-ins plus registered ones)."""
    with _lock:
        return sorted(_registry)


def create_adapter(kind: str) -> EngineAdapter:
    """A new adapter instance for ``kind``; ``ConfigError`` for an unknown kind."""
    _load_plugin(kind)
    with _lock:
        factory = _registry.get(kind)
    if factory is None:
        raise ConfigError(
            f"unknown engine kind {kind!r}; known kinds: {', '.join(adapter_kinds())}"
        )
    adapter = factory()
    if not isinstance(adapter, EngineAdapter):
        raise ConfigError(
            f"adapter factory for {kind!r} returned {type(adapter).__name__}, not an EngineAdapter"
        )
    return adapter

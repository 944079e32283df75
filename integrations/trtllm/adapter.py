"""The ``trtllm`` engine adapter: the draining event poller, load attributes and HTTP
disaggregation (``disaggregated_params``), the way ``trtllm-serve disaggregated`` does it.

Per worker, ``start_worker``:

1. reads ``GET /prometheus/metrics`` once: a ``trtllm_kv_cache_tokens_per_block`` different
   from the router's block size is refused loudly (``ConfigError``);
2. starts the worker's ``TrtllmPoller`` (the **only** reader of its ``POST /kv_cache_events``);
3. polls load every ``load_period`` s: ``/prometheus/metrics``, else the draining ``/metrics``
   JSON (used only when the Prometheus endpoint is missing). Under attention DP both give one
   rank's KV figures and rank 0's request counts, not sums over ranks (``metrics.py``).

Disaggregation (``PDStyle.SEQUENTIAL``; PROTOCOLS.md §3.5, ``openai_disagg_service.py``):

* context hop: the client's body (minus kvplug's ``nvext``: TRT-LLM's request models forbid
  unknown fields) with ``disaggregated_params: {"request_type": "context_only"}``,
  ``stream: false``, no ``stream_options`` and — unless option ``ctx_max_tokens_one: false`` —
  ``max_tokens: 1`` (what 1.0-era orchestrators sent; harmless on newer ones). Option
  ``disagg_request_id: true`` adds a random 63-bit ``disagg_request_id`` (newer builds only:
  older ones reject unknown fields);
* ``finish_reason`` not in {``length``, ``not_finished``} means the context answer is the
  whole answer: ``final_answer`` returns it (its ``disaggregated_params`` removed) and the
  frontend sends it to the client with no generation hop (PROTOCOLS.md §3.5 step 3). Unless
  the client asked ``min_tokens`` > 1 while the context hop ran with ``max_tokens: 1`` and no
  ``min_tokens``: that stop is not the client's, and the request falls back to one worker.
  ``decode_request`` never builds a generation hop for a finished answer: it raises
  ``ContextAnswerFinal`` (a ``PDProtocolError`` carrying the answer in ``.response``);
* generation hop: the client's body with the context answer's
  ``choices[0].disaggregated_params`` **verbatim** except ``request_type: generation_only``,
  and the prompt replaced by the answer's ``prompt_token_ids`` (``prompt`` for completions,
  ``prompt_token_ids`` for chat).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvplug.integrations.aio import LazySession, poll_loads

from kvplug import ConfigError, Worker
from kvplug.adapters import (
    PDContext,
    PDProtocolError,
    PDStyle,
    TrtllmHttpAdapter,
    WorkerSink,
    min_tokens_over_one,
    register_adapter,
    report_capacity,
)
from kvplug.tasks import cancel_and_wait

from .events import TrtllmDecoder
from .metrics import parse_iteration_stats, parse_prometheus
from .poller import TrtllmPoller

log = logging.getLogger("kvplug.integrations.trtllm")

CONTINUE_REASONS = frozenset({"length", "not_finished"})
KVPLUG_ONLY_FIELDS = ("nvext",)


# -------------------------------------------------------------------------------------------
# P/D transforms (pure functions: tested field by field)
# -------------------------------------------------------------------------------------------


def _client_body(body: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(body))
    for key in KVPLUG_ONLY_FIELDS:
        out.pop(key, None)
    return out


def context_request(
    body: Mapping[str, Any],
    *,
    max_tokens_one: bool = True,
    disagg_request_id: int | None = None,
) -> dict[str, Any]:
    """The context-only request for a client's completion or chat body."""
    out = _client_body(body)
    params: dict[str, Any] = {"request_type": "context_only"}
    if disagg_request_id is not None:
        params["disagg_request_id"] = disagg_request_id
    out["disaggregated_params"] = params
    out["stream"] = False
    out.pop("stream_options", None)
    if max_tokens_one:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out.pop("min_tokens", None)
    return out


def _first_choice(answer: Any, who: str) -> dict[str, Any]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        n = len(choices) if isinstance(choices, list) else "no"
        raise PDProtocolError(f"context worker {who} answered with {n} choices, expected 1")
    return choices[0]


def context_is_final(answer: Any) -> bool:
    """True when the context answer already is the whole answer (e.g. EOS on the first token)."""
    choice = _first_choice(answer, "?")
    return choice.get("finish_reason") not in CONTINUE_REASONS


def final_response(answer: dict[str, Any]) -> dict[str, Any]:
    """The context answer as the client's answer (its disaggregated_params removed)."""
    out = copy.deepcopy(answer)
    for choice in out.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("disaggregated_params", None)
    return out


class ContextAnswerFinal(PDProtocolError):
    """The context answer already is the whole answer (``finish_reason`` not ``length`` /
    ``not_finished``, e.g. EOS as the first token): no generation hop may follow — a
    generation-only request would continue past the end. ``response`` is what the client
    should get. The frontend asks ``final_answer`` before ``decode_request``, so in the
    serving path this is raised only when that answer is not the client's (``min_tokens``):
    as a ``PDProtocolError`` it makes the request fall back to one worker doing both stages."""

    def __init__(self, response: dict[str, Any], who: str) -> None:
        reason = response["choices"][0].get("finish_reason")
        super().__init__(f"context worker {who} finished the request ({reason!r})")
        self.response = response


def _context_params(choice: dict[str, Any], who: str) -> dict[str, Any]:
    params = choice.get("disaggregated_params")
    if not isinstance(params, dict):
        raise PDProtocolError(
            f"context worker {who} answered without choices[0].disaggregated_params "
            "(is it a trtllm-serve worker with cache_transceiver_config?)"
        )
    if params.get("ctx_request_id") is None:
        raise PDProtocolError(f"context worker {who}: disaggregated_params.ctx_request_id is null")
    return params


def generation_request(
    body: Mapping[str, Any], answer: Any, *, path: str = "/v1/completions", who: str = "?"
) -> dict[str, Any]:
    """The generation-only request: the client's body + the context answer's params.
    Raises ``ContextAnswerFinal`` when the context answer is already complete."""
    choice = _first_choice(answer, who)
    params = _context_params(choice, who)
    # checked after the answer's shape, as trtllm-serve's orchestrator does
    if choice.get("finish_reason") not in CONTINUE_REASONS:
        raise ContextAnswerFinal(final_response(answer), who)
    out = _client_body(body)
    out["disaggregated_params"] = {**params, "request_type": "generation_only"}
    prompt_ids = answer.get("prompt_token_ids")
    if isinstance(prompt_ids, list) and prompt_ids:
        if "chat" in path or "messages" in out:
            out["prompt_token_ids"] = prompt_ids
        else:
            out["prompt"] = prompt_ids
    return out


# -------------------------------------------------------------------------------------------
# The adapter
# -------------------------------------------------------------------------------------------


@dataclass
class _Run:
    worker: Worker
    sink: WorkerSink
    poller: TrtllmPoller
    tasks: list[asyncio.Task] = field(default_factory=list)
    load_errors: int = 0
    prometheus: bool = True
    capacity_reported: int = 0  # KV blocks per rank last handed to the sink


class TrtllmAdapter(TrtllmHttpAdapter):
    kind = "trtllm"
    pd_style = PDStyle.SEQUENTIAL
    tokenize_path = None

    def __init__(
        self,
        *,
        load_period: float = 0.5,
        http_timeout: float = 10.0,
        poll_min_interval: float = 0.005,
        poll_max_interval: float = 0.1,
        lora_names: Mapping[int, str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.load_period = load_period
        self.http_timeout = http_timeout
        self.poll_min_interval = poll_min_interval
        self.poll_max_interval = poll_max_interval
        self.lora_names = dict(lora_names or {})
        self.rng = rng or random.Random()
        self._runs: dict[str, _Run] = {}
        # timeouts per request; the engines' key, when kvplug serve has one, on every call
        self._session = LazySession(headers=lambda: self.engine_headers)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start_worker(self, worker: Worker, sink: WorkerSink) -> None:
        if worker.url is None:
            raise ConfigError(f"trtllm worker {worker.worker_id}: needs a url")
        if worker.worker_id in self._runs:
            raise ConfigError(
                f"trtllm worker {worker.worker_id}: already polled (one consumer "
                "per worker: its event queue drains on every read)"
            )
        session = self._http()
        tpb = await self._tokens_per_block(worker)
        if tpb is not None and tpb != sink.block_size:
            raise ConfigError(
                f"trtllm worker {worker.worker_id} has tokens_per_block {tpb} but the router "
                f"hashes blocks of {sink.block_size}: start the router with --kv-block-size {tpb} "
                f"or the engine with kv_cache_config.tokens_per_block {sink.block_size}"
            )
        decoder = TrtllmDecoder(worker.worker_id, sink.block_size, lora_names=self.lora_names)
        poller = TrtllmPoller(
            worker.url,
            decoder,
            sink.apply_threadsafe,
            session=session,
            min_interval=self.poll_min_interval,
            max_interval=self.poll_max_interval,
            timeout=self.http_timeout,
        )
        run = _Run(worker, sink, poller)
        self._runs[worker.worker_id] = run
        poll_task = asyncio.create_task(poller.run())
        poll_task.add_done_callback(functools.partial(_poller_ended, worker.worker_id))
        run.tasks.append(poll_task)
        run.tasks.append(asyncio.create_task(self._poll_load(run)))

    async def stop_worker(self, worker_id: str) -> None:
        run = self._runs.pop(worker_id, None)
        if run is None:
            return
        await cancel_and_wait(run.tasks)

    def events_ready(self, worker_id: str) -> bool | None:
        """Up = the poller runs and its last round reached the worker (a stopped poller is
        not ready, whatever it saw last)."""
        run = self._runs.get(worker_id)
        return run is not None and run.poller.running and run.poller.connected

    def event_drops(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for wid, r in list(self._runs.items()):
            p, dec = r.poller, r.poller.decoder
            d = {k: p.counts[k] for k in POLLER_DROPS}
            d.update({k: dec.counts[k] for k in ("gaps", "id_regressions")})
            d.update({f"decode.{k}": v for k, v in dec.drops.items()})
            # stop_worker forgets the run before cancelling: a finished task here is a stop
            d["poller_stopped"] = int(r.tasks[0].done())
            out[wid] = d
        return out

    async def close(self) -> None:
        for worker_id in list(self._runs):
            await self.stop_worker(worker_id)
        await self._session.close()

    def stats(self) -> dict[str, Any]:
        return {
            w: {
                "poller": dict(r.poller.counts),
                "decoder": r.poller.decoder.stats(),
                "load_errors": r.load_errors,
            }
            for w, r in self._runs.items()
        }

    # -- P/D -------------------------------------------------------------------------------------
    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        opts = ctx.prefill_options
        rid = self.rng.getrandbits(63) if opts.get("disagg_request_id") else None
        return context_request(
            body, max_tokens_one=bool(opts.get("ctx_max_tokens_one", True)), disagg_request_id=rid
        )

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        return generation_request(
            body, prefill_response, path=ctx.path, who=ctx.prefill_worker.worker_id
        )

    def final_answer(
        self, body: dict[str, Any], prefill_response: dict[str, Any], ctx: PDContext
    ) -> dict[str, Any] | None:
        who = ctx.prefill_worker.worker_id
        choice = _first_choice(prefill_response, who)
        if choice.get("finish_reason") in CONTINUE_REASONS:
            return None
        # as trtllm-serve: a finished answer must still be a well-formed context answer
        _context_params(choice, who)
        if bool(ctx.prefill_options.get("ctx_max_tokens_one", True)) and min_tokens_over_one(body):
            return None  # stopped without the client's min_tokens: decode_request refuses
        return final_response(prefill_response)

    def prefill_is_final(self, prefill_response: dict[str, Any]) -> bool:
        return context_is_final(prefill_response)

    def request_headers(self, ctx: PDContext) -> dict[str, str]:
        return {}

    # -- internals -------------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        return self._session.get()

    def _prom_url(self, worker: Worker) -> str:
        return worker.metrics_url or (worker.url or "").rstrip("/") + "/prometheus/metrics"

    async def _tokens_per_block(self, worker: Worker) -> int | None:
        try:
            async with self._http().get(
                self._prom_url(worker), timeout=aiohttp.ClientTimeout(total=self.http_timeout)
            ) as resp:
                if resp.status != 200:
                    return None
                _, tpb = parse_prometheus(await resp.text())
                return tpb
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.info(
                "trtllm worker %s: no tokens_per_block at start (%s); not checked",
                worker.worker_id,
                exc,
            )
            return None

    @staticmethod
    def _report_capacity(run: _Run, max_blocks: float | None) -> None:
        """``maxNumBlocks`` / ``trtllm_kv_cache_max_blocks`` as the worker's capacity per rank
        (``report_capacity``): TRT-LLM reports one attention-DP rank's KV pool there (rank
        0's, copied into every rank's stats row; never a sum over ranks, see ``metrics.py``),
        so it is not divided by ``dp_size``. Its blocks are the router's (the
        tokens_per_block check at start)."""
        report_capacity(run, run.sink, int(max_blocks) if max_blocks else None)

    async def _poll_load(self, run: _Run) -> None:
        worker = run.worker
        json_url = (worker.url or "").rstrip("/") + "/metrics"
        timeout = aiohttp.ClientTimeout(total=self.http_timeout)

        async def scrape() -> bool:
            session = self._http()
            attrs: dict[str, float] | None  # None: no new iteration since the last poll
            if run.prometheus:
                async with session.get(self._prom_url(worker), timeout=timeout) as resp:
                    if resp.status == 404 and worker.metrics_url is None:
                        run.prometheus = False  # no /prometheus/metrics: drained JSON
                        return True
                    resp.raise_for_status()
                    attrs, _ = parse_prometheus(await resp.text())
            else:
                async with session.get(json_url, timeout=timeout) as resp:
                    resp.raise_for_status()
                    attrs, _ = parse_iteration_stats(json.loads(await resp.read()))
            if attrs:
                run.sink.set_attributes(attrs)
                self._report_capacity(run, attrs.get("kv_max_blocks"))
            return False

        await poll_loads(scrape, self.load_period, run, f"trtllm worker {worker.worker_id}", log)


# poller counters that mean events (may have been) lost: answers, not events
POLLER_DROPS = ("lost_answers", "decoder_errors", "internal_errors", "connect_errors")


def _poller_ended(worker_id: str, task: asyncio.Task) -> None:
    """A poller task only ends when its worker is removed (cancelled); anything else is loud."""
    if task.cancelled():
        return
    log.error(
        "trtllm worker %s: event poller stopped (%r); its events are no longer read",
        worker_id,
        task.exception(),
    )


register_adapter("trtllm", TrtllmAdapter)

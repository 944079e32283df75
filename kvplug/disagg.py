"""Two-stage (disaggregated prefill/decode) dispatch, engine-agnostic.

The engine specifics live in the prefill worker's adapter (``kvplug.adapters``):

* ``PDStyle.SEQUENTIAL`` (vLLM ``kv_transfer_params``, TRT-LLM ``disaggregated_params``):
  route(PREFILL) -> ``adapter.prefill_request(body)`` -> send, wait for the answer ->
  ``adapter.decode_request(body, answer)`` -> route(DECODE) -> stream back;
* ``PDStyle.CONCURRENT`` (SGLang ``bootstrap_host/port/room``): route(PREFILL) and
  route(DECODE) first, build both bodies, send the prefill hop in the background and stream
  the decode hop back.

A ``SEQUENTIAL`` prefill answer may already be the client's whole answer (a stop condition on
its one token: TRT-LLM ``finish_reason`` not ``length``/``not_finished``, vLLM ``stop`` without
``kv_transfer_params``): the adapter's ``final_answer`` says so, the plan carries that answer in
``final_answer`` and no decode stage is routed (``final_answer_sse`` renders it for a streaming
client).

Conditional disaggregation (``--router-conditional-disagg``, PROTOCOLS.md §4.6, Dynamo's
policies): before the prefill stage, the router previews where the request would run whole on
a decode-capable worker. The remote prefill stage is *skipped* (the request goes to that worker
as one aggregated request, local prefill + decode) when the policy says so:

* ``isl_bounding``: effective ISL = prompt tokens - tokens cached on that worker's device is
  small (< ``eff_isl_threshold``, 2048) AND mostly cached (effective/prompt < 0.7);
* ``prefill_load``: the prefill worker the router would pick is busy (active prefill tokens >
  threshold x its max batched tokens);
* ``isl_or_load``: either.

An optional decode-busy guard vetoes a bypass onto a worker whose projected decode blocks exceed
a fraction of its KV capacity. The verdict (inputs, numbers, reason) is recorded on the
decision that carries the request (``Decision.conditional_disagg``).

A prefill worker that refuses the connection is marked failed and the prefill retried once on
the next-best prefill worker. When no prefill worker can be used (none routable, every try
failed, an answer without transfer metadata), the request falls back to one decode-capable
worker doing both stages (Dynamo's decode-only fallback); the reason is recorded. A 4xx answer
from the prefill worker is the client's error and is passed through.

The transport is the caller's (``StageBackend``): this module knows no HTTP.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvplug.adapters import PDContext, PDProtocolError, PDStyle
from kvplug.errors import AllWorkersOverloaded, RoutingError
from kvplug.workers import Stage


class StageUnavailable(Exception):
    """A stage's worker failed before answering (retry elsewhere)."""


class PrefillRejected(Exception):
    """The prefill worker answered with an error status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"prefill worker answered HTTP {status}")
        self.status = status
        self.body = body


class RoutedStage(Protocol):
    decision: Any  # kvplug.decision.Decision
    entry: Any  # the worker: .worker (kvplug.workers.Worker), .adapter, .spec.options
    lifecycle: Any  # kvplug.frontend.lifecycle.Lifecycle (finish() idempotent)


class StageBackend(Protocol):
    def route_stage(
        self,
        ctx: Any,
        stage: Stage,
        attempt: int,
        exclude: frozenset[str],
        allowed: frozenset[str] | None = None,
    ) -> Any:
        """Route one stage (raises RoutingError) and record the decision."""

    async def send_prefill(
        self, ctx: Any, routed: Any, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """Send the prefill hop and return its JSON answer; releases the stage's load.
        Raises StageUnavailable (no answer) or PrefillRejected (error status)."""

    def stage_failed(self, routed: Any, reason: str) -> None:
        """The worker failed before answering: mark it, release the stage's load."""

    def decode_capable(self) -> frozenset[str]:
        """Workers that can serve a whole request on the fallback path."""

    # conditional disaggregation only (``plan_two_stage(conditional=...)``):
    # ``router`` (kvplug.router.Router) and
    # ``preview_stage(ctx, stage, allowed) -> Decision`` (Router.preview of that stage's
    # request; raises RoutingError)


@dataclass(frozen=True)
class ConditionalDisagg:
    """When to skip the remote prefill stage (``RouterConfig.router_conditional_disagg*``)."""

    policy: str = "off"  # off | isl_bounding | prefill_load | isl_or_load
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7
    prefill_busy_threshold: float | None = None  # x max_batched_tokens; None: no load signal
    decode_busy_threshold: float | None = None  # fraction of KV capacity; None: guard off

    @classmethod
    def from_config(cls, cfg: Any) -> ConditionalDisagg:
        busy = cfg.router_conditional_disagg_prefill_busy_threshold
        if busy is None:  # Dynamo: inherit the queue threshold
            busy = getattr(cfg, "router_queue_threshold", None)
        return cls(
            cfg.router_conditional_disagg,
            cfg.router_conditional_disagg_eff_isl_threshold,
            cfg.router_conditional_disagg_eff_isl_ratio_threshold,
            busy,
            cfg.router_conditional_disagg_decode_busy_threshold,
        )

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    @property
    def uses_isl(self) -> bool:
        return self.policy in ("isl_bounding", "isl_or_load")

    @property
    def uses_load(self) -> bool:
        return self.policy in ("prefill_load", "isl_or_load")


@dataclass
class BypassVerdict:
    """One conditional-disaggregation decision and everything it was based on."""

    policy: str
    bypass: bool  # True: the remote prefill stage is skipped
    reason: str
    decode_worker: str  # where the request would run whole
    prompt_tokens: int
    cached_tokens: int  # on that worker's device
    effective_isl: int
    isl_ok: bool | None = None  # the isl_bounding condition (None: not evaluated)
    prefill_worker: str | None = None  # the prefill worker the router would pick
    prefill_busy: bool | None = None  # None: no signal (treated as calm)
    decode_busy: bool | None = None  # None: guard off (or not reached)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def isl_bounding(
    prompt_tokens: int, cached_tokens: int, eff_isl_threshold: int, ratio_threshold: float
) -> tuple[bool, int, float]:
    """Dynamo's predicate: (bypass?, effective ISL, effective/prompt ratio); both strict."""
    eff = max(prompt_tokens - cached_tokens, 0)
    ratio = eff / max(prompt_tokens, 1)
    return eff < eff_isl_threshold and ratio < ratio_threshold, eff, ratio


def decide_bypass(backend: Any, ctx: Any, cond: ConditionalDisagg) -> BypassVerdict | None:
    """Preview the request on the decode-capable workers (and, for the load policies, the
    prefill stage) and apply ``cond``. None when the policy cannot apply (not a kv-scoring
    mode, or no decode-capable worker can take the request): the two stages go ahead."""
    router = backend.router
    if not cond.enabled or router.config.router_mode not in ("kv", "affinity", "profile"):
        return None
    try:
        dec = backend.preview_stage(ctx, Stage.AGGREGATED, backend.decode_capable())
    except RoutingError:
        return None
    bs = router.block_size
    prompt = int(dec.prompt_tokens)
    device = dec.chosen_input("device") or 0.0
    cached = min(int(device) * bs, prompt)
    isl_ok, eff, ratio = isl_bounding(
        prompt, cached, cond.eff_isl_threshold, cond.eff_isl_ratio_threshold
    )
    verdict = BypassVerdict(cond.policy, False, "", dec.worker_id, prompt, cached, eff)
    reasons = []
    if cond.uses_isl:
        verdict.isl_ok = isl_ok
        cmp_isl = "<" if eff < cond.eff_isl_threshold else ">="
        cmp_ratio = "<" if ratio < cond.eff_isl_ratio_threshold else ">="
        reasons.append(
            f"effective ISL {eff} {cmp_isl} {cond.eff_isl_threshold} and "
            f"{eff}/{prompt} = {ratio:.2f} {cmp_ratio} {cond.eff_isl_ratio_threshold} "
            f"on {dec.worker_id}"
        )
    if cond.uses_load:
        verdict.prefill_busy, text = _prefill_busy(backend, ctx, cond, verdict)
        reasons.append(text)
    says_bypass = bool(verdict.isl_ok) or bool(verdict.prefill_busy)
    if says_bypass and cond.decode_busy_threshold is not None:
        ep = dec.endpoint_id
        cap = float(router.kv_capacity[ep]) if ep < len(router.kv_capacity) else 0.0
        projected = dec.chosen_input("decode_blocks")
        if cap <= 0 or projected is None:
            what = "KV capacity" if cap <= 0 else "projected decode load"
            reasons.append(f"decode worker {dec.worker_id}'s {what} unknown: no bypass")
            says_bypass = False
        else:
            verdict.decode_busy = bool(projected > cond.decode_busy_threshold * cap)
            reasons.append(
                f"decode blocks {projected:g} {'>' if verdict.decode_busy else '<='} "
                f"{cond.decode_busy_threshold} x {cap:g}"
            )
            says_bypass = not verdict.decode_busy
    verdict.bypass = says_bypass
    verdict.reason = ("prefill on the decode worker: " if says_bypass else "remote prefill: ") + (
        "; ".join(reasons)
    )
    return verdict


def _prefill_busy(
    backend: Any, ctx: Any, cond: ConditionalDisagg, verdict: BypassVerdict
) -> tuple[bool | None, str]:
    """Is the prefill worker the router would pick over the busy line? None = no signal."""
    if cond.prefill_busy_threshold is None:
        return None, "prefill load unknown (no busy threshold)"
    try:
        pre = backend.preview_stage(ctx, Stage.PREFILL, None)
    except AllWorkersOverloaded:
        return True, "every prefill worker is overloaded"
    except RoutingError:
        return None, "no routable prefill worker"
    verdict.prefill_worker = pre.worker_id
    router = backend.router
    ep = pre.endpoint_id
    limit = router.chunk_tokens(ep)
    if limit <= 0:
        return None, f"prefill worker {pre.worker_id}'s max batched tokens unknown"
    active = router.endpoint_load(ep)["prefill_tokens"]
    busy = bool(active > cond.prefill_busy_threshold * limit)
    return busy, (
        f"prefill worker {pre.worker_id} active prefill {active:g} tokens "
        f"{'>' if busy else '<='} {cond.prefill_busy_threshold} x {limit:g}"
    )


@dataclass
class DecodePlan:
    body: dict[str, Any]  # what goes to the decode (or fallback) worker
    headers: dict[str, str]  # extra headers for that hop (vLLM: the same X-Request-Id)
    stage: Stage  # DECODE; AGGREGATED on the fallback path; PREFILL when final_answer is set
    prefill: Any = None  # the prefill stage's RoutedStage
    decode: Any = None  # the decode stage's RoutedStage, already routed (CONCURRENT style)
    prefill_task: asyncio.Task | None = None  # CONCURRENT: the prefill hop in flight
    allowed: frozenset[str] | None = None  # fallback: decode-capable workers only
    fallback_reason: str | None = None
    prefill_answer: dict[str, Any] | None = None
    exclude: frozenset[str] = frozenset()  # workers the decode stage must not use
    # the prefill answer already is the client's whole answer: send it, route no decode stage
    final_answer: dict[str, Any] | None = None
    # conditional disaggregation's verdict (bypass: stage AGGREGATED on a decode worker)
    conditional: BypassVerdict | None = None


def _fallback(
    backend: StageBackend, body: dict[str, Any], reason: str, prefill: RoutedStage | None = None
) -> DecodePlan:
    return DecodePlan(
        body=body,
        headers={},
        stage=Stage.AGGREGATED,
        prefill=prefill,
        allowed=backend.decode_capable(),
        fallback_reason=reason,
    )


async def plan_two_stage(
    backend: StageBackend,
    ctx: Any,
    body: dict[str, Any],
    request_id: str,
    path: str,
    token_ids: list[int] | None,
    retries: int = 1,
    conditional: ConditionalDisagg | None = None,
) -> DecodePlan:
    """Run the prefill stage (or start it) and say how to send the decode stage; with
    ``conditional`` enabled, first decide whether to skip the prefill stage altogether."""
    verdict = None
    if conditional is not None and conditional.enabled:
        verdict = decide_bypass(backend, ctx, conditional)
        if verdict is not None and verdict.bypass:
            return DecodePlan(
                body=body,
                headers={},
                stage=Stage.AGGREGATED,
                allowed=backend.decode_capable(),
                conditional=verdict,
            )
    plan = await _plan_stages(backend, ctx, body, request_id, path, token_ids, retries)
    if verdict is not None:
        plan.conditional = verdict
        if plan.prefill is not None:  # the prefill decision says why it was not skipped
            plan.prefill.decision.conditional_disagg = verdict.to_dict()
    return plan


async def _plan_stages(
    backend: StageBackend,
    ctx: Any,
    body: dict[str, Any],
    request_id: str,
    path: str,
    token_ids: list[int] | None,
    retries: int,
) -> DecodePlan:
    exclude: set[str] = set()
    last_error = "no prefill attempt"
    for attempt in range(retries + 1):
        try:
            pre = backend.route_stage(ctx, Stage.PREFILL, attempt, frozenset(exclude))
        except RoutingError as exc:
            return _fallback(backend, body, f"no routable prefill worker: {exc}")
        adapter = pre.entry.adapter
        pd = PDContext(
            request_id=request_id,
            path=path,
            prefill_worker=pre.entry.worker,
            prefill_dp_rank=pre.decision.dp_rank,
            prefill_options=pre.entry.spec.options,
            token_ids=token_ids,
        )
        if adapter.pd_style is PDStyle.CONCURRENT:
            return _plan_concurrent(backend, ctx, body, pre, pd, attempt)
        try:
            prefill_body = adapter.prefill_request(body, pd)
        except Exception as exc:  # adapter code: any failure means "no P/D for this one"
            pre.lifecycle.finish()
            return _fallback(backend, body, _why(exc), pre)
        headers = adapter.request_headers(pd)
        try:
            answer = await backend.send_prefill(ctx, pre, prefill_body, headers)
        except StageUnavailable as exc:
            backend.stage_failed(pre, str(exc))
            exclude.add(pre.decision.worker_id)
            last_error = str(exc)
            continue
        except PrefillRejected as exc:
            if 400 <= exc.status < 500:
                raise
            return _fallback(backend, body, str(exc), pre)
        try:
            final = adapter.final_answer(body, answer, pd)
            if final is None:
                decode_body = adapter.decode_request(body, answer, pd)
        except Exception as exc:  # e.g. no kv_transfer_params in the answer
            return _fallback(backend, body, _why(exc), pre)
        if final is not None:
            pre.lifecycle.finish()  # send_prefill released it already; idempotent
            return DecodePlan(
                body=body,
                headers=headers,
                stage=Stage.PREFILL,
                prefill=pre,
                prefill_answer=answer,
                final_answer=final,
            )
        return DecodePlan(
            body=decode_body,
            headers=headers,
            stage=Stage.DECODE,
            prefill=pre,
            prefill_answer=answer,
            # a both-role worker never decodes its own prefill: transferring to itself is waste
            exclude=frozenset({pre.decision.worker_id}),
        )
    return _fallback(backend, body, f"every prefill attempt failed (last: {last_error})")


def _plan_concurrent(
    backend: StageBackend,
    ctx: Any,
    body: dict[str, Any],
    pre: RoutedStage,
    pd: PDContext,
    attempt: int,
) -> DecodePlan:
    try:
        dec = backend.route_stage(ctx, Stage.DECODE, attempt, frozenset())
    except RoutingError:
        pre.lifecycle.finish()
        raise
    pd.decode_worker = dec.entry.worker
    pd.decode_dp_rank = dec.decision.dp_rank
    pd.decode_options = dec.entry.spec.options
    adapter = pre.entry.adapter
    try:
        prefill_body = adapter.prefill_request(body, pd)
        decode_body = adapter.decode_request(body, None, pd)
    except Exception as exc:
        pre.lifecycle.finish()
        dec.lifecycle.finish()
        return _fallback(backend, body, _why(exc), pre)
    headers = adapter.request_headers(pd)
    task = asyncio.ensure_future(_background_prefill(backend, ctx, pre, prefill_body, headers))
    return DecodePlan(
        body=decode_body,
        headers=headers,
        stage=Stage.DECODE,
        prefill=pre,
        decode=dec,
        prefill_task=task,
    )


def _why(exc: Exception) -> str:
    return str(exc) if isinstance(exc, PDProtocolError) else f"{type(exc).__name__}: {exc}"


async def _background_prefill(
    backend: StageBackend, ctx: Any, pre: RoutedStage, body: dict[str, Any], headers: dict[str, str]
) -> Any:
    try:
        return await backend.send_prefill(ctx, pre, body, headers)
    except StageUnavailable as exc:
        backend.stage_failed(pre, str(exc))
        return exc
    except PrefillRejected as exc:
        return exc


async def settle_prefill(plan: DecodePlan, timeout: float = 30.0) -> None:
    """After the decode hop: let a concurrent prefill hop finish (bounded), then drop it."""
    task = plan.prefill_task
    if task is None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        task.cancel()
    finally:
        if plan.prefill is not None:
            plan.prefill.lifecycle.finish()


# -------------------------------------------------------------------------------------------
# A final prefill answer for a streaming client: the same answer as OpenAI stream chunks

_MESSAGE_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


def final_answer_chunks(answer: dict[str, Any], body: dict[str, Any], chat: bool) -> list[dict]:
    """A non-streamed completion (``chat``: chat completion) answer as the chunk sequence a
    streamed request gets: chat a role chunk then a content chunk per choice, completions one
    chunk per choice; the usage chunk (empty ``choices``) when the client asked
    ``stream_options.include_usage`` (and usage in every chunk with
    ``continuous_usage_stats``, vLLM's option)."""
    opts = body.get("stream_options")
    opts = opts if isinstance(opts, dict) else {}
    usage = answer.get("usage") if opts.get("include_usage") else None
    every = usage is not None and bool(opts.get("continuous_usage_stats"))
    head: dict[str, Any] = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    if answer.get("system_fingerprint") is not None:
        head["system_fingerprint"] = answer["system_fingerprint"]

    def chunk(choices: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
        out = {**head, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    chunks = []
    choices = answer.get("choices")
    for i, choice in enumerate(choices if isinstance(choices, list) else ()):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", i)
        rest = {
            k: v
            for k, v in choice.items()
            if k not in ("message", "index", "disaggregated_params", "kv_transfer_params")
        }
        if not chat:
            chunks.append(chunk([{"index": index, **rest}], every))
            continue
        message = choice.get("message")
        message = message if isinstance(message, dict) else {}
        role = {"index": index, "delta": {"role": message.get("role", "assistant"), "content": ""}}
        chunks.append(chunk([{**role, "logprobs": None, "finish_reason": None}], every))
        delta = {k: message[k] for k in _MESSAGE_DELTA_FIELDS if message.get(k) is not None}
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list) and tool_calls:
            delta["tool_calls"] = [
                {"index": j, **call} if isinstance(call, dict) else call
                for j, call in enumerate(tool_calls)
            ]
        chunks.append(chunk([{"index": index, "delta": delta, **rest}], every))
    if usage is not None:
        chunks.append(chunk([], True))
    return chunks


def final_answer_sse(answer: dict[str, Any], body: dict[str, Any], chat: bool) -> bytes:
    """``final_answer_chunks`` as SSE ``data:`` events, ending with ``data: [DONE]``."""
    events = [
        b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"
        for c in final_answer_chunks(answer, body, chat)
    ]
    return b"".join(events) + b"data: [DONE]\n\n"

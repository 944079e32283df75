"""Validate a client's OpenAI request body before anything reaches the router.

Every failure is an ``ApiError`` (400) with an OpenAI-style body; nothing here has side effects.
The bytes forwarded to the engine are the client's bytes unchanged, unless the body carries
``nvext`` (kvplug/Dynamo routing extensions the engine does not know), which is stripped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvplug._token_json import parse_token_ids, read_common_completion
from kvplug.frontend.errors import bad_request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKEN_ID = 2**32  # kvplug hashes tokens as u32
# deeper bodies are refused: the decoders recurse (Python's limit is ~1000 frames), and so do
# the engines' and the chat templates'; OpenAI bodies (tool schemas included) stay far below
MAX_JSON_DEPTH = 128

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class ParsedRequest:
    path: str  # COMPLETIONS or CHAT
    raw: bytes  # what is forwarded to the engine
    model: str
    stream: bool
    decoded: dict[str, Any] | None = None  # the body; None until ``body`` is first read
    prompt_text: str | None = None  # completions with a text prompt
    # token ids given by the client (prompt or nvext): a list, or a uint32 array when read
    # straight from the body's bytes (the token-id fast path)
    prompt_ids: list[int] | np.ndarray | None = None
    messages: list[dict[str, Any]] | None = None  # chat
    nvext: dict[str, Any] | None = None
    batch_size: int = 1  # completions prompt lists
    prompts: list[Any] | None = None  # a batch of 2+ prompts (strings or validated id lists)
    cache_salt: str | None = None  # the body's string "cache_salt" (vLLM's), else None

    @property
    def body(self) -> dict[str, Any]:
        """The request body as a dict. The token-id fast path never builds it for the common
        request; whoever needs other fields (P/D, batches, adapters) decodes it here, once.
        The fast path only skips decoding bodies the general path has already accepted in
        shape (valid JSON, depth within the limit), so this cannot fail."""
        if self.decoded is None:
            self.decoded = _decoder.decode(self.raw)
        return self.decoded

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT


_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]]


def _check_token_ids(ids: Any, where: str) -> list[int]:
    """Token ids as u32 ints (booleans and floats refused), validated in C by msgspec."""
    try:
        return msgspec.convert(ids, _TokenIds, strict=True)
    except msgspec.ValidationError as exc:
        raise bad_request(
            f"{where} is not a list of token ids (integers in [0, 2^32)): {exc}",
            code="invalid_prompt",
            param=where,
        ) from None


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/objects more than ``limit`` deep (iterative walk)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _deep_error() -> Exception:
    return bad_request(
        f"request body nests JSON more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep"
    )


def decode_json(raw: bytes) -> Any:
    """Decode a request body: strict JSON (no NaN/Infinity, numbers in range), at most
    ``MAX_JSON_DEPTH`` deep; ``ApiError`` (400) otherwise."""
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise _deep_error() from None
    # a body can only be that deep with that many brackets: most bodies skip the walk
    if (
        isinstance(value, (dict, list))
        and raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
        and _too_deep(value, MAX_JSON_DEPTH)
    ):
        raise _deep_error()
    return value


class _CompletionHead(msgspec.Struct):
    """The fields the token-id fast path reads; the prompt stays raw JSON bytes."""

    model: Any = None
    prompt: msgspec.Raw = msgspec.Raw()
    stream: Any = None
    nvext: Any = None
    cache_salt: Any = None


_head_decoder = msgspec.json.Decoder(_CompletionHead)


def parse_token_prompt(raw: bytes) -> ParsedRequest | None:
    """The common completion - a non-empty list of token ids, a model, no ``nvext`` - read
    without a dict or a Python int per token; None for anything else (the general path
    decides, and says what is wrong). Accepts exactly what the general path accepts, with
    the same result (tests/test_parsing_fastpath.py checks it on generated bodies)."""
    common = read_common_completion(raw)  # the usual body, in one pass over its bytes
    if common is not None:
        model, ids, stream, salt = common
        return ParsedRequest(COMPLETIONS, raw, model, stream, prompt_ids=ids, cache_salt=salt)
    return parse_token_prompt_decoded(raw)


def parse_token_prompt_decoded(raw: bytes) -> ParsedRequest | None:
    """``parse_token_prompt`` for the bodies its one-pass reader leaves (escapes, non-ASCII
    text, nested values, repeated keys...): the fields it reads decoded by ``msgspec``, the
    prompt kept raw and read by ``parse_token_ids``."""
    try:
        head = _head_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    model, stream = head.model, head.stream
    if not isinstance(model, str) or not model or head.nvext is not None:
        return None
    if stream is not None and not isinstance(stream, bool):
        return None
    ids = parse_token_ids(head.prompt)  # None at once for a text prompt
    if ids is None:
        return None
    # shallow bodies only: the dict decoded later on demand cannot then be too deep. The
    # prompt is one flat list (one "["), so a body with fewer than MAX_JSON_DEPTH bytes
    # besides it holds at most MAX_JSON_DEPTH brackets, and the usual body skips both passes
    # over its bytes (~2.6 us)
    if len(raw) - len(head.prompt) + 1 > MAX_JSON_DEPTH and (
        raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    ):
        return None
    salt = head.cache_salt
    return ParsedRequest(
        path=COMPLETIONS,
        raw=raw,
        model=model,
        stream=bool(stream),
        prompt_ids=ids,
        cache_salt=salt if isinstance(salt, str) else None,
    )


def parse_request(raw: bytes, path: str) -> ParsedRequest:
    """Parse and validate one request body for ``path``; raises ``ApiError``."""
    if path == COMPLETIONS:
        fast = parse_token_prompt(raw)
        if fast is not None:
            return fast
    return parse_request_general(raw, path)


def parse_request_general(raw: bytes, path: str) -> ParsedRequest:
    """``parse_request`` without the token-id fast path: every body shape, every error."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "missing required field 'model' (a non-empty string)",
            code="missing_field",
            param="model",
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    nvext = body.get("nvext")
    if nvext is not None and not isinstance(nvext, dict):
        raise bad_request("'nvext' must be an object", param="nvext")

    salt = body.get("cache_salt")
    req = ParsedRequest(
        path=path,
        raw=raw,
        model=model,
        stream=stream,
        decoded=body,
        nvext=nvext,
        cache_salt=salt if isinstance(salt, str) else None,
    )
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "missing required field 'messages' (a non-empty list)",
                code="missing_field",
                param="messages",
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(
                    f"messages[{i}] must be an object with a string 'role'", param="messages"
                )
        req.messages = messages
    else:
        if "prompt" not in body:
            raise bad_request(
                "missing required field 'prompt'", code="missing_field", param="prompt"
            )
        prompt = body["prompt"]
        first = prompt[0] if isinstance(prompt, list) and prompt else None
        if isinstance(prompt, str):
            req.prompt_text = prompt
        elif isinstance(first, int):
            req.prompt_ids = _check_token_ids(prompt, "prompt")
        elif isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            # a batch: split per prompt by the frontend (kvplug/frontend/batch.py); a batch
            # of one is a single prompt
            req.prompt_text = first
            req.batch_size = len(prompt)
            if len(prompt) > 1:
                req.prompts = prompt
        elif isinstance(first, list) and all(isinstance(p, list) and p for p in prompt):
            req.prompt_ids = _check_token_ids(first, "prompt[0]")
            req.batch_size = len(prompt)
            if len(prompt) > 1:
                req.prompts = [req.prompt_ids] + [
                    _check_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt) if i
                ]
        else:
            raise bad_request(
                "'prompt' must be a non-empty string, list of token ids, list of strings "
                "or list of token-id lists",
                param="prompt",
            )

    if nvext is not None:
        token_data = nvext.get("token_data")
        if token_data is not None:
            if not isinstance(token_data, list) or not token_data:
                raise bad_request(
                    "'nvext.token_data' must be a non-empty list of token ids",
                    param="nvext.token_data",
                )
            req.prompt_ids = _check_token_ids(token_data, "nvext.token_data")
        forwarded = {k: v for k, v in body.items() if k != "nvext"}
        req.raw = _encoder.encode(forwarded)
    return req

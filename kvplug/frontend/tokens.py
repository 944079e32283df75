"""Token ids for routing, and which source they came from.

Order: the request itself (``prompt`` as token ids, or ``nvext.token_data``) → the local
tokenizer directory (``--tokenizer PATH``: ``tokenizer.json`` for the ``tokenizers`` library,
``tokenizer_config.json`` / ``chat_template.jinja`` / ``chat_template.json`` for the chat template,
rendered with jinja2; nothing is downloaded) → the engine's token endpoint → none (the router
then routes on load only). The source is recorded in the decision trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvplug.errors import ConfigError
from kvplug.frontend.errors import ApiError
from kvplug.frontend.parsing import ParsedRequest
from kvplug.frontend.prefix_tokens import PrefixTokenCache

log = logging.getLogger(__name__)

SOURCE_REQUEST = "request"
SOURCE_TOKENIZER = "tokenizer"
SOURCE_ENGINE = "engine"
SOURCE_NONE = "none"
SOURCES = (SOURCE_REQUEST, SOURCE_TOKENIZER, SOURCE_ENGINE, SOURCE_NONE)

_OFFLOAD_CHARS = 32_768  # longer texts are tokenized on a thread so routing never stalls


def _special(value: Any) -> str | None:
    """``bos_token`` and friends are either a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str):
    raise ValueError(f"chat template raised: {message}")


class LocalTokenizer:
    """A tokenizer directory on disk (no network access)."""

    def __init__(self, path: str | Path, prefix_cache_chunks: int = 16_384) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"--tokenizer {self.path}: not a directory")
        config_file = self.path / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if config_file.exists():
            try:
                self.config = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{config_file}: unreadable ({exc})") from None
        self.bos_token = _special(self.config.get("bos_token"))
        self.eos_token = _special(self.config.get("eos_token"))
        self._encode, encode_many = self._load_encoder()
        # repeated text (system prompts, conversation history) is tokenized once: see
        # kvplug/frontend/prefix_tokens.py (switches itself off for tokenizers it cannot serve)
        self.prefix_cache = (
            PrefixTokenCache(encode_many, capacity=prefix_cache_chunks, name=str(self.path))
            if prefix_cache_chunks > 0
            else None
        )
        self.chat_template_source = self._load_chat_template()
        self._template = None
        if self.chat_template_source is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ConfigError(
                    "chat templates need jinja2: pip install 'kvplug[tokenizers]'"
                ) from None
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template_source)
            except Exception as exc:  # jinja2.TemplateSyntaxError and friends
                raise ConfigError(f"{self.path}: chat template does not compile: {exc}") from None

    def _load_encoder(
        self,
    ) -> tuple[Callable[[str, bool], list[int]], Callable[[Sequence[str], bool], list[list[int]]]]:
        """``(encode one text, encode several)`` with the library the directory needs."""
        tj = self.path / "tokenizer.json"
        if tj.exists():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ConfigError(
                    "--tokenizer needs the 'tokenizers' package: pip install 'kvplug[tokenizers]'"
                ) from None
            # the event loop tokenizes inline: the library's thread pool only adds wake-ups
            # (encode_batch_fast of one 2,800-character prompt: 166-184 us of CPU without it,
            # 221-230 with it); a value the user set is kept
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            try:
                tok = Tokenizer.from_file(str(tj))
            except Exception as exc:
                raise ConfigError(f"{tj}: not a tokenizers file ({exc})") from None

            fast = getattr(tok, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets

            def encode(text: str, add_special: bool) -> list[int]:
                if fast is not None:
                    return fast([text], add_special_tokens=add_special)[0].ids
                return tok.encode(text, add_special_tokens=add_special).ids

            batch = fast if fast is not None else tok.encode_batch

            def encode_many(texts: Sequence[str], add_special: bool) -> list[list[int]]:
                return [e.ids for e in batch(list(texts), add_special_tokens=add_special)]

            return encode, encode_many
        try:  # slow (sentencepiece) tokenizers need transformers, if installed
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError(
                f"{self.path} has no tokenizer.json (and transformers is not "
                "installed to read other formats)"
            ) from None
        try:
            hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"{self.path}: transformers cannot load it ({exc})") from None

        def encode_hf(text: str, add_special: bool) -> list[int]:
            return list(hf.encode(text, add_special_tokens=add_special))

        def encode_many_hf(texts: Sequence[str], add_special: bool) -> list[list[int]]:
            return [encode_hf(t, add_special) for t in texts]

        return encode_hf, encode_many_hf

    def _load_chat_template(self) -> str | None:
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text()
        json_file = self.path / "chat_template.json"
        template: Any = None
        if json_file.exists():
            try:
                template = json.loads(json_file.read_text()).get("chat_template")
            except (OSError, ValueError, AttributeError) as exc:
                raise ConfigError(f"{json_file}: unreadable ({exc})") from None
        if template is None:
            template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | np.ndarray:
        """Token ids: a list, or a uint32 array when the prefix cache assembled them."""
        if self.prefix_cache is not None:
            return self.prefix_cache.encode(text, add_special_tokens)
        return self._encode(text, add_special_tokens)

    def render_chat(self, messages: list, body: dict[str, Any] | None = None) -> str:
        if self._template is None:
            raise ValueError(f"{self.path} has no chat template")
        body = body or {}
        extra = body.get("chat_template_kwargs")
        return self._template.render(
            messages=messages,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **(extra if isinstance(extra, dict) else {}),
        )

    def encode_chat(
        self, messages: list, body: dict[str, Any] | None = None
    ) -> list[int] | np.ndarray:
        # the template writes the special tokens itself
        return self.encode(self.render_chat(messages, body), add_special_tokens=False)


def _chars(req: ParsedRequest) -> int:
    """The prompt's characters: the text, or the messages' contents."""
    return len(req.prompt_text or "") + sum(
        len(str(m.get("content", ""))) for m in req.messages or ()
    )


EngineTokenize = Callable[[ParsedRequest], Awaitable[list[int]]]


class TokenResolver:
    def __init__(self, tokenizer: LocalTokenizer | None, engine_tokenize: EngineTokenize | None):
        self.tokenizer = tokenizer
        self.engine_tokenize = engine_tokenize

    def _local(self, req: ParsedRequest) -> list[int] | np.ndarray | None:
        tok = self.tokenizer
        if tok is None:
            return None
        if req.messages is not None:
            if not tok.has_chat_template:
                return None
            return tok.encode_chat(req.messages, req.body)
        return tok.encode(req.prompt_text or "")

    def resolve_now(self, req: ParsedRequest) -> tuple[list[int] | np.ndarray, str] | None:
        """``(token ids, source)`` when ``resolve`` would have them without waiting: the
        request's, or the local tokenizer's for a prompt it tokenizes on the loop; None
        otherwise (``resolve`` then finds them elsewhere, or says why not)."""
        if req.prompt_ids is not None:
            return req.prompt_ids, SOURCE_REQUEST
        if self.tokenizer is None or _chars(req) > _OFFLOAD_CHARS:
            return None
        try:
            ids = self._local(req)
        except Exception:  # resolve reports it (and asks the engine)
            return None
        return None if ids is None else (ids, SOURCE_TOKENIZER)

    async def resolve(
        self, req: ParsedRequest
    ) -> tuple[list[int] | np.ndarray | None, str, str | None]:
        """``(token ids or None, source, why the better sources failed or None)``."""
        if req.prompt_ids is not None:
            return req.prompt_ids, SOURCE_REQUEST, None
        note = None
        if self.tokenizer is not None:
            try:
                if _chars(req) > _OFFLOAD_CHARS:
                    ids = await asyncio.get_running_loop().run_in_executor(None, self._local, req)
                else:
                    ids = self._local(req)
                if ids is not None:
                    return ids, SOURCE_TOKENIZER, None
                note = "local tokenizer has no chat template"
            except Exception as exc:  # a template that raises on this request, bad content
                note = f"local tokenizer failed: {exc}"
                log.warning("tokenizing with %s failed: %s", self.tokenizer.path, exc)
        if self.engine_tokenize is not None:
            try:
                return await self.engine_tokenize(req), SOURCE_ENGINE, note
            except ApiError:  # the client's mistake (a prompt too large to send): it hears why
                raise
            except Exception as exc:
                note = f"{note + '; ' if note else ''}engine tokenize failed: {exc}"
                log.info("engine tokenization failed: %s", exc)
        return None, SOURCE_NONE, note or "no token source configured"

"""The API process's own tokenizer, for ``POST /tokenize`` and ``POST /detokenize`` (the workers never send ids
back). Loaded once, in the background; every call runs on its one thread (``minisgl-tokenize``), never on the
event loop, and is bounded: a text surely longer than the context (judged from its characters) is refused before
it is tokenized, and no more ids than the context length are decoded.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..core import ValidationError
from ..tokenizer.worker import _max_token_chars, apply_template
from .serving import APIError

logger = logging.getLogger("minisgl.server")
T = TypeVar("T")


def load_model_tokenizer(model: str) -> Any:
    """The tokenizer of ``--model`` (as the tokenizer workers load it), or None when it ships none."""
    from ..models import ModelSource, load_tokenizer

    return load_tokenizer(ModelSource.from_path(model))


class TextTools:
    """Tokenizes and detokenizes on a thread of its own, within the model's limits."""

    def __init__(self, load: Callable[[], Any], max_model_len: int | None = None, vocab_size: int | None = None):
        self._load = load
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
        self._loaded: Future[tuple[Any, int]] | None = None

    def start(self) -> None:
        """Start loading the tokenizer (in the background); calls made meanwhile wait for it."""
        if self._loaded is None:
            self._loaded = self._pool.submit(self._load_now)

    def _load_now(self) -> tuple[Any, int]:
        try:
            tok = self._load()
        except Exception:
            logger.exception("cannot load the tokenizer for /tokenize and /detokenize")
            raise
        return tok, (_max_token_chars(tok) if tok is not None else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        self.start()
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def _tokenizer(self, field: str) -> tuple[Any, int]:
        assert self._loaded is not None
        try:
            tok, max_chars = self._loaded.result()  # done: loading ran first on this one thread
        except Exception as exc:
            message = f"the tokenizer could not be loaded ({type(exc).__name__}: {exc}); see the server log"
            raise APIError(503, message, "server_error", code="service_unavailable") from None
        if tok is None:
            raise ValidationError(field, "this model has no tokenizer (its directory ships no tokenizer files)")
        return tok, max_chars

    async def chat_template(self) -> str | None:
        """The model's chat template (its text), or None (no tokenizer, or none that loaded)."""
        return await self._run(self._chat_template)

    def _chat_template(self) -> str | None:
        try:
            tok, _ = self._tokenizer("messages")
        except (APIError, ValidationError):
            return None
        template = getattr(tok, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default, and the one for tools
            template = "\n".join(str(t) for t in template.values())
        return template if isinstance(template, str) else None

    async def tokenize(self, *args: Any) -> tuple[list[int], list[str] | None]:
        """See :meth:`_tokenize`."""
        return await self._run(self._tokenize, *args)

    def _tokenize(
        self,
        source: str | list[dict[str, Any]],
        add_special_tokens: bool,
        add_generation_prompt: bool,
        strs: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[str] | None]:
        """Token ids (and their strings when ``strs``) of a prompt or of chat messages (with ``tools``)."""
        field = "prompt" if isinstance(source, str) else "messages"
        tok, max_chars = self._tokenizer(field)
        text = source
        if not isinstance(source, str):
            try:
                text = apply_template(tok, source, tools, add_generation_prompt)
            except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
                raise ValidationError("messages", f"cannot apply the chat template: {exc}") from None
        assert isinstance(text, str)
        limit = self.max_model_len
        at_least = math.ceil(len(text) / max_chars) if limit and max_chars > 0 else 0
        if limit and at_least > limit:
            message = f"the text has at least {at_least} tokens ({len(text)} characters), more than the context length"
            raise ValidationError(field, f"{message} {limit}")
        ids = [int(t) for t in tok.encode(text, add_special_tokens=add_special_tokens)]
        if limit and len(ids) > limit:
            raise ValidationError(field, f"the text has {len(ids)} tokens, more than the context length {limit}")
        return ids, (list(tok.convert_ids_to_tokens(ids)) if strs else None)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens included, as they are)."""
        return await self._run(self._detokenize, ids)

    def _detokenize(self, ids: list[int]) -> str:
        tok, _ = self._tokenizer("tokens")
        limit = self.max_model_len
        if limit and len(ids) > limit:
            raise ValidationError("tokens", f"{len(ids)} token ids, more than the context length {limit}")
        vocab = self.vocab_size or len(tok)
        bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
        if bad is not None:
            raise ValidationError("tokens", f"token id {ids[bad]} (item {bad}) is outside the vocabulary [0, {vocab})")
        return str(tok.decode(ids, skip_special_tokens=False))

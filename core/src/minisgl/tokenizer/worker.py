"""The tokenizer worker processes.

Requests from the API server are turned into token ids here (chat template
for chat messages), checked against the context length and vocabulary, and
sent on to the scheduler; a request that cannot run is answered straight to
the API server. The server runs several of these (``--tokenizer-workers``):
the API server sends each request to the least busy one, so one long prompt
never holds up the others, and none of this work runs in the API server's
event loop or the scheduler's GPU loop.
"""

from __future__ import annotations

import math
from typing import Any

from ..message import (
    GenerateReq,
    RequestFailed,
    TokenizedReq,
    TokenizerLimits,
)


class TokenizerService:
    """Tokenizes requests and checks their length; no sockets, so it is testable on its own."""

    def __init__(self, tokenizer: Any, limits: TokenizerLimits | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        # Characters per token at most (the longest vocabulary entry): a text of n characters has
        # at least n / this many tokens, which rejects a huge prompt before tokenizing it.
        self.max_token_chars = _max_token_chars(tokenizer) if tokenizer is not None else 0

    def tokenize(self, req: GenerateReq) -> TokenizedReq | RequestFailed:
        tok = self.tokenizer
        field = "messages" if req.messages is not None else "prompt"
        try:
            if req.input_ids is not None:
                ids = [int(t) for t in req.input_ids]
            elif tok is None:
                return RequestFailed(req.rid, field, "this model has no tokenizer; send token ids as the prompt")
            else:
                if req.messages is not None:
                    text = apply_template(tok, req.messages, req.tools, add_generation_prompt=True)
                else:
                    text = req.text or ""
                too_long = self._surely_too_long(text)
                if too_long is not None:
                    return RequestFailed(req.rid, field, too_long)
                # A chat template already wrote any BOS token the model wants.
                ids = list(tok.encode(text, add_special_tokens=req.messages is None))
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            return RequestFailed(req.rid, field, f"cannot tokenize the request: {exc}")
        problem = self._check(ids, req.params)
        if problem is not None:
            return RequestFailed(req.rid, *problem)
        return TokenizedReq(req.rid, ids, req.params)

    def _surely_too_long(self, text: str) -> str | None:
        if self.limits is None or self.max_token_chars <= 0:
            return None
        at_least = math.ceil(len(text) / self.max_token_chars)
        if at_least < self.limits.max_model_len:
            return None
        return (
            f"the prompt has at least {at_least} tokens ({len(text)} characters), "
            f"but the context length is {self.limits.max_model_len}"
        )

    def _check(self, ids: list[int], params: dict[str, Any]) -> tuple[str, str] | None:
        """The same length and vocabulary checks as the scheduler's, without the round trip."""
        limits = self.limits
        if limits is None:
            return None
        if not ids:
            return "prompt", "the prompt is empty"
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            return "prompt", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
        max_len = limits.max_model_len
        if len(ids) >= max_len:
            room = "(leave room for output)"
            return "prompt", f"the prompt has {len(ids)} tokens, but the context length is {max_len} {room}"
        max_new = params.get("max_tokens")
        if max_new is not None and len(ids) + max_new > max_len:
            return (
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) = {len(ids) + max_new} "
                f"exceeds the context length {max_len}",
            )
        return None


def apply_template(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> str:
    """The chat template applied to ``messages`` (and ``tools``, when there are any), as text."""
    extra = {"tools": tools} if tools else {}
    return str(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    )


def _max_token_chars(tokenizer: Any) -> int:
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no cheap bound
        return 0
    return max((len(t) for t in vocab), default=0)

"""Tokenizer workers: requests become token ids (chat template for messages) and are checked against the
context length and vocabulary before they reach the scheduler; a refusal goes straight to the API server.
Several run at once (``--tokenizer-workers``, least busy first), off the API event loop and the GPU loop."""

from __future__ import annotations

import math
from typing import Any

from ..core import prompt_problem
from ..message import GenerateReq, RequestFailed, TokenizedReq, TokenizerLimits


class TokenizerService:
    """Tokenizes requests and checks their length; no sockets, so it is testable on its own."""

    def __init__(self, tokenizer: Any, limits: TokenizerLimits | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        # Characters per token at most (the longest vocabulary entry): a text of n characters has
        # at least n / this many tokens, which rejects a huge prompt before tokenizing it.
        self.max_token_chars = _max_token_chars(tokenizer) if tokenizer is not None else 0

    def tokenize(self, req: GenerateReq) -> TokenizedReq | RequestFailed:
        tok, limits = self.tokenizer, self.limits
        field = "messages" if req.messages is not None else "prompt"
        try:
            if req.input_ids is not None:
                ids = [int(t) for t in req.input_ids]
            elif tok is None:
                return RequestFailed(req.rid, field, "this model has no tokenizer; send token ids as the prompt")
            else:
                if req.messages is not None:
                    # Cheap bounds first: rendering a huge conversation would hold up the requests behind it.
                    too_long = self._too_long(_content_chars(req.messages), len(req.messages))
                    if too_long is not None:
                        return RequestFailed(req.rid, field, too_long)
                    text = apply_template(tok, req.messages, req.tools, add_generation_prompt=True)
                else:
                    text = req.text or ""
                too_long = self._too_long(len(text), 0)
                if too_long is not None:
                    return RequestFailed(req.rid, field, too_long)
                # A chat template already wrote any BOS token the model wants.
                ids = list(tok.encode(text, add_special_tokens=req.messages is None))
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            return RequestFailed(req.rid, field, f"cannot tokenize the request: {exc}")
        if limits is not None:  # the scheduler's own checks, without the round trip
            problem = prompt_problem(ids, req.params.get("max_tokens"), limits.max_model_len, limits.vocab_size)
            if problem is not None:
                return RequestFailed(req.rid, *problem)
        return TokenizedReq(req.rid, ids, req.params)

    def _too_long(self, chars: int, messages: int) -> str | None:
        """Why a prompt of at least ``chars`` characters (or ``messages`` messages, each at least one token once
        rendered) cannot fit the context, from these counts alone, or None."""
        limits = self.limits
        if limits is None:
            return None
        if messages >= limits.max_model_len:
            return (
                f"the conversation has {messages} messages, each at least one token, but the context length is "
                f"{limits.max_model_len}"
            )
        at_least = math.ceil(chars / self.max_token_chars) if self.max_token_chars > 0 else 0
        if at_least >= limits.max_model_len:
            return (
                f"the prompt has at least {at_least} tokens ({chars} characters), "
                f"but the context length is {limits.max_model_len}"
            )
        return None


def _content_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text that a rendered conversation holds at least once (an assistant's is left
    out: some templates shorten earlier replies, dropping their reasoning)."""
    return sum(
        len(m["content"]) for m in messages if m.get("role") != "assistant" and isinstance(m.get("content"), str)
    )


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

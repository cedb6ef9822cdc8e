"""Incremental detokenization with stop strings.

A token's text can depend on the tokens before it, so each step decodes a short window and returns what it adds,
holding back a window that ends in an incomplete character (U+FFFD); fast tokenizers do this in Rust
(``tokenizers.decoders.DecodeStream``). Text that could still become a stop string is held back too, and only it
is searched, so a stream never shows text past a stop and the work per token does not grow with the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
# Tokens of context before the held-back ones when flushing: enough for any merge to settle.
_FLUSH_CONTEXT = 4


class _WindowDecoder:
    """New text per token from two ``tokenizer.decode`` calls (any tokenizer)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text was returned

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, token: int) -> str | None:
        """The text ``token`` completes, or None while it ends in a partial character."""
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix :])
        if window.endswith(_INCOMPLETE):
            return None
        return self._advance(window)

    def _advance(self, window: str) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        self._prefix, self._read = self._read, len(self.ids)
        return window[len(before) :]

    def flush(self) -> str:
        """Text of the tokens still held back (a partial character shows as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        return self._advance(self._decode(self.ids[self._prefix :]))


class _StreamDecoder(_WindowDecoder):
    """New text per token from ``tokenizers``' Rust ``DecodeStream`` (fast tokenizers)."""

    def __init__(self, backend: Any, stream_cls: Any, tokenizer: Any, skip_special_tokens: bool):
        super().__init__(tokenizer, skip_special_tokens)
        self.backend = backend
        self.stream = stream_cls(skip_special_tokens=skip_special_tokens)

    def step(self, token: int) -> str | None:
        self.ids.append(token)
        piece = self.stream.step(self.backend, token)
        if piece is not None:
            self._read = len(self.ids)
        return piece

    def flush(self) -> str:
        self._prefix = max(0, self._read - _FLUSH_CONTEXT)
        return super().flush()


def _piece_decoder(tokenizer: Any, skip_special_tokens: bool) -> _WindowDecoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            pass
        else:
            return _StreamDecoder(backend, DecodeStream, tokenizer, skip_special_tokens)
    return _WindowDecoder(tokenizer, skip_special_tokens)


class IncrementalDetokenizer:
    """The output text of one request, produced a token at a time."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.stop = tuple(s for s in stop if s)
        self._pieces = _piece_decoder(tokenizer, skip_special_tokens)
        self._held = ""  # decoded text not returned yet: it may start a stop string
        self.stopped = False  # a stop string was found; later tokens add nothing

    def push(self, token: int, *, final: bool = False) -> str:
        """Add ``token``; return the text that can be shown now."""
        if self.stopped:
            return ""
        piece = self._pieces.step(token)
        if piece is None and final:
            piece = self._pieces.flush()
        if piece:
            self._held += piece
        return self._release(final)

    def finish(self) -> str:
        """Text still held back when the request ends."""
        if self.stopped:
            return ""
        self._held += self._pieces.flush()
        return self._release(True)

    def _release(self, final: bool) -> str:
        held = self._held
        if not self.stop:
            self._held = ""
            return held
        cut = min((i for i in (held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return held[:cut]
        keep = 0 if final else _partial_stop_len(held, self.stop)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string."""
    best = 0
    for s in stops:
        # Candidates start where s's first character occurs in the last len(s) - 1 characters;
        # the leftmost match is the longest.
        i = text.find(s[0], max(0, len(text) - len(s) + 1))
        while i != -1 and len(text) - i > best:
            if s.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return best

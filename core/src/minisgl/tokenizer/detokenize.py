"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and merges (a token's
text can depend on the token before it), so each step decodes a short window:
the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is the new
text. A window that ends in an incomplete character (U+FFFD) is held back until
the next token completes it.

Stop strings: text that could still become a stop string is held back, and the
output is cut where a stop string begins, so a streamed response never shows
text past a stop and equals the non-streamed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The output text of one request, produced a token at a time."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text is already in self.text
        self.text = ""  # decoded text so far (cut at a stop string once one is seen)
        self._sent = 0  # characters of self.text already returned
        self.stopped = False  # a stop string was found; later tokens add nothing

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int, *, final: bool = False) -> str:
        """Add ``token``; return the text that can be shown now."""
        if not self.stopped:
            self.ids.append(token)
            window = self._decode(self.ids[self._prefix :])
            if not window.endswith(_INCOMPLETE) or final:
                before = self._decode(self.ids[self._prefix : self._read])
                self.text += window[len(before) :]
                self._prefix, self._read = self._read, len(self.ids)
                self._apply_stop()
        return self._take(final)

    def finish(self) -> str:
        """Text still held back when the request ends."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix : self._read])
            self.text += self._decode(self.ids[self._prefix :])[len(before) :]
            self._read = len(self.ids)
            self._apply_stop()
        return self._take(True)

    def _apply_stop(self) -> None:
        if not self.stop:
            return
        # Only the new text (plus a stop string's length before it) can hold a new match.
        start = max(0, self._sent - max(len(s) for s in self.stop))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end -= _partial_stop_len(self.text, self.stop)
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best

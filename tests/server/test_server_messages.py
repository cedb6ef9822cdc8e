"""Messages between processes, and incremental detokenization with stop strings (in-process, no server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from transformers import AutoTokenizer

from minisgl.message import (
    MESSAGE_TYPES,
    GenerateReq,
    Heartbeat,
    OutputBatch,
    StepOutput,
    TokenizerLimits,
    WorkerStatus,
    decode,
    encode,
)
from minisgl.tokenizer import IncrementalDetokenizer
from minisgl.tokenizer.detokenize import _partial_stop_len, _StreamDecoder, _WindowDecoder
from minisgl.tokenizer.detokenizer import DetokenizerService
from minisgl.tokenizer.worker import TokenizerService


def test_messages_round_trip() -> None:
    samples = [
        GenerateReq(3, {"temperature": 0.5, "stop": ["x"]}, messages=[{"role": "user", "content": "é"}]),
        GenerateReq(4, {}, input_ids=[1, 2, 3]),
        StepOutput([1, 2], [5, 6], [[1, "stop", True, 16]], [None, [-0.5, [[6, -0.5]]]], [[2, 9, ["x"], True, True]]),
        OutputBatch([1], ["hi"], [3], [[0, "length", 7, 0]], [[["hi", -0.1, [["ho", -2.0]]]]], [[4, "prompt", "no"]]),
        WorkerStatus("scheduler-0", "ready", info={"max_model_len": 256}),
        Heartbeat("scheduler-0", 0.25, {"running": 3}),
        TokenizerLimits(256, 512),
    ]
    for msg in samples:
        assert decode(encode(msg)) == msg
    assert len({cls.__name__ for cls in MESSAGE_TYPES}) == len(MESSAGE_TYPES)


def test_messages_are_msgpack_not_pickle() -> None:
    data = encode(GenerateReq(1, {}, text="hello"))
    assert not data.startswith(b"\x80")  # pickle protocol marker
    ext = msgpack.unpackb(data, raw=False)
    assert isinstance(ext, msgpack.ExtType)
    with pytest.raises(TypeError, match="cannot encode object"):
        encode(object())


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


TEXT = "Héllo wörld — naïve café 東京 🙂 ok, fine; the end."


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.push(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return pieces + [detok.finish()]


def test_incremental_text_equals_full_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # split characters are held back, never shown broken


def test_stop_string_cuts_and_holds_back(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop=["café"])
    pieces = stream(detok, ids)
    assert "".join(pieces) == "Héllo wörld — naïve "
    assert detok.stopped
    # A stop string that never completes: everything comes out at the end.
    detok = IncrementalDetokenizer(tokenizer, stop=["the beginning"])
    assert "".join(stream(detok, ids)) == TEXT


def test_partial_stop_is_held_back_until_it_cannot_match(tokenizer: Any) -> None:
    ids = tokenizer.encode("abc abd")
    detok = IncrementalDetokenizer(tokenizer, stop=["abd!"])
    shown = ""
    for t in ids:
        shown += detok.push(t)
        assert not shown.endswith("ab")  # "ab" could start "abd!": not shown yet
    assert shown + detok.finish() == "abc abd"


def test_stream_decoder_equals_window_decoder(tokenizer: Any) -> None:
    """The Rust fast path gives the same pieces as the Python windows, incomplete characters included."""
    ids = tokenizer.encode(TEXT) + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + tokenizer.encode(" ok")
    for skip in (True, False):
        fast = _StreamDecoder(tokenizer.backend_tokenizer, _decode_stream(), tokenizer, skip)
        slow = _WindowDecoder(tokenizer, skip)
        # (A token that adds no text may come out as None from one and "" from the other.)
        assert [fast.step(t) or "" for t in ids] == [slow.step(t) or "" for t in ids]
        assert fast.flush() == slow.flush() == ""
    # A token stream that ends inside a character: the flush shows what is there.
    cut = tokenizer.encode("東")[:1]
    fast = _StreamDecoder(tokenizer.backend_tokenizer, _decode_stream(), tokenizer, True)
    slow = _WindowDecoder(tokenizer, True)
    assert [fast.step(t) for t in cut] == [slow.step(t) for t in cut] == [None]
    assert fast.flush() == slow.flush() == tokenizer.decode(cut)


def _decode_stream() -> Any:
    return pytest.importorskip("tokenizers.decoders").DecodeStream


def test_partial_stop_len() -> None:
    assert _partial_stop_len("abc ab", ["abd!"]) == 2
    assert _partial_stop_len("abc ab", ["xyz"]) == 0
    assert _partial_stop_len("aaaa", ["aaab"]) == 3
    assert _partial_stop_len("the end", ["end of", "e"]) == 3  # the longest over all stop strings
    assert _partial_stop_len("", ["abc"]) == 0


def test_long_output_and_stop_strings_cost_work_per_token_not_per_output(tokenizer: Any) -> None:
    """Held-back text is all a stop string can start in: it stays short however long the output grows."""
    stop = "x" * 120 + "!"
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "never appears"])
    ids = tokenizer.encode("word " * 3000)
    out = "".join(detok.push(t) for t in ids)
    assert len(detok._held) < len(stop) + 8
    assert out + detok.finish() == tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_service_checks_limits_before_the_scheduler(tokenizer: Any) -> None:
    service = TokenizerService(tokenizer, TokenizerLimits(max_model_len=64, vocab_size=tokenizer.vocab_size))
    ok = service.tokenize(GenerateReq(1, {"max_tokens": 8}, text="Hello there"))
    assert ok.input_ids == tokenizer.encode("Hello there")  # type: ignore[union-attr]
    long = service.tokenize(GenerateReq(2, {"max_tokens": 8}, text="word " * 200))
    assert long.field == "prompt" and "context length is 64" in long.message  # type: ignore[union-attr]
    room = service.tokenize(GenerateReq(3, {"max_tokens": 60}, text="a b c d e f g h"))
    assert room.field == "max_tokens" and "exceeds the context length 64" in room.message  # type: ignore[union-attr]
    vocab = service.tokenize(GenerateReq(4, {"max_tokens": 8}, input_ids=[1, 10**9]))
    assert vocab.field == "prompt" and "outside the vocabulary" in vocab.message  # type: ignore[union-attr]
    empty = service.tokenize(GenerateReq(5, {"max_tokens": 8}, input_ids=[]))
    assert empty.message == "the prompt is empty"  # type: ignore[union-attr]


def test_huge_prompt_is_refused_without_tokenizing_it(tokenizer: Any) -> None:
    service = TokenizerService(tokenizer, TokenizerLimits(max_model_len=64, vocab_size=tokenizer.vocab_size))
    calls = []
    original = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        failed = service.tokenize(GenerateReq(1, {}, text="x" * 5_000_000))
    finally:
        tokenizer.encode = original
    assert calls == []
    assert failed.field == "prompt" and "at least" in failed.message  # type: ignore[union-attr]


def test_tokenizer_service_chat_template(tokenizer: Any) -> None:
    service = TokenizerService(tokenizer)
    req = GenerateReq(7, {"stop": [], "logprobs": 0}, messages=[{"role": "user", "content": "Hi"}])
    tokenized = service.tokenize(req)
    text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    assert tokenized.input_ids == tokenizer.encode(text, add_special_tokens=False)  # type: ignore[union-attr]


def test_detokenizer_service_stop_token_logprobs_and_counts(tokenizer: Any) -> None:
    service = DetokenizerService(tokenizer)
    ids = tokenizer.encode(" Hello there")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    toks = [*ids, eos]
    lps = [[-1.0, [[t, -1.0]]] for t in ids] + [[-0.1, []]]
    step = StepOutput([7] * len(toks), toks, [[len(ids), "stop", True, 4]], lps, [[7, 12, [], True, True]])
    out, stopped = service.process(step)
    assert "".join(out.texts) == " Hello there"  # the stop token's text is not output
    assert out.counts == list(range(1, len(toks) + 1))
    assert out.finished == [[len(ids), "stop", 12, 4]]
    assert out.logprobs is not None
    assert out.logprobs[0] == [[tokenizer.decode([ids[0]]), -1.0, [[tokenizer.decode([ids[0]]), -1.0]]]]
    assert stopped == [] and 7 not in service.live


def test_detokenizer_service_stop_string_finishes_and_tells_the_scheduler(tokenizer: Any) -> None:
    service = DetokenizerService(tokenizer)
    ids = tokenizer.encode("one two three four")
    accepted = [[1, 5, [" three"], True, False], [2, 5, [], True, False]]
    out, stopped = service.process(StepOutput([1, 2], [ids[0], ids[0]], accepted=accepted))
    assert out.finished == [] and stopped == []
    texts = {1: out.texts[0], 2: out.texts[1]}
    for t in ids[1:]:
        out, hit = service.process(StepOutput([1, 2], [t, t]))
        stopped += hit
        for rid, text in zip(out.rids, out.texts, strict=True):
            texts[rid] += text
        if hit:
            assert out.finished == [[0, "stop", 5, 0]]
    assert stopped == [1]
    assert texts[1] == "one two"  # cut where the stop string begins
    assert texts[2] == "one two three four"
    # After the stop, tokens still in flight for request 1 are dropped; an abort frees request 2.
    out, _ = service.process(StepOutput([1], [ids[0]], dropped=[2]))
    assert out.rids == [] and service.live == {}


def test_detokenizer_service_forwards_refusals(tokenizer: Any) -> None:
    service = DetokenizerService(tokenizer)
    out, _ = service.process(StepOutput(failed=[[9, "max_tokens", "too many"]]))
    assert out.failed == [[9, "max_tokens", "too many"]] and out.rids == []

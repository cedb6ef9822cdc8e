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
    OutputBatch,
    StepOutput,
    TokenEventMsg,
    TokenOutput,
    WorkerStatus,
    decode,
    encode,
)
from minisgl.tokenizer import IncrementalDetokenizer
from minisgl.tokenizer.worker import TokenizerService


def test_messages_round_trip() -> None:
    samples = [
        GenerateReq(3, {"temperature": 0.5, "stop": ["x"]}, messages=[{"role": "user", "content": "é"}]),
        GenerateReq(4, {}, input_ids=[1, 2, 3]),
        StepOutput([TokenEventMsg(1, 5, False), TokenEventMsg(2, 6, True, "stop", True, 16, -0.5, [[6, -0.5]])]),
        OutputBatch([TokenOutput(1, "hi", [5], True, "length", 3, 0, [["hi", -0.1, [["ho", -2.0]]]])]),
        WorkerStatus("scheduler-0", "ready", info={"max_model_len": 256}),
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


def test_tokenizer_service_chat_template_and_stop_token(tokenizer: Any) -> None:
    service = TokenizerService(tokenizer)
    req = GenerateReq(7, {"stop": [], "logprobs": 0}, messages=[{"role": "user", "content": "Hi"}])
    tokenized = service.tokenize(req)
    text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    assert tokenized.input_ids == tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(" Hello there")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    events = [TokenEventMsg(7, t, False, logprob=-1.0, top=[[t, -1.0]]) for t in ids]
    events.append(TokenEventMsg(7, eos, True, "stop", stop_token=True, logprob=-0.1, top=[]))
    outs = service.detokenize(StepOutput(events)).outputs
    assert "".join(o.text for o in outs) == " Hello there"  # the stop token's text is not output
    assert [o.completion_tokens for o in outs] == list(range(1, len(ids) + 2))
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[0].logprobs == [[tokenizer.decode([ids[0]]), -1.0, [[tokenizer.decode([ids[0]]), -1.0]]]]
    assert 7 not in service.live

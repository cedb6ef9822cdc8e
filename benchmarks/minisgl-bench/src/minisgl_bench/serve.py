"""Online serving benchmark: ``minisgl bench serve``, a client for any OpenAI-compatible server.

It streams ``/v1/chat/completions`` (or ``/v1/completions``) requests of a workload
(``random``, the benchmark protocol's; ``shared-prefix``; ``long-prompt``; see
``serve_workloads``) to ``--base-url`` with arrivals all at once, Poisson at a rate,
or at a fixed concurrency, and measures time to first token, time per output
token, inter-token latency, end-to-end latency, throughput and the prefix-cache hit
rate the server reports (``usage.prompt_tokens_details.cached_tokens``). ``--rate 8 32
inf`` sweeps, one run per rate against the same server; ``--repeat N`` runs the sweep N
times (fresh prompts, other arrival seeds) and reports each figure's median, min and max,
and the rate where the median TTFT p99 crosses ``--ttft-target-ms``. Output tokens come
from each stream's final usage chunk (``stream_options.include_usage``); servers that send
none are counted by text chunks, or by ``max_tokens`` with ``--fallback-count
max-tokens``. ``--launch CMD`` starts the server and stops its whole process group
however the benchmark ends (``serve_launch``); ``--trace`` asks it for its step trace.
Results are printed and written as JSON (machine, command, commit, date, server,
workload, one record per run, the summary) to ``--output``; ``minisgl bench plot``
draws them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .offline import _git_commit, _machine, write_record
from .serve_client import RequestResult, Target, get_json, stream
from .serve_launch import launched, stop_on_signal
from .serve_summary import HEADER, aggregate, cache_figures, crossing_rate, run_row, summary_table
from .serve_workloads import Conversation, Workload, arrival_times, build_workload, load_decode

WARMUP_ID_SEED = 1
WARMUP_DEFAULT = 16
ERRORS_KEPT = 5


@dataclass(frozen=True)
class Server:
    """The server under test and how every request to it is shaped."""

    target: Target
    model: str
    chat: bool = True
    temperature: float = 0.6
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout: float = 600.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, system: str | None, history: list[str], text: str, max_tokens: int) -> dict[str, Any]:
        """A request: ``history`` alternates earlier questions and answers."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            roles = ("user", "assistant")
            messages += [{"role": roles[i % 2], "content": m} for i, m in enumerate(history)]
            body["messages"] = [*messages, {"role": "user", "content": text}]
        else:
            body["prompt"] = "\n\n".join([*([system] if system is not None else []), *history, text])
        return {**body, **self.extra_body}


@dataclass
class RunResult:
    """The requests of one run and what the client saw around them."""

    results: list[RequestResult]
    duration: float
    skipped: int
    max_in_flight: int
    client_cpu_s: float
    t0: float = 0.0  # the run's start (perf_counter seconds): request starts are reported relative to it
    t0_unix: float = 0.0  # the same instant in unix seconds, to place the run in a server's step trace


async def run_workload(
    server: Server,
    work: Workload,
    rate: float = math.inf,
    concurrency: int | None = None,
    seed: int = 0,
    progress: Callable[[], object] | None = None,
) -> RunResult:
    """Send every conversation of ``work``: arrivals at ``rate`` (Poisson, seeded), at most ``concurrency`` in flight.

    A conversation's turns go one after another; when a turn fails, its later turns
    are skipped (counted, not sent). One failed request never stops the run.
    """
    arrivals = arrival_times(len(work.conversations), rate, seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = []
    in_flight = [0, 0]  # now, most seen
    skipped = 0

    async def one(conv: Conversation, at: float, t0: float) -> None:
        nonlocal skipped
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[str] = []
        history_tokens = 0  # earlier questions (ids drawn) and answers (tokens generated)
        for k, turn in enumerate(conv.turns):
            keep = k + 1 < len(conv.turns)
            body = server.body(work.system, history, turn.text, turn.max_tokens)
            if gate is not None:
                await gate.acquire()
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                res = await stream(server.target, server.path, body, keep_text=keep, timeout=server.timeout)
            finally:
                in_flight[0] -= 1
                if gate is not None:
                    gate.release()
            res.max_tokens = turn.max_tokens
            res.turn = k
            res.drawn_input_tokens = work.system_tokens + history_tokens + turn.drawn_tokens
            results.append(res)
            if progress is not None:
                progress()
            if res.error is not None:
                skipped += len(conv.turns) - k - 1
                return
            if keep:
                history += [turn.text, res.answer(server.chat)]
                answered = res.usage_output_tokens if res.usage_output_tokens is not None else len(res.chunk_times)
                history_tokens += turn.drawn_tokens + answered

    cpu0 = time.process_time()
    t0_unix, t0 = time.time(), time.perf_counter()
    await asyncio.gather(*(one(c, at, t0) for c, at in zip(work.conversations, arrivals, strict=True)))
    duration = time.perf_counter() - t0
    return RunResult(results, duration, skipped, in_flight[1], time.process_time() - cpu0, t0, t0_unix)


def _stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(run: RunResult, fallback: str = "chunks") -> dict[str, Any]:
    """One run's record: throughput, token counts, latency statistics (ms), prefix-cache hits and errors.

    Output tokens of a request: its usage chunk's ``completion_tokens``; without one,
    its text chunks (``fallback="chunks"``) or its ``max_tokens`` (``"max-tokens"``).
    """
    ok = [r for r in run.results if r.error is None]
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    out_tokens = in_tokens = by_usage = 0
    # Per request (ordered by start), to tell what a tail is made of: arrivals that bunch up, long prompts, ...
    columns = ("start_s", "turn", "input_tokens", "cached_tokens", "output_tokens", "ttft_ms")
    detail: dict[str, list[float | int | None]] = {k: [] for k in columns}
    for r in sorted(ok, key=lambda r: r.start):
        if r.usage_output_tokens is not None:
            n = r.usage_output_tokens
            by_usage += 1
        else:
            n = len(r.chunk_times) if fallback == "chunks" else r.max_tokens
        n_in = r.usage_input_tokens if r.usage_input_tokens is not None else r.drawn_input_tokens
        out_tokens += n
        in_tokens += n_in
        e2e.append(r.end - r.start)
        times = r.chunk_times
        first = round((times[0] - r.start) * 1000.0, 2) if times else None
        row = (round(r.start - run.t0, 4), r.turn, n_in, r.usage_cached_tokens, n, first)
        for key, value in zip(detail, row, strict=True):
            detail[key].append(value)
        if times:
            ttft.append(times[0] - r.start)
            itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
            if n > 1 and len(times) > 1:
                tpot.append((times[-1] - times[0]) / (n - 1))
    errors = [r.error for r in sorted(run.results, key=lambda r: r.end) if r.error is not None]
    d = run.duration
    return {
        "requests": len(run.results) + run.skipped,
        "completed": len(ok),
        "errors": len(errors),
        "error_messages": errors[:ERRORS_KEPT],
        "skipped": run.skipped,
        "start_unix": run.t0_unix,
        "duration_s": d,
        "request_throughput": len(ok) / d if d > 0 else 0.0,
        "output_throughput": out_tokens / d if d > 0 else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "max_tokens_requested": sum(r.max_tokens for r in ok),
        "requests_with_usage": by_usage,
        "output_token_count": "usage" if by_usage == len(ok) else f"usage for {by_usage}, else {fallback}",
        "text_chunks": sum(len(r.chunk_times) for r in ok),
        "socket_reads": sum(r.reads for r in run.results),
        "max_in_flight": run.max_in_flight,
        "client_cpu_s": run.client_cpu_s,
        **cache_figures(ok),
        "ttft_ms": _stats_ms(ttft),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms(itl),
        "e2e_ms": _stats_ms(e2e),
        "per_request": detail,
    }


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate is requests per second > 0, or inf; got {text}")
    return rate


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisgl bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="default: %(default)s")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, model directory, .gguf or dist:NAME")
    p.add_argument(
        "--workload",
        choices=("random", "shared-prefix", "long-prompt"),
        default="random",
        help="random: the benchmark protocol's (default)",
    )
    p.add_argument(
        "--num-requests",
        type=_positive,
        default=256,
        help="requests per run; shared-prefix: users x turns (default: %(default)s)",
    )
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="prompt token ids (per workload)")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="max_tokens (per workload)")
    p.add_argument("--turns", type=_positive, default=4, help="shared-prefix: turns per user")
    p.add_argument("--system-len", type=int, default=2048, help="shared-prefix: system prompt token ids")
    p.add_argument("--temperature", type=float, default=0.6, help="default: %(default)s")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed requests shaped like the first ones (default: {WARMUP_DEFAULT}, or fewer when a run has fewer)",
    )
    p.add_argument("--rate", type=_rate, nargs="+", default=[math.inf], help="requests/s (Poisson), or inf")
    p.add_argument("--concurrency", type=_positive, nargs="+", default=None, help="at most N requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (repeat k uses SEED + k)")
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="run the sweep N times, each with fresh prompts and other arrivals; report median, min and max",
    )
    p.add_argument(
        "--ttft-target-ms",
        type=float,
        default=200.0,
        help="report the rate where the median TTFT p99 crosses this (default: %(default)s)",
    )
    p.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="every run of a sweep sends the same text (default: runs after the first use other ids, same lengths)",
    )
    p.add_argument(
        "--fallback-count",
        choices=("chunks", "max-tokens"),
        default="chunks",
        help="output tokens of a stream without usage: its text chunks (default), or its max_tokens",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--launch", default=None, metavar="CMD", help="shell command that starts the server; stopped after")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds the launched server may take to start")
    p.add_argument(
        "--stop-grace",
        type=float,
        default=60.0,
        help="seconds the launched server has to exit after SIGTERM before SIGKILL (default: %(default)s)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="with --launch: append --trace-steps to the server's command; the trace is kept gzipped beside the JSON"
        " (LABEL.trace.jsonl.gz)",
    )
    p.add_argument(
        "--keep-server-log",
        action="store_true",
        help="keep the launched server's output as LABEL.server.log next to the JSON (else kept only on errors)",
    )
    p.add_argument("--label", default=None, help="name of the result (file name, plot legend)")
    p.add_argument("--output", default=".", help="directory for the JSON result (default: the current one)")
    return p


def _event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _runner() -> asyncio.Runner:
    """An event loop runner: uvloop's when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def _model_card(target: Target) -> dict[str, Any]:
    """The first model card of ``GET /v1/models``: its ``id`` is the model to ask for."""
    try:
        card = (await get_json(target, "/v1/models"))["data"][0]
        if not isinstance(card, dict) or "id" not in card:
            raise TypeError(f"a model card without an id: {card!r:.100}")
    except (RuntimeError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(f"minisgl bench serve: cannot learn the model name ({exc}); pass --model") from None
    return card


def _local_tokenizer(card: dict[str, Any]) -> str | None:
    """A tokenizer the server's model card names: its ``id`` or ``root``, if a local path or ``dist:NAME``."""
    for key in ("id", "root"):
        name = card.get(key)
        if isinstance(name, str) and name and (name.startswith("dist:") or Path(name).exists()):
            return name
    return None


async def _bench(args: argparse.Namespace, record: dict[str, Any]) -> None:
    from tqdm import tqdm

    target = Target.from_url(args.base_url, args.api_key)
    card = {"id": args.model} if args.model else await _model_card(target)
    model = args.model or str(card["id"])
    server = Server(target, model, args.endpoint == "chat", args.temperature, args.extra_body, args.timeout)
    tokenizer = args.tokenizer or _local_tokenizer(card)
    if tokenizer is None:
        raise SystemExit(
            f"minisgl bench serve: the server's model '{model}' is not a local path or dist:NAME; pass --tokenizer"
        )
    decode = load_decode(tokenizer)

    def workload(id_seed: int | None) -> Workload:
        return build_workload(
            args.workload,
            decode,
            args.num_requests,
            tuple(args.input_len) if args.input_len else None,
            tuple(args.output_len) if args.output_len else None,
            args.turns,
            args.system_len,
            id_seed=id_seed,
        )

    work = workload(None)
    warmup = args.warmup if args.warmup is not None else min(WARMUP_DEFAULT, len(work.conversations))
    record["server"] = {"base_url": target.url, "model": model, "endpoint": server.path}
    record["workload"] = {
        "name": work.name,
        **work.params,
        "requests": work.num_requests,
        "drawn_input_tokens": work.drawn_input_tokens,
        "max_tokens_total": work.max_tokens_total,
        "temperature": args.temperature,
        "tokenizer": tokenizer,
        "warmup": warmup,
        "fresh_prompts_per_run": not args.reuse_prompts,
        "repeat": args.repeat,
    }
    if warmup > 0:
        warm = await run_workload(server, workload(WARMUP_ID_SEED).first_turns(warmup))
        failed = [r.error for r in warm.results if r.error]
        record["warmup"] = {"seconds": warm.duration, "errors": len(failed), "error_messages": failed[:ERRORS_KEPT]}
        if failed:
            print(f"warm-up: {len(failed)} of {len(warm.results)} failed, first: {failed[0]}", file=sys.stderr)
        else:
            print(f"warm-up: {len(warm.results)} requests in {warm.duration:.1f} s", file=sys.stderr, flush=True)
    record["runs"] = []
    print(HEADER)
    # The whole sweep once per repeat, so that a drift of the machine spreads over every rate alike.
    plan = [(k, r, c) for k in range(args.repeat) for r in args.rate for c in (args.concurrency or [None])]
    for i, (k, rate, conc) in enumerate(plan):
        run_work = work if i == 0 or args.reuse_prompts else workload(WARMUP_ID_SEED + i)
        seed = args.seed + k
        desc = f"rate {rate:g}" + (f", concurrency {conc}" if conc else "")
        desc += f", repeat {k}" if args.repeat > 1 else ""
        with tqdm(total=run_work.num_requests, desc=desc, unit="req", leave=False, disable=args.no_progress) as bar:
            run = await run_workload(server, run_work, rate, conc, seed, bar.update)
        rec = {
            "rate": "inf" if math.isinf(rate) else rate,
            "concurrency": conc,
            "repeat": k,
            "seed": seed,
            **summarize(run, args.fallback_count),
        }
        record["runs"].append(rec)
        print(run_row(rec), flush=True)
    _summarize(record, args)
    print(summary_table(record["summary"], record["ttft_p99_crossing"]))


def _summarize(record: dict[str, Any], args: argparse.Namespace) -> None:
    """The record's ``summary`` over its runs (median and spread per rate) and its TTFT p99 crossing rate."""
    record["summary"] = aggregate(record["runs"])
    record["ttft_p99_crossing"] = crossing_rate(record["summary"], args.ttft_target_ms)


def _trace_path(args: argparse.Namespace, label: str) -> Path | None:
    """Where ``--trace`` has the launched server write its step trace: LABEL.trace.jsonl beside the JSON."""
    if not args.trace:
        return None
    if args.launch is None:
        raise SystemExit(
            "minisgl bench serve: --trace asks the server that --launch starts for a step trace; pass --launch CMD"
            " (a server you start yourself writes one with: minisgl serve --trace-steps FILE)"
        )
    path = (Path(args.output) / f"{label}.trace.jsonl").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the server appends: a trace left by an earlier run must not mix in
    return path


def _kept_trace(path: Path) -> str | None:
    """Compress the server's trace to ``LABEL.trace.jsonl.gz`` beside the JSON (the readers take either) and
    return its file name for the record; None when the server wrote none."""
    if not (path.is_file() and path.stat().st_size > 0):
        print(
            f"--trace: the launched server wrote no step trace to {path} (does it take --trace-steps?)", file=sys.stderr
        )
        return None
    packed = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return packed.name


def _stop_signal(exc: SystemExit) -> str | None:
    """The stop signal's name when ``exc`` is how a stop signal ended the benchmark (``128 + signal``)."""
    if isinstance(exc.code, int) and exc.code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(exc.code - 128).name
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``minisgl bench serve`` with ``argv`` (default: the command line); write the JSON record.

    A stop signal (SIGTERM, SIGINT, SIGHUP) ends the benchmark early: the launched server is stopped, and when
    at least one run finished, the record of the finished runs is written with ``"interrupted"`` naming the
    signal (and the exit status is still ``128 + signal``)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    record: dict[str, Any] = {
        "benchmark": f"serve-{args.workload}",
        "label": args.label or f"serve-{args.workload}",
        "command": shlex.join(["minisgl", "bench", "serve", *argv]),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": None,  # filled in after the runs, so that querying the GPU cannot disturb a server starting up
    }
    trace = _trace_path(args, record["label"])
    command = args.launch if trace is None else f"{args.launch} --trace-steps {shlex.quote(str(trace))}"
    stopped: SystemExit | None = None
    launch: dict[str, Any] | None = None
    with _runner() as runner:
        try:
            if command is None:
                with stop_on_signal():
                    runner.run(_bench(args, record))
            else:
                url = Target.from_url(args.base_url).url
                with launched(command, url, args.launch_timeout, args.stop_grace) as launch:
                    record["launch"] = launch
                    runner.run(_bench(args, record))
        except SystemExit as exc:
            name = _stop_signal(exc)
            if name is None:
                raise
            stopped = exc
            record["interrupted"] = name
    if launch is not None:
        if trace is not None:
            launch["trace"] = _kept_trace(trace)
        log = Path(str(launch.pop("log")))
        if args.keep_server_log:
            kept = Path(args.output) / f"{record['label']}.server.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(log, kept)
            launch["server_log"] = kept.name
        elif (
            stopped is not None
            or any(r["errors"] for r in record.get("runs", ()))
            or record.get("warmup", {}).get("errors")
        ):
            print(f"server log: {log}", file=sys.stderr)
        else:
            log.unlink(missing_ok=True)
    if stopped is not None:
        if not record.get("runs"):
            raise stopped  # nothing measured: nothing to write
        _summarize(record, args)
        print(f"{record['interrupted']}: writing the {len(record['runs'])} finished run(s)", file=sys.stderr)
    record["machine"] = {**_machine("cuda"), "event_loop": _event_loop_name()}
    write_record(args.output, record["label"], record)
    if stopped is not None:
        raise stopped
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prometheus metrics of one server, in a registry of its own (never the global one)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters and histograms updated as outputs arrive; gauges refreshed from the scheduler on scrape."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.running = Gauge("minisgl_num_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("minisgl_num_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_used = Gauge("minisgl_kv_pages_used", "KV cache pages owned by live requests", registry=r)
        self.kv_cached = Gauge("minisgl_kv_pages_cached", "KV cache pages held by the prefix cache", registry=r)
        self.kv_total = Gauge("minisgl_kv_pages_total", "Usable KV cache pages", registry=r)
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            "minisgl_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.aborted = Counter("minisgl_requests_aborted", "Requests aborted because the client went away", registry=r)
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "Request to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Between two tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        info = Gauge("minisgl_model_info", "The served model", ["model"], registry=r)
        info.labels(model_name).set(1)

    def update(self, state: dict[str, Any]) -> None:
        """Set the gauges from the scheduler's heartbeat state (kept as they are when it has none)."""
        gauges = {
            "running": self.running,
            "waiting": self.waiting,
            "kv_pages_used": self.kv_used,
            "kv_pages_cached": self.kv_cached,
            "kv_pages_total": self.kv_total,
        }
        for key, gauge in gauges.items():
            if key in state:
                gauge.set(state[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)

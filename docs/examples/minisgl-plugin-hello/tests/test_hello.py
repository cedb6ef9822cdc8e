"""Tests of minisgl-plugin-hello: the shared conformance kit, plus what is particular to it."""

from __future__ import annotations

from minisgl_plugin_hello.backend import HelloAttnBackend

from minisgl.kvcache import MHAKVPool
from minisgl.plugins import load_plugins
from minisgl.testing.attention import ATTN_CASES, AttentionBackendConformance, AttentionHarness


class TestHelloConformance(AttentionBackendConformance):
    """Every test of the kit, run against the installed 'hello' backend (on CPU, float32)."""

    backend = "hello"


def test_registered_through_the_entry_point() -> None:
    registry = load_plugins()
    assert registry.get("attention", "hi").name == "hello"
    assert registry.provider("attention", "hello").distribution == "minisgl-plugin-hello"
    assert "hello" not in [s.name for s in registry.ranked("attention", "cpu")]  # not an auto candidate


def test_counts_attended_tokens() -> None:
    harness = AttentionHarness(HelloAttnBackend, MHAKVPool, ATTN_CASES[0], num_layers=2)
    reqs = [harness.add_request(5), harness.add_request(3)]
    harness.step([(r, r.prompt_len) for r in reqs])  # 8 new tokens, two layers
    harness.step([(r, 1) for r in reqs], "decode")  # 2 more, two layers
    assert harness.backend.tokens_attended == 2 * (8 + 2)

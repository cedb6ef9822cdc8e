from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minisgl.testing.models import save_tiny_model


def tiny_moe_config(**overrides: Any) -> Any:
    """8 experts, top-2, 3 layers of which layer 1 is dense (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


@pytest.fixture(scope="session")
def moe_config() -> Callable[..., Any]:
    """:func:`tiny_moe_config`, for tests that vary it (a fixture: test modules cannot import conftest reliably)."""
    return tiny_moe_config


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(directory, transformers model) of a tiny random Qwen3-MoE model."""
    path = tmp_path_factory.mktemp("qwen3moe")
    model = save_tiny_model("Qwen3MoeForCausalLM", path, config=tiny_moe_config())
    return path, model

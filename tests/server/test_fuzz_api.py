"""Schema-driven fuzzing of a real server on the demo model: no request, valid or not, may get a 5xx.

The requests come from the server's own OpenAPI schema (schemathesis): valid
bodies, and bodies with one part made invalid. The schema is narrowed first so
that a run stays short on a CPU: ``max_tokens`` is required and at most 4, ``n``
at most 2, lists and strings short, prompts and messages mostly ones the model
can take (integers as enums, messages without the fields that need another
message or are refused). The
server's context is small as well, so a request that still asks for a long
output ends soon. (Valid-schema integers may come as ``4.0``; the server
refuses those, as OpenAI does, with a 400.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverutil import Server

from minisgl.server.protocol import PENDING, UNSUPPORTED

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = 60  # per operation and generation mode: about two minutes on two CPU cores
VOCAB = 49152  # SmolLM2's
# Integers come as enums throughout: a generator may write an integer schema's value as 4.0, which the server
# refuses (strict types, as OpenAI's API), and a run of such bodies would never reach the engine.
TOKEN_IDS = {"type": "array", "items": {"enum": [0, 1, 42, 1000, 20000, VOCAB - 1]}, "minItems": 1}
BOUNDED = {
    "max_tokens": {"enum": [1, 2, 3, 4]},
    "max_completion_tokens": {"enum": [1, 2, 3, 4]},
    "n": {"enum": [1, 2]},
    "top_k": {"enum": [-1, 1, 5, 40]},
    "seed": {"anyOf": [{"type": "null"}, {"enum": [0, 1, 12345]}]},
    "stop_token_ids": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"enum": [0, 1, 2]}, "maxItems": 3}]},
    "stop": {
        "anyOf": [
            {"type": "null"},
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
        ]
    },
    # Mostly prompts the model can take: non-empty, token ids inside the vocabulary.
    "prompt": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            TOKEN_IDS,
            {"type": "array", "items": TOKEN_IDS, "minItems": 1},
        ]
    },
}


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        smollm2_path,
        tmp_path_factory.mktemp("fuzz-server"),
        "--api-key", API_KEY,
        "--max-model-len", "160",
        "--num-pages", "128",
        "--max-running-requests", "8",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _narrow(node: Any) -> None:
    """Short lists and strings everywhere in a JSON schema."""
    if isinstance(node, dict):
        if node.get("type") == "array":
            node["maxItems"] = min(node.get("maxItems", 3), 3)
        if node.get("type") == "string" and "enum" not in node and "const" not in node:
            node["maxLength"] = min(node.get("maxLength", 60), 60)
        for value in node.values():
            _narrow(value)
    elif isinstance(node, list):
        for value in node:
            _narrow(value)


# Fields that make the engine compile a grammar or a tool schema: random patterns and schemas would
# spend the fuzz budget compiling; test_api_protocol, test_api_app and test_serve_structured cover them.
CONSTRAINTS = ("response_format", "regex", "ebnf", "tools", "tool_choice", "parallel_tool_calls", "logit_bias")


def bounded_schema(raw: dict[str, Any]) -> dict[str, Any]:
    schema = json.loads(json.dumps(raw))
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = schema["components"]["schemas"][name]
        # Fields refused unless they ask for nothing (tools, response_format, ...) would make most
        # valid bodies a 400; test_api_protocol covers them.
        for field in (*PENDING, *UNSUPPORTED, *CONSTRAINTS):
            body["properties"].pop(field, None)
        for field, bounds in BOUNDED.items():
            if field in body["properties"]:
                body["properties"][field] = bounds
        body["required"] = sorted({*body.get("required", []), "max_tokens"})
        # top_logprobs is valid only beside logprobs: true (a 400 otherwise; test_api_protocol covers it).
        body["properties"].pop("top_logprobs", None)
    # Messages the chat template takes: a tool message needs the id of an assistant's call, and a refusal, a
    # legacy function_call, audio or a content part of an unknown type is refused (test_api_protocol covers
    # each); random ones would make nearly every valid body a 400.
    message = schema["components"]["schemas"]["ChatMessage"]
    message["properties"]["role"] = {"enum": ["system", "developer", "user", "assistant"]}
    message["properties"]["content"] = {"type": "string", "minLength": 1}
    for field in ("tool_call_id", "tool_calls", "function_call", "refusal", "audio"):
        message["properties"].pop(field, None)
    message["required"] = ["role", "content"]
    _narrow(schema)
    return schema


def fuzz(op: Any, mode: Any, url: str, failures: list[str]) -> list[int]:
    """Send ``EXAMPLES`` generated requests to one operation; the status codes (5xx also go to ``failures``)."""
    codes: list[int] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        resp = case.call(base_url=url, headers=AUTH, timeout=120)
        codes.append(resp.status_code)
        if resp.status_code >= 500:
            command = case.as_curl_command(headers=AUTH, base_url=url)
            failures.append(f"{command}\n  -> {resp.status_code} {resp.content[:1000]!r}")

    call()
    return codes


def test_no_request_gets_a_server_error(server: Server) -> None:
    raw = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    schema = schemathesis.openapi.from_dict(bounded_schema(raw))
    operations = {(op.method.upper(), op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")} <= set(operations)
    failures: list[str] = []
    codes: dict[tuple[str, str], list[int]] = {}
    for (method, path), op in operations.items():
        codes[(path, "valid")] = fuzz(op, GenerationMode.POSITIVE, server.url, failures)
        if method == "POST":  # invalid variants need a body to break (the GET routes take no parameters)
            codes[(path, "invalid")] = fuzz(op, GenerationMode.NEGATIVE, server.url, failures)
    assert not failures, "\n".join(failures[:10])
    # Most valid bodies generate text (some are refused: a prompt over the small context, token ids
    # outside the vocabulary), so the runs reached the engine, not only the validation.
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert codes[(path, "valid")].count(200) >= EXAMPLES // 5, codes[(path, "valid")]
        assert any(400 <= code < 500 for code in codes[(path, "invalid")])
    # Whatever was sent, every KV page is back and the server still serves.
    assert server.metrics()["minisgl_kv_pages_used"] == 0
    out = httpx.post(
        server.url + "/v1/completions", headers=AUTH, json={"prompt": "Hello", "max_tokens": 2}, timeout=60
    )
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2

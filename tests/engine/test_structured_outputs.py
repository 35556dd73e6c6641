"""Structured outputs in the engine, with the real xgrammar engine: the bundled SmolLM2 for
outputs a reader would recognise, the tiny random model where only the constraint can keep the
output in shape. Outputs are checked with jsonschema and re.fullmatch."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pdserve import LLM, SamplingParams, StructuredOutputsParams
from pdserve.engine.structured_output import StructuredOutputManager

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}
CODE = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def texts(llm, prompts, params):
    return [[c.text for c in out.outputs] for out in llm.generate(prompts, params,
                                                                   use_tqdm=False)]


def test_every_kind_holds_greedy_and_sampled(smollm2_llm):
    compact = dict(disable_any_whitespace=True)
    cases = [
        (so(json=PERSON, **compact), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (so(json=json.dumps(PERSON), **compact), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (so(json_object=True, **compact), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
        (so(regex=CODE), lambda t: re.fullmatch(CODE, t) or 1 / 0),
        (so(choice=["red", "green", "light blue"]),
         lambda t: t in ("red", "green", "light blue") or 1 / 0),
        (so(grammar='root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'),
         lambda t: re.fullmatch(r"\(\d+( \+ \d+)*\)", t) or 1 / 0),
    ]
    prompts = ["Describe a person with pets as JSON.", "Give me a ticket code.",
               "Which color is the sky?", "Write a sum."]
    for constraint, check in cases:
        sampled = SamplingParams(temperature=1.0, top_p=0.95, seed=5, n=2, max_tokens=80,
                                 structured_outputs=constraint)
        greedy = SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint)
        # Sampled, SmolLM2 writes open-ended JSON objects past any small max_tokens.
        for params in (greedy,) if constraint.json_object else (greedy, sampled):
            for out in smollm2_llm.generate(prompts, params, use_tqdm=False):
                for c in out.outputs:
                    assert c.finish_reason == "stop", (constraint, c.text)
                    check(c.text)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(smollm2_llm):
    free = [SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0.9, seed=11, max_tokens=24)]
    prompts = ["Tell me about the sea.", "Name three fruits."]
    alone = texts(smollm2_llm, prompts, free)
    constrained = SamplingParams(temperature=0, max_tokens=60,
                                 structured_outputs=so(json=PERSON, disable_any_whitespace=True))
    mixed = texts(smollm2_llm, ["Person JSON:", prompts[0], "Another:", prompts[1]],
                  [constrained, free[0], constrained, free[1]])
    assert [mixed[1], mixed[3]] == alone
    for t in (mixed[0][0], mixed[2][0]):
        jsonschema.validate(json.loads(t), PERSON)


def test_with_stop_strings_max_tokens_and_logprobs(smollm2_llm):
    choice = so(choice=["alpha beta gamma", "delta"])
    [stopped] = smollm2_llm.generate("Say it:", SamplingParams(
        temperature=0, max_tokens=20, stop=[" beta"], structured_outputs=choice,
        logprobs=2), use_tqdm=False)
    c = stopped.outputs[0]
    if c.text != "delta":  # the grammar allows only these two; the stop string cuts the first
        assert (c.text, c.finish_reason, c.stop_reason) == ("alpha", "stop", " beta")
    assert len(c.logprobs) == len(c.token_ids) and all(
        t in entry for t, entry in zip(c.token_ids, c.logprobs))
    [capped] = smollm2_llm.generate("Code:", SamplingParams(
        temperature=0, max_tokens=3, structured_outputs=so(regex=r"[a-z]{30}")), use_tqdm=False)
    c = capped.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert re.fullmatch(r"[a-z]+", c.text)


def test_continuation_advances_the_matcher_over_tokens_it_already_has(smollm2_llm):
    """A decode instance (or a migration target) gets the tokens sampled elsewhere: its matcher
    accepts them first, so the rest equals an undisturbed run; tokens the grammar rejects fail
    that request only."""
    engine = smollm2_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=so(json=PERSON, disable_any_whitespace=True))
    prompt = {"prompt_token_ids": smollm2_llm.get_tokenizer().encode("A person as JSON:")}
    [full] = smollm2_llm.generate(prompt, params, use_tqdm=False)
    tokens = full.outputs[0].token_ids
    for k in (1, 5):
        engine.add_request(f"cont-{k}", prompt, params,
                           kv_transfer_params={"output_token_ids": tokens[:k]})
        out = _run(engine, f"cont-{k}")
        assert out.outputs[0].token_ids == tokens, k
    bad = smollm2_llm.get_tokenizer().encode("hello", add_special_tokens=False)
    engine.add_request("cont-bad", prompt, params, kv_transfer_params={"output_token_ids": bad})
    out = _run(engine, "cont-bad")
    assert out.outputs[0].finish_reason == "error"
    [after] = smollm2_llm.generate(prompt, params, use_tqdm=False)  # the engine still serves
    assert after.outputs[0].token_ids == tokens


def _run(engine, request_id):
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None
    return final


def test_preemption_keeps_the_matcher_consistent(tiny_model_dir):
    """The random tiny model follows the grammar only because it must; with 12 KV blocks
    for 6 requests, sequences are preempted and recomputed mid-output."""
    pattern = r"([a-z] ){40}[a-z]"  # 41 letters: at least 41 tokens
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=so(regex=pattern))
    prompts = [f"Request {i}: " + "cats and dogs " * i for i in range(6)]
    roomy = texts(LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20), prompts, params)
    small = LLM(str(tiny_model_dir), kv_cache_memory_bytes=12 * 16 * 2 * 2 * 2 * 16 * 4,
                enable_prefix_caching=False)
    tight = texts(small, prompts, params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert tight == roomy
    for [t] in tight:
        assert re.fullmatch(pattern, t), t


def test_compiles_off_the_step(tiny_llm):
    """While a grammar compiles, the request waits unscheduled and free requests run."""
    engine = tiny_llm.llm_engine
    manager: StructuredOutputManager = engine.input_processor.grammars
    gate = threading.Event()
    real = manager._compile

    def held(spec):
        gate.wait(30)
        return real(spec)

    manager._compile = held
    try:
        schema = so(regex=r"held-[0-9]{3}")
        engine.add_request("held", "x", SamplingParams(temperature=0, max_tokens=10,
                                                       structured_outputs=schema))
        engine.add_request("free", "y", SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True))
        done = {}
        for _ in range(8):
            for out in engine.step():
                done[out.request_id] = out
        assert done["free"].finished and "held" not in done
        assert engine.scheduler.requests["held"].num_computed_tokens == 0
        gate.set()
        final = _run(engine, "held")
        assert re.fullmatch(r"held-[0-9]{3}", final.outputs[0].text)
    finally:
        gate.set()
        manager._compile = real


def test_an_aborted_requests_queued_compile_is_dropped(tiny_llm):
    """Abandoned requests cannot queue up compiles ahead of live ones: a compile not started
    whose every request ended is cancelled; one another request still waits for is kept."""
    engine = tiny_llm.llm_engine
    manager: StructuredOutputManager = engine.input_processor.grammars
    gate, compiled = threading.Event(), []
    real = manager._compile

    def held(spec):
        gate.wait(30)
        compiled.append(spec)
        return real(spec)

    manager._compile = held
    try:
        params = {name: SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(
            regex=rf"{name}-[0-9]{{3}}")) for name in ("first", "gone", "shared")}
        engine.add_request("first", "x", params["first"])  # holds the one compile thread
        engine.add_request("gone", "x", params["gone"])
        engine.add_request("shared-1", "x", params["shared"])
        engine.add_request("shared-2", "x", params["shared"])
        engine.abort_request(["gone", "shared-1"])
        engine.step()  # the aborts take effect
        gate.set()
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert set(done) == {"first", "shared-2"}
        assert re.fullmatch(r"shared-[0-9]{3}", done["shared-2"].outputs[0].text)
        assert [spec.source for spec in compiled] == [r"first-[0-9]{3}", r"shared-[0-9]{3}"]
        engine.add_request("again", "x", params["gone"])  # asked again: compiled then
        assert re.fullmatch(r"gone-[0-9]{3}", _run(engine, "again").outputs[0].text)
    finally:
        gate.set()
        manager._compile = real


def test_invalid_constraints_are_value_errors(smollm2_llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        SamplingParams(structured_outputs=so(regex="(a"))
    with pytest.raises(ValueError, match="structured_outputs.json"):
        SamplingParams(structured_outputs={"json": {"type": "objekt"}})
    with pytest.raises(ValueError, match="only one kind"):
        SamplingParams(structured_outputs=so(regex="a", choice=["a"]))


def test_offline_chat_passes_tools_and_tool_messages_to_the_template(smollm2_llm):
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>"
                "{% for c in m.tool_calls or [] %}call {{ c.function.name }} "
                "city={{ c.function.arguments.city }}{% endfor %}{{ m.content or '' }}"
                "{% endfor %}<assistant>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    [out] = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=2),
                             chat_template=template, tools=tools, use_tqdm=False)
    prompt = smollm2_llm.get_tokenizer().decode(out.prompt_token_ids)
    assert prompt == ("[tool get_weather]<user>Weather?<assistant>call get_weather city=Oslo"
                      "<tool>-3 C<assistant>")

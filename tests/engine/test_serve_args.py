"""`pdserve serve` takes vLLM's flags and a positional model, parsed by the real parser; the
app it builds (a local engine on the tiny model) reports --served-model-name and honours
--chat-template, --max-logprobs and --middleware."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.cli import build_parser
from pdserve.gateway.server import build_serve_app, serve_engine_args
from pdserve.models.loader import DEFAULT_MODEL

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
MIDDLEWARE = """
async def mark(request, call_next):
    response = await call_next(request)
    response.headers["x-operator"] = "marked"
    return response
"""
VLLM_FLAGS = ["--enforce-eager", "--trust-remote-code", "--max-logprobs", "7",
              "--served-model-name", "foo", "--tensor-parallel-size", "1"]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_vllm_flags_and_positional_model_parse():
    args = parse("/models/m", *VLLM_FLAGS, "--chat-template", "t.jinja")
    e = serve_engine_args(args)
    assert e.model == "/models/m"
    assert e.enforce_eager is True and e.trust_remote_code is True
    assert e.chat_template == "t.jinja" and e.max_logprobs == 7
    assert e.served_model_name == ["foo"] and e.tensor_parallel_size == 1
    defaults = serve_engine_args(parse())
    assert defaults.model == DEFAULT_MODEL and defaults.enforce_eager is False
    assert defaults.served_model_name is None and defaults.max_logprobs == 20
    assert serve_engine_args(parse("--model", "/models/m")).model == "/models/m"
    assert serve_engine_args(parse("--served-model-name", "a", "b")).served_model_name == [
        "a", "b"]
    assert serve_engine_args(parse("--no-enforce-eager")).enforce_eager is False
    assert serve_engine_args(parse("--hf-overrides", '{"x": 1}')).hf_overrides == {"x": 1}
    with pytest.raises(SystemExit):
        parse("--hf-overrides", "{not json")
    with pytest.raises(ValueError, match="^model: given twice"):
        serve_engine_args(parse("/models/a", "--model", "/models/b"))


def test_unsupported_flag_values_are_errors(tiny_model_dir):
    args = parse(str(tiny_model_dir), "--tensor-parallel-size", "2")
    with pytest.raises(ValueError, match="^tensor_parallel_size"):
        build_serve_app(args)
    args = parse(str(tiny_model_dir), "--middleware", "no_such_module_for_pdserve.Middleware")
    with pytest.raises(ValueError, match="^--middleware"):
        build_serve_app(args)


def test_served_model_name_chat_template_max_logprobs_and_middleware(tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    (tmp_path / "operator_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = parse(str(tiny_model_dir), *VLLM_FLAGS, "--chat-template", str(template),
                 "--kv-cache-memory-bytes", str(4 << 20),
                 "--middleware", "operator_middleware.mark")
    with TestClient(build_serve_app(args)) as client:
        models = client.get("/v1/models")
        assert [m["id"] for m in models.json()["data"]] == ["foo"]
        assert models.headers["x-operator"] == "marked"
        chat = {"model": "foo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "foo"
        tokenizer = client.app.state.ctx.tokenizer
        rendered = tokenizer.encode("[user]hi[assistant]", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(rendered)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                 "logprobs": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                 "logprobs": 7})
        assert r.status_code == 200, r.text

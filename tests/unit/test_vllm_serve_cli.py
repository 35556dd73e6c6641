"""`pdserve serve` takes what `vllm serve` users pass: vLLM's spellings, sizes and config
files, its API-key environment variable, its HTTP-server flags (or a clear refusal)."""

from __future__ import annotations

import argparse

import pytest
from starlette.testclient import TestClient
from test_gateway_app import CharTokenizer, FakeBackend, error, events

from pdserve.cli import build_parser
from pdserve.engine import vllm_args
from pdserve.gateway.app import build_app
from pdserve.gateway.server import gateway_api_keys, serve_engine_args
from pdserve.gateway.vllm_serve_args import (add_cors, check_vllm_serve_args,
                                             install_middleware, load_middleware,
                                             uvicorn_options)
from pdserve.vllm_argv import normalize_argv


def parse(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(normalize_argv(["serve", *argv], parser))


def test_vllm_spellings_and_sizes(tiny_model_dir):
    args = parse(str(tiny_model_dir), "--max_model_len", "1k", "--max-num-batched-tokens=2K",
                 "-tp", "1", "-pp", "1", "--log-level", "DEBUG", "--kv-cache-memory-bytes",
                 "64M", "--uvicorn-log-level", "WARNING")
    assert (args.max_model_len, args.max_num_batched_tokens) == (1000, 2048)
    assert args.kv_cache_memory_bytes == 64 << 20 and args.log_level == "debug"
    assert uvicorn_options(args)["log_level"] == "warning"
    engine = serve_engine_args(args)
    assert engine.create_engine_config().model.max_model_len == 1000
    assert parse(str(tiny_model_dir), "--max-model-len", "auto").max_model_len is None
    with pytest.raises(SystemExit):
        parse(str(tiny_model_dir), "--max-model-len", "1.5K")


def test_a_config_file_gives_flags_that_the_command_line_overrides(tiny_model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny_model_dir}\nport: 9123\nmax_model_len: 512\n"
                      "enable_prefix_caching: false\nserved_model_name: [a, b]\n"
                      "override_generation_config: {temperature: 0.5}\n")
    args = parse("--config", str(config), "--port", "9200")
    assert (args.model, args.port, args.max_model_len) == (str(tiny_model_dir), 9200, 512)
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.override_generation_config == {"temperature": 0.5}
    config.write_text("model: other\napi_key: -starts-with-a-dash-0123\n"
                      "allowed_origins: ['*']\nenable_log_requests: false\n"
                      "allow_credentials: true\n")
    args = parse(str(tiny_model_dir), "--config", str(config))  # the positional model wins
    assert (args.model_tag, args.model) == (str(tiny_model_dir), "SmolLM2-135M-Instruct")
    assert args.api_key == ["-starts-with-a-dash-0123"] and args.allowed_origins == ["*"]
    assert not args.enable_log_requests and args.allow_credentials
    prompt = "--max_model_len is what?"  # a value, not a flag: left as it is
    assert build_parser().parse_args(normalize_argv(
        ["generate", "--prompt", prompt], build_parser())).prompt == prompt
    for bad in ("- a list\n", "key: [unclosed\n"):
        config.write_text(bad)
        with pytest.raises(ValueError, match="--config"):
            normalize_argv(["serve", "--config", str(config)], build_parser())


def test_vllms_api_key_variable_protects_the_api(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm-0123456789")
    assert gateway_api_keys(parse()) == ("sk-vllm-0123456789",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert set(gateway_api_keys(parse("--api-key", "sk-a-0123456789", "sk-b-0123456789"))) \
        == {"sk-a-0123456789", "sk-b-0123456789"}


@pytest.mark.parametrize("argv, field", [
    (["--response-role", ""], "--response-role"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile"),
])
def test_server_flags_pdserve_does_not_honour_are_refused_naming_them(argv, field):
    with pytest.raises(ValueError, match=field):
        check_vllm_serve_args(parse(*argv))


def test_no_op_flags_are_accepted_and_said_so(caplog):
    args = parse("--enable-log-requests", "--enable-prompt-tokens-details")
    caplog.set_level("INFO", logger="pdserve")
    check_vllm_serve_args(args)
    assert sum("changes nothing here" in r.getMessage() for r in caplog.records) == 2
    options = uvicorn_options(parse("--root-path", "/llm", "--ssl-keyfile", "k.pem",
                                    "--ssl-certfile", "c.pem"))
    assert (options["root_path"], options["ssl_keyfile"], options["ssl_certfile"]) == \
        ("/llm", "k.pem", "c.pem")


@pytest.mark.parametrize("flag, value", [("--kv-cache-dtype", "fp8"),
                                         ("--load-format", "pt"), ("--load-format", "gguf")])
def test_engine_values_pdserve_cannot_honour_are_refused_naming_them(tiny_model_dir, flag,
                                                                     value):
    args = serve_engine_args(parse(str(tiny_model_dir), flag, value))
    with pytest.raises(ValueError, match=flag[2:].replace("-", "_")):
        args.create_engine_config()
    assert "download_dir" in vllm_args.ignored_names()


def test_cors_only_for_the_origins_named_and_every_served_name_listed():
    origin = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    for argv, allowed in (([], None), (["--allowed-origins", '["https://ui.example"]'],
                                       "https://ui.example")):
        app = build_app(FakeBackend(), ["first", "second"], "k", tokenizer=CharTokenizer(),
                        close_backend=False)
        add_cors(app, parse(*argv))
        with TestClient(app) as c:
            preflight = c.options("/v1/completions", headers=origin)
            assert preflight.headers.get("access-control-allow-origin") == allowed
            listed = c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
            assert [m["id"] for m in listed["data"]] == ["first", "second"]
            error(c.get("/v1/models"), 401)  # CORS does not open the API


def test_middleware_named_on_the_command_line_wraps_the_api_outside_the_key_check():
    """vLLM's --middleware: a class goes in with add_middleware, an async function as an HTTP
    middleware; the last named is outermost, and both see the key check's 401."""
    args = parse("--middleware", "http_middleware.MarkResponses",
                 "--middleware", "http_middleware.mark_response")
    app = build_app(FakeBackend(), ["m"], "k", tokenizer=CharTokenizer(), close_backend=False)
    install_middleware(app, load_middleware(args.middleware))
    with TestClient(app) as c:
        for headers, status in (({"Authorization": "Bearer k"}, 200), ({}, 401)):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == status
            assert r.headers["x-marked-by"] == "class"
            assert r.headers["x-marked-by-function"] == "class"  # the class ran inside it
        r = c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                   json={"model": "m", "prompt": "ab", "max_tokens": 2, "stream": True})
        assert r.headers["x-marked-by"] == "class" and events(r)  # streams pass through


@pytest.mark.parametrize("path, why", [
    ("Middleware", "expected an import path"),
    ("no_such_module_for_pdserve.Middleware", "cannot import it: ModuleNotFoundError"),
    ("http_middleware.Missing", "cannot import it: AttributeError"),
    ("http_middleware.NOT_MIDDLEWARE", "expected an ASGI middleware class"),
])
def test_middleware_that_cannot_be_used_is_refused_naming_the_flag(path, why):
    with pytest.raises(ValueError, match=f"^--middleware.*{why}"):
        load_middleware(parse("--middleware", path).middleware)


def test_behind_a_root_path_the_api_key_still_guards_the_api():
    """uvicorn puts --root-path in front of the request's path (as ASGI says): the key check
    looks past it."""
    import asyncio

    from pdserve.gateway.guards import GuardMiddleware
    from pdserve.gateway.metrics import GatewayMetrics

    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    guard = GuardMiddleware(inner, ("k",), 1 << 20, GatewayMetrics("m"))
    for headers in ([], [(b"authorization", b"Bearer k")]):
        scope = {"type": "http", "method": "GET", "path": "/llm/v1/models",
                 "root_path": "/llm", "headers": headers}
        asyncio.run(guard(scope, None, send))
    assert sent[0]["status"] == 401 and reached == ["/llm/v1/models"]


def test_the_flag_wins_over_vllms_variable_and_client_certificates_need_a_ca(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-old-key-0123456789")
    assert gateway_api_keys(parse("--api-key", "sk-new-key-0123456789")) == \
        ("sk-new-key-0123456789",)
    with pytest.raises(ValueError, match="--ssl-cert-reqs"):
        check_vllm_serve_args(parse("--ssl-cert-reqs", "2"))
    options = uvicorn_options(parse("--ssl-keyfile", "k", "--ssl-certfile", "c",
                                    "--ssl-ca-certs", "ca", "--ssl-cert-reqs", "2"))
    assert (options["ssl_ca_certs"], options["ssl_cert_reqs"]) == ("ca", 2)
    assert parse("--max-model-len", "16.1k").max_model_len == 16100


def test_logprobs_name_tokens_by_id_when_asked():
    """vLLM's return_tokens_as_token_ids (server flag or request field): each logprob token is
    "token_id:<id>", so tokens whose text is no whole character stay identifiable."""
    for server_default, field, want in ((False, None, "a"), (True, None, "token_id:97"),
                                        (True, False, "a"), (False, True, "token_id:97")):
        app = build_app(FakeBackend(), "m", tokenizer=CharTokenizer(), close_backend=False,
                        return_tokens_as_token_ids=server_default)
        extra = {} if field is None else {"return_tokens_as_token_ids": field}
        with TestClient(app) as c:
            lp = c.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "logprobs": 1,
                                                 **extra}).json()["choices"][0]["logprobs"]
            assert lp["tokens"][0] == want and want in lp["top_logprobs"][0]
            chat = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "logprobs": True, "top_logprobs": 1, **extra}).json()
            [entry] = chat["choices"][0]["logprobs"]["content"]
            assert entry["token"] == want and entry["top_logprobs"][0]["token"] == want
            assert entry["bytes"] == list(want.encode())


def test_the_response_role_names_chat_messages_as_vllm():
    app = build_app(FakeBackend(), "m", tokenizer=CharTokenizer(), close_backend=False,
                    response_role="bot")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=body).json()[
            "choices"][0]["message"]["role"] == "bot"
        first = events(c.post("/v1/chat/completions", json={**body, "stream": True}))[0]
        assert first["choices"][0]["delta"]["role"] == "bot"
        continued = {"messages": [*body["messages"], {"role": "assistant", "content": "he"}],
                     "add_generation_prompt": False, "continue_final_message": True,
                     "max_tokens": 1}  # continues the last message: its role
        assert c.post("/v1/chat/completions", json=continued).json()[
            "choices"][0]["message"]["role"] == "assistant"


def test_any_of_several_api_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    """`serve` takes keys as vLLM users expect, and off the command line too."""
    from pdserve.cli import build_parser
    from pdserve.gateway.server import gateway_api_keys

    key_file = tmp_path / "keys"
    key_file.write_text("# clients\nsk-file-key-0123\n")
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env-key-0123,sk-env-key-4567")
    args = build_parser().parse_args(["serve", "--api-key", "sk-flag-key-0123",
                                      "--api-key-file", str(key_file)])
    keys = gateway_api_keys(args)
    assert set(keys) == {"sk-file-key-0123", "sk-env-key-0123", "sk-env-key-4567",
                         "sk-flag-key-0123"}
    app = build_app(FakeBackend(), "fake-model", keys, tokenizer=CharTokenizer(),
                    close_backend=False)
    with TestClient(app) as c:
        for key in keys:
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code \
                == 200
        error(c.get("/v1/models", headers={"Authorization": "Bearer sk-flag-key-012"}), 401)
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert gateway_api_keys(build_parser().parse_args(["serve"])) == ()
    monkeypatch.setenv("PDSERVE_API_KEY", "bad key")
    with pytest.raises(ValueError, match="api key"):
        gateway_api_keys(build_parser().parse_args(["serve"]))

"""A local engine that stopped answers 503 (not a 500), and a request's sibling backend calls
are cancelled when one of them fails."""

import asyncio

import pytest
from starlette.testclient import TestClient

from pdserve import EngineArgs
from pdserve.gateway.app import build_app
from pdserve.gateway.local_backend import LocalBackend
from pdserve.gateway.serving import gather_or_cancel


def test_a_stopped_engine_loop_is_a_503_on_every_route(tiny_model_dir):
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=4 << 20, served_model_name="tiny"))
    with TestClient(build_app(backend, "tiny")) as client:
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        backend.loop.stop()
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/embeddings", {"input": "Hi"})):
            r = client.post(path, json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable_error"


def test_gather_or_cancel_cancels_the_siblings_of_a_failure():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise ValueError("prompt: bad")

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await asyncio.wait_for(gather_or_cancel(slow(), failing(), slow()), 10)

    asyncio.run(main())
    assert cancelled == [True, True]


@pytest.mark.parametrize("constraint", [
    {"guided_grammar": 'root ::= root "a"'},  # left-recursive: accepts no text at all
    {"guided_choice": ["a"], "min_tokens": 10},  # after "a" only the end, which min_tokens bans
])
def test_a_constraint_no_output_can_satisfy_is_a_400(tiny_model_dir, constraint):
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=4 << 20, served_model_name="tiny"))
    with TestClient(build_app(backend, "tiny")) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20,
                                                 "temperature": 0, **constraint})
        assert r.status_code == 400, r.text
        assert "structured_outputs" in r.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200  # only that request failed

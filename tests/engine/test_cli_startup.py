"""Servers that cannot start say so at once, in one line: a busy port before any model is
loaded (exit 1), a bad flag value or model (exit 2); real `python -m pdserve.cli` processes,
all started when the module begins, as many at a time as there are cores."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from pdserve.cpu_budget import available_cores

BOUND_S = 60  # generous: a failure must not wait for a model to load, let alone serve
SERVERS = [("serve", "--port"), ("prefill", "--port"), ("decode", "--port"),
           ("router", "--grpc-port")]
LOAD_ERROR_COMMANDS = ["serve", "prefill", "router"]
BAD_SERVE_FLAGS = [
    (["--tensor-parallel-size", "2"], "error: tensor_parallel_size"),
    (["--port", "70000"], "error: --port: must be in 0-65535, got 70000"),
    (["--host", "no-such-host.invalid", "--port", "8123"], "error: --host: cannot resolve"),
    (["--kv-cache-memory-bytes", str(1 << 50)],
     "error: KV cache: 1048576.00 GiB (--kv-cache-memory-bytes) does not fit in the "),
]
BAD_CACHE_FLAGS = [
    (["--block-size", "3"], "error: block_size must be a power of two"),
    (["--kv-cache-memory-fraction", "2"], ("error: kv_cache_memory_fraction "
                                           "(--kv-cache-memory-fraction) must be in (0, 1]")),
]


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                            text=True, timeout=240, check=False)
    return result, time.monotonic() - start


def assert_one_error_line(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Every case's `run_cli` (case -> its future), started at once; a socket listens on the
    busy port until the module ends."""
    no_tokenizer = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, no_tokenizer / name)
    unknown_type = tmp_path_factory.mktemp("unknown_type")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (unknown_type / "config.json").write_text(json.dumps({**config, "model_type": "no-such-type"}))
    model = str(tiny_model_dir)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = str(sock.getsockname()[1])
        cases: dict[tuple, list[str]] = {}
        for command, flag in SERVERS:
            engine = [] if command == "router" else ["--kv-cache-memory-bytes", str(4 << 20)]
            cases["busy", command] = [command, "--model", model, flag, busy, *engine]
            cases["busy-no-model", command] = [command, "--model", "/no/such/model", flag, busy]
            cases["missing", command] = [command, "--model", "/no/such/model", flag, "0"]
        for command in LOAD_ERROR_COMMANDS:
            flag = "--grpc-port" if command == "router" else "--port"
            cases["load-error", command] = [command, "--model", str(no_tokenizer), flag, "0"]
        for i, (args, _) in enumerate(BAD_SERVE_FLAGS):
            cases["serve-flags", i] = ["serve", "--model", model, "--port", "0",
                                       "--kv-cache-memory-bytes", str(4 << 20), *args]
        for i, (args, _) in enumerate(BAD_CACHE_FLAGS):
            cases["cache-flags", i] = ["serve", "--model", str(unknown_type), "--port", "0",
                                       *args]
        with ThreadPoolExecutor(max_workers=len(available_cores())) as pool:
            futures: dict[tuple, Future] = {case: pool.submit(run_cli, *argv)
                                            for case, argv in cases.items()}
            yield {case: (future, busy) for case, future in futures.items()}


def outcome(runs, *case) -> tuple[subprocess.CompletedProcess, float, str]:
    """(its result, seconds it took, the busy port)."""
    future, busy = runs[case]
    return (*future.result(), busy)


@pytest.mark.parametrize("command,flag", SERVERS)
def test_busy_port_fails_fast_in_one_line(command, flag, runs):
    result, took, busy = outcome(runs, "busy", command)
    line = assert_one_error_line(result, 1)
    assert line == f"error: port {busy} on 127.0.0.1 is in use ({flag})"
    assert took < BOUND_S


@pytest.mark.parametrize("command", [command for command, _ in SERVERS])
def test_busy_port_is_checked_before_the_model(command, runs):
    result, _, _ = outcome(runs, "busy-no-model", command)
    assert "is in use" in assert_one_error_line(result, 1)


@pytest.mark.parametrize("command", [command for command, _ in SERVERS])
def test_missing_model_is_one_error_line(command, runs):
    result, took, _ = outcome(runs, "missing", command)
    assert assert_one_error_line(result, 2).startswith("error: model: path '/no/such/model'")
    assert took < BOUND_S


@pytest.mark.parametrize("command", LOAD_ERROR_COMMANDS)
def test_model_load_error_is_one_line_however_long(command, runs):
    """A model directory without tokenizer files: transformers' message has many lines."""
    result, _, _ = outcome(runs, "load-error", command)
    assert assert_one_error_line(result, 2).startswith("error: tokenizer:")


@pytest.mark.parametrize("case,message", list(enumerate(m for _, m in BAD_SERVE_FLAGS)))
def test_bad_serve_flags_are_one_error_line(case, message, runs):
    result, _, _ = outcome(runs, "serve-flags", case)
    assert assert_one_error_line(result, 2).startswith(message)


@pytest.mark.parametrize("case,message", list(enumerate(m for _, m in BAD_CACHE_FLAGS)))
def test_cache_flags_are_checked_before_the_models_config_is_read(case, message, runs):
    """The config names a model type transformers does not know: reading it would fail."""
    result, _, _ = outcome(runs, "cache-flags", case)
    assert assert_one_error_line(result, 2).startswith(message)

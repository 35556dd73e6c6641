"""Servers that cannot start say so at once, in one line: a busy port before any model is
loaded (exit 1), a bad flag value or model (exit 2); real `python -m pdserve.cli` processes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

BOUND_S = 60  # generous: a failure must not wait for a model to load, let alone serve
SERVERS = [("serve", "--port"), ("prefill", "--port"), ("decode", "--port"),
           ("router", "--grpc-port")]


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                            text=True, timeout=240)
    return result, time.monotonic() - start


def assert_one_error_line(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def busy_port():
    """A port another socket is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command,flag", SERVERS)
def test_busy_port_fails_fast_in_one_line(command, flag, busy_port, tiny_model_dir):
    engine = [] if command == "router" else ["--kv-cache-memory-bytes", str(4 << 20)]
    result, took = run_cli(command, "--model", str(tiny_model_dir), flag, str(busy_port),
                           *engine)
    line = assert_one_error_line(result, 1)
    assert line == f"error: port {busy_port} on 127.0.0.1 is in use ({flag})"
    assert took < BOUND_S


@pytest.mark.parametrize("command,flag", SERVERS)
def test_busy_port_is_checked_before_the_model(command, flag, busy_port):
    result, _ = run_cli(command, "--model", "/no/such/model", flag, str(busy_port))
    assert "is in use" in assert_one_error_line(result, 1)


@pytest.mark.parametrize("command,flag", SERVERS)
def test_missing_model_is_one_error_line(command, flag):
    result, took = run_cli(command, "--model", "/no/such/model", flag, "0")
    assert assert_one_error_line(result, 2).startswith("error: model: path '/no/such/model'")
    assert took < BOUND_S


@pytest.mark.parametrize("command", ["serve", "prefill", "router"])
def test_model_load_error_is_one_line_however_long(command, tiny_model_dir, tmp_path):
    """A model directory without tokenizer files: transformers' message has many lines."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    flag = "--grpc-port" if command == "router" else "--port"
    result, _ = run_cli(command, "--model", str(tmp_path), flag, "0")
    assert assert_one_error_line(result, 2).startswith("error: tokenizer:")


@pytest.mark.parametrize("args,message", [
    (["--tensor-parallel-size", "2"], "error: tensor_parallel_size"),
    (["--port", "70000"], "error: --port: must be in 0-65535, got 70000"),
    (["--host", "no-such-host.invalid", "--port", "8123"], "error: --host: cannot resolve"),
    (["--kv-cache-memory-bytes", str(1 << 50)],
     "error: KV cache: 1048576.00 GiB (--kv-cache-memory-bytes) does not fit in the "),
])
def test_bad_serve_flags_are_one_error_line(args, message, tiny_model_dir):
    result, _ = run_cli("serve", "--model", str(tiny_model_dir), "--port", "0",
                        "--kv-cache-memory-bytes", str(4 << 20), *args)
    assert assert_one_error_line(result, 2).startswith(message)


@pytest.mark.parametrize("args,message", [
    (["--block-size", "3"], "error: block_size must be a power of two"),
    (["--kv-cache-memory-fraction", "2"], "error: kv_cache_memory_fraction "
                                          "(--kv-cache-memory-fraction) must be in (0, 1]"),
])
def test_cache_flags_are_checked_before_the_models_config_is_read(args, message,
                                                                 tiny_model_dir, tmp_path):
    """The config names a model type transformers does not know: reading it would fail."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "no-such-type"}))
    result, _ = run_cli("serve", "--model", str(tmp_path), "--port", "0", *args)
    assert assert_one_error_line(result, 2).startswith(message)

"""What a real `pdserve serve` process logs: with --log-format json every line is one JSON
object; loading progress, the startup line (model, dtype, KV cache, endpoint), one record per
request's end with its token counts, and periodic stats, which --disable-log-stats turns off.
The stats interval is lowered through PDSERVE_LOG_STATS_INTERVAL_S."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
from cluster_procs import stop_process, wait_for

from pdserve.config import kv_bytes_per_block
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.stats_logger import INTERVAL_ENV

KV_BYTES = 8 << 20


class LoggedServe:
    """`pdserve serve MODEL` on a free port, keeping every line it writes (stdout + stderr)."""

    def __init__(self, model_dir, *args: str, interval_s: float, json_logs: bool):
        self.json_logs = json_logs
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", str(model_dir), "--port", "0",
             "--device", "cpu", "--kv-cache-memory-bytes", str(KV_BYTES), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", INTERVAL_ENV: str(interval_s)})
        threading.Thread(target=self._drain, daemon=True).start()
        if not wait_for(lambda: self.url or self.proc.poll() is not None, timeout=180):
            self.stop()
        assert self.url, "serve did not start:\n" + "".join(self.lines[-30:])
        assert wait_for(self._healthy, timeout=60), "".join(self.lines[-30:])

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def messages(self) -> list[str]:
        return [json.loads(line)["message"] if self.json_logs else line
                for line in list(self.lines)]

    @property
    def url(self) -> str | None:
        for message in self.messages():
            if "gateway listening on " in message:
                return message.rsplit("listening on ", 1)[1].strip()
        return None

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def complete(self, model_dir, max_tokens: int) -> dict:
        body = {"model": str(model_dir), "prompt": "The history of the printing press",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        stop_process(self.proc)


def records(server: LoggedServe, logger: str | None = None) -> list[dict]:
    found = [json.loads(line) for line in list(server.lines)]
    return [r for r in found if logger is None or r["logger"] == logger]


def test_json_logs_have_startup_request_end_and_stats(tiny_model_dir):
    server = LoggedServe(tiny_model_dir, "--log-format", "json", interval_s=0.5,
                         json_logs=True)
    try:
        body = server.complete(tiny_model_dir, max_tokens=5)
        ends = lambda: [r for r in records(server, "pdserve.request")  # noqa: E731
                        if r["request_id"] == body["id"]]
        assert wait_for(ends, timeout=30), "".join(server.lines)
        stats = lambda: [r for r in records(server, "pdserve.stats")  # noqa: E731
                         if r["generation_tokens_per_s"] > 0]
        assert wait_for(stats, timeout=60), "".join(server.lines)
    finally:
        server.stop()
    every = records(server)  # every line is one JSON object with the four keys
    assert all({"time", "level", "logger", "message"} <= set(r) for r in every)

    config = EngineArgs(model=str(tiny_model_dir), device="cpu",
                        kv_cache_memory_bytes=KV_BYTES).create_engine_config()
    blocks = KV_BYTES // kv_bytes_per_block(config.model.arch, 16, config.model.dtype)
    messages = [r["message"] for r in every]
    loading = next(i for i, m in enumerate(messages) if m.startswith("loading "))
    assert messages[loading] == f"loading {tiny_model_dir} (float32, cpu)..."
    assert messages[loading + 1].startswith(f"loaded {tiny_model_dir} in ")
    [startup] = [m for m in messages if m.startswith("serving ")]
    assert startup == (f"serving {tiny_model_dir} (float32, cpu), KV cache {blocks} blocks "
                       f"of 16 tokens = {blocks * 16} tokens, 0.01 GiB; OpenAI API on "
                       f"{server.url}/v1")

    [end] = ends()
    assert end["level"] == "INFO" and end["finish_reason"] == "length"
    assert end["prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert end["output_tokens"] == body["usage"]["completion_tokens"] == 5
    assert 0 <= end["ttft_s"] <= end["e2e_s"]
    stat = stats()[0]
    assert stat["prompt_tokens_per_s"] >= 0 and 0 <= stat["kv_cache_usage_pct"] <= 100
    assert {"running_requests", "waiting_requests", "prefix_cache_hit_rate_pct"} <= set(stat)
    assert "generation throughput" in stat["message"]


def test_disable_log_stats_turns_the_periodic_stats_off(tiny_model_dir):
    server = LoggedServe(tiny_model_dir, "--disable-log-stats", interval_s=0.2,
                         json_logs=False)
    try:
        body = server.complete(tiny_model_dir, max_tokens=8)
        end = f"pdserve.request: request {body['id']} finished (length): "
        assert wait_for(lambda: any(end in line for line in server.lines), timeout=30)
        time.sleep(2.0)  # ten intervals, each of which would have logged a stats line
    finally:
        server.stop()
    assert not [line for line in server.lines if "pdserve.stats" in line]
    assert any("KV cache " in line and "OpenAI API on" in line for line in server.lines)

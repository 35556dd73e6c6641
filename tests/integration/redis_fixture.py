"""A real redis-server for the test session: free port, temp dir, no persistence.

If redis-server is missing it is installed with apt-get when running as root; otherwise the
tests that need it are skipped with the reason. The Python client comes from the `redis`
package (a test dependency).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.ports import pick_free_port


def _free_port() -> int:
    return pick_free_port("127.0.0.1")


def _find_or_install_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    if os.geteuid() != 0:
        pytest.skip("redis-server not installed (apt-get install -y redis-server) and not root")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"could not install redis-server: {done.stderr.strip()[-300:]}")
    path = shutil.which("redis-server")
    if not path:
        pytest.skip("redis-server still missing after apt-get install")
    return path


class RedisServer:
    """One redis-server process on a fixed port; stop() and start() again keep the port."""

    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.workdir), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: an outage, not a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A running redis-server for the whole session, killed at the end."""
    pytest.importorskip("redis", reason="the `redis` package (redis-py) is not installed")
    server = RedisServer(_find_or_install_redis_server(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()

"""`pdserve up` as a user runs it: ready line, endpoints, a request, and no process left behind."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from pdserve.cluster import SHARED_CORES_DISAGG_MIN_RUNNING
from pdserve.cpu_budget import available_cores
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def open_files(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            found.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return found


def wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def start_up(model_dir, log_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir), "--grpc-port", "0",
         "--kv-cache-memory-bytes", str(8 << 20), "--startup-timeout-s", "90",
         "--log-dir", str(log_dir), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_until(proc, marker, timeout):
    """Lines of proc's output up to the one containing `marker` (bounded wait)."""
    lines: list[str] = []
    done = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if marker in line:
                break
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    done.wait(timeout)
    assert any(marker in line for line in lines), "\n".join(lines)
    return lines


def test_up_serves_and_sigterm_leaves_no_process(tiny_model_dir, tmp_path):
    proc = start_up(tiny_model_dir, tmp_path, "--num-prefill", "1", "--num-decode", "1",
                    "--disagg-threshold", "16", "--disagg-min-running", "0")
    try:
        lines = read_until(proc, "ready", timeout=120)
        assert lines[0].split() == ["logs", str(tmp_path)]  # first: readable while it starts
        endpoints = dict(line.split()[:2] for line in lines[1:-1])
        assert list(endpoints)[:4] == ["http", "router", "prefill-0", "decode-0"]
        pids = children(proc.pid)
        assert len(pids) == 4
        # Each engine process on every core, taking turns in the cluster's lock file
        # (pdserve.cpu_turns).
        turns_file = str(tmp_path / "cpu-turns")
        engines = [pid for pid in pids
                   if {"prefill", "decode"} & set(Path(f"/proc/{pid}/cmdline").read_text()
                                                  .split("\0"))]
        assert len(engines) == 2
        for pid in engines:
            assert sorted(os.sched_getaffinity(pid)) == available_cores()
            assert turns_file in open_files(pid)
        body = json.dumps({"model": str(tiny_model_dir), "prompt": "Hello", "max_tokens": 3,
                           "temperature": 0}).encode()
        req = urllib.request.Request(endpoints["http"] + "/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 3
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(endpoints["router"]))
        msgs = list(stub.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=list(range(100, 140))),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
            timeout=30))
        assert sum(len(m.token_ids) for m in msgs) == 4 and msgs[-1].served_by.disaggregated
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopped" in proc.stdout.read()
        assert wait_gone(pids, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_children_die_with_a_killed_parent(tiny_model_dir, tmp_path):
    proc = start_up(tiny_model_dir, tmp_path)
    try:
        deadline = time.monotonic() + 30
        while len(children(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = children(proc.pid)
        assert len(pids) == 4
        # The engines share the cores (turns), so the router keeps prompts on a decode
        # instance running fewer than 12 requests.
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in pids]
        router_cmd = next(c for c in cmdlines if "router" in c)
        flag = router_cmd.index("--disagg-min-running")
        assert router_cmd[flag + 1] == str(SHARED_CORES_DISAGG_MIN_RUNNING)
    finally:
        proc.kill()
        proc.wait(10)
    assert wait_gone(pids, 20) == []


def test_startup_failure_names_the_process(tmp_path):
    proc = start_up(tmp_path / "no-such-model", tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out.splitlines()[0].split() == ["logs", str(tmp_path)]
    assert "exited with code" in out and "model" in out


def http_status(url: str, body: dict, key: str | None, timeout: float = 60) -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_child_that_dies_is_restarted(tiny_model_dir, tmp_path):
    """`up` supervises: an engine killed (as one whose loop died exits 1) is started again
    with the same arguments and port, and the cluster serves through it again; a restarted
    gateway still requires the API key, which no child's command line shows; a restarted
    router is dialled again by the gateway and the instances."""
    key = "sk-up-key-0123456789"
    proc = start_up(tiny_model_dir, tmp_path, "--num-prefill", "1", "--num-decode", "1",
                    "--disagg-threshold", "16", "--disagg-min-running", "0", "--api-key", key)
    try:
        lines = read_until(proc, "ready", timeout=120)
        endpoints = dict(line.split()[:2] for line in lines[1:-1])
        decode = next(pid for pid in children(proc.pid)
                      if "decode" in Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
        os.kill(decode, signal.SIGKILL)
        read_until(proc, "restarted decode-0", timeout=30)
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(endpoints["router"]))
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=list(range(100, 140))),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        deadline, served = time.monotonic() + 90, None
        while served is None and time.monotonic() < deadline:
            try:
                served = list(stub.Generate(request, timeout=30))[-1].served_by
            except grpc.RpcError:
                time.sleep(0.5)  # the new decode instance is still loading
        assert served is not None and served.decode_instance == "decode-0"
        assert decode not in children(proc.pid)
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in children(proc.pid)}
        assert not any(key in c for c in cmdlines.values())
        gateway = next(pid for pid, c in cmdlines.items() if "serve" in c.split("\0"))
        os.kill(gateway, signal.SIGKILL)
        read_until(proc, "restarted gateway", timeout=30)
        body = {"model": str(tiny_model_dir), "prompt": "Hello", "max_tokens": 2}
        url, status = endpoints["http"] + "/completions", None
        while status is None and time.monotonic() < deadline + 60:
            try:
                status = http_status(url, body, key)
            except OSError:
                time.sleep(0.5)  # the new gateway is still starting
        assert status == 200
        assert http_status(url, body, None) == 401
        assert http_status(url, body, "sk-wrong-key-0123") == 401
        # The router restarted: the gateway dials it again and the instances register anew.
        router = next(pid for pid, c in cmdlines.items() if "router" in c.split("\0"))
        os.kill(router, signal.SIGKILL)
        read_until(proc, "restarted router", timeout=30)
        status = None
        while status != 200 and time.monotonic() < deadline + 120:
            try:
                status = http_status(url, body, key)  # 503 until the instances register
            except OSError:
                pass
            time.sleep(0.2)
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

"""Ending a process with `exit_now`: atexit handlers and finalizers run, output is flushed,
the status is the one given; the `pdserve` command ends that way; `pdserve up` sweeps dead
instances' segments without importing torch; a gateway stopped as soon as it says it listens
exits 0."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

EXITING = """
import atexit, logging, sys, weakref
from pathlib import Path
from pdserve.process_exit import exit_now

out = Path(sys.argv[1])
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
class Segment: pass
segment = Segment()
weakref.finalize(segment, lambda: out.with_suffix(".finalized").write_text("ran"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
logging.getLogger("t").info("logged")
sys.stdout.write("no newline, still buffered")
exit_now(None if sys.argv[2] == "none" else int(sys.argv[2]))
print("never printed")
"""


def python_c(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args...` in a fresh interpreter, its output captured."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("code,status", [("3", 3), ("0", 0), ("none", 0)])
def test_exit_now_runs_handlers_flushes_and_keeps_the_status(tmp_path, code, status):
    out = tmp_path / "probe"
    done = python_c(EXITING, str(out), code)
    assert done.returncode == status
    assert done.stdout == "no newline, still buffered"
    assert "logged" in done.stderr
    assert out.with_suffix(".atexit").read_text() == "ran"
    assert out.with_suffix(".finalized").read_text() == "ran"


def test_the_pdserve_command_ends_through_exit_now(tmp_path):
    """`run` (the console script) ends the process with main's status, after the atexit
    handlers; it never returns."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "pdserve"]
    assert script.value == "pdserve.cli:run"
    marker = tmp_path / "atexit"
    done = python_c("import atexit, pathlib, sys\n"
                    f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'ran')\n"
                    "sys.argv = ['pdserve', 'serve', '--port', '70000']\n"
                    "from pdserve.cli import run\n"
                    "run()\n"
                    "print('returned')\n")
    assert done.returncode == 2 and "--port" in done.stderr
    assert "returned" not in done.stdout
    assert marker.read_text() == "ran"


def test_sweeping_segments_does_not_import_torch():
    done = python_c("import sys\n"
                    "from pdserve.kv_transfer.shm_segment import sweep_stale_segments\n"
                    "sweep_stale_segments('/nonexistent')\n"
                    "print('torch' in sys.modules)\n"
                    "from pdserve.kv_transfer import KINDS, KVTransferError, make_transport\n"
                    "print(KINDS, KVTransferError.__name__, callable(make_transport))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False", "('shm', 'tcp', 'nixl') KVTransferError True"]


def test_an_unknown_name_of_the_transfer_package_is_an_attribute_error():
    import pdserve.kv_transfer as kv_transfer

    with pytest.raises(AttributeError, match="no_such_name"):
        kv_transfer.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from pdserve.kv_transfer import no_such_name")


STOPPED_AT_ONCE = """
import os, signal, sys
from contextlib import asynccontextmanager
from starlette.applications import Starlette
from pdserve.gateway import server
said = server.announce
def announce_then_stop(message):  # the signal lands as a supervisor reads the line
    said(message)
    os.kill(os.getpid(), signal.SIGTERM)
server.announce = announce_then_stop
@asynccontextmanager
async def lifespan(app):
    print("app started", flush=True)
    yield
    print("app shut down", flush=True)
status = server.serve_http(Starlette(lifespan=lifespan), "127.0.0.1", 0)
print("served", status)
sys.exit(status)
"""


ROUTER_STOPPED_AT_ONCE = """
import os, signal, sys
from pdserve.router import server
said = server.announce
def announce_then_stop(message):
    said(message)
    os.kill(os.getpid(), signal.SIGTERM)
server.announce = announce_then_stop
status = server.main(["--grpc-port", "0", "--model", sys.argv[1]])
print("served", status)
sys.exit(status)
"""


def test_a_gateway_stopped_as_it_says_it_listens_ends_cleanly():
    """SIGTERM right after the "listening" line, before uvicorn has taken the signals over:
    the server starts, shuts down and exits 0 instead of dying of the signal."""
    done = python_c(STOPPED_AT_ONCE)
    assert done.returncode == 0, done.stderr
    assert "gateway listening on http://127.0.0.1:" in done.stdout + done.stderr
    assert "app started\napp shut down\nserved 0" in done.stdout


def test_a_router_stopped_as_it_says_it_listens_ends_cleanly(tiny_model_dir):
    """The gRPC servers (router, instances) catch the signals before they say they listen."""
    done = python_c(ROUTER_STOPPED_AT_ONCE, str(tiny_model_dir))
    assert done.returncode == 0, done.stderr
    assert "router listening on 127.0.0.1:" in done.stdout + done.stderr
    assert "served 0" in done.stdout

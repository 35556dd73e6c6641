"""Regenerates the committed gRPC stubs from proto/pdserve/v1/*.proto.

    python -m pdserve.proto.generate [OUT_DIR]

Stubs import each other as `pdserve.proto.pdserve.v1.*_pb2`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = Path(__file__).resolve().parent


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Run grpc_tools.protoc over every .proto file; returns the files written."""
    sources = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.glob("pdserve/v1/*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: protoc runs in its own process: its extension module can crash a process that
    # has already loaded torch and grpc.
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            *sources]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed: {done.stderr}")
    for pkg in (out_dir / "pdserve", out_dir / "pdserve" / "v1"):
        (pkg / "__init__.py").touch()
    _qualify_imports(out_dir)
    return sorted(p for p in (out_dir / "pdserve" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def _qualify_imports(out_dir: Path) -> None:
    """protoc writes `from pdserve.v1 import x_pb2`; the stubs live in pdserve.proto."""
    for path in (out_dir / "pdserve" / "v1").glob("*.py*"):
        text = path.read_text()
        path.write_text(text.replace("from pdserve.v1 import", "from pdserve.proto.pdserve.v1 import"))


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)

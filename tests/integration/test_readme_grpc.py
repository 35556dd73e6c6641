"""The README's gRPC client example, taken from README.md as it stands, run against a real
1P1D cluster (`Cluster`, as `pdserve up` starts it, logging JSON): it prints the same greedy
text as the offline engine, and the prefill and decode instances each log the request's end."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster_procs import wait_for

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:50051"  # `pdserve up`'s router, as the example dials it
KV_BYTES = 8 << 20


def readme_grpc_example() -> str:
    """The one ```python block of README.md that calls Router.Generate."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    found = [b for b in blocks if "router_pb2.GenerateRequest(" in b and ".Generate(" in b]
    assert len(found) == 1, f"expected one gRPC example in README.md, found {len(found)}"
    return found[0]


def request_ends(log_path: Path) -> list[dict]:
    """The request-end records of a JSON log (a line still being written is left out)."""
    text = log_path.read_text()
    lines = text.splitlines()[:text.count("\n")]
    return [r for r in map(json.loads, lines) if r["logger"] == "pdserve.request"]


def test_readme_grpc_example_streams_from_a_cluster(tiny_model_dir, tmp_path, capsys):
    code = readme_grpc_example()
    assert code.count(README_ADDRESS) == 1
    prompt = re.search(r'text="([^"]+)"', code).group(1)
    max_tokens = int(re.search(r"max_tokens=(\d+)", code).group(1))
    assert "temperature=0" in code  # greedy: comparable with the offline engine
    expected = LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES).generate(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    spec = ClusterSpec(model=str(tiny_model_dir), grpc_port=0, disagg_threshold=0,
                       kv_cache_memory_bytes=KV_BYTES, startup_timeout_s=120,
                       log_dir=str(tmp_path), log_format="json")
    with Cluster(spec) as cluster:
        capsys.readouterr()
        exec(compile(code.replace(README_ADDRESS, cluster.router_address), str(README),
                     "exec"), {"__name__": "readme_example"})
        printed = capsys.readouterr().out
        logs = {c.name: c.log_path for c in cluster.instances}
        assert wait_for(lambda: all(request_ends(path) for path in logs.values()), timeout=30)
    assert printed == expected[0].outputs[0].text + "\n"
    [prefill_end] = request_ends(logs["prefill-0"])
    [decode_end] = request_ends(logs["decode-0"])
    num_prompt = len(expected[0].prompt_token_ids)
    assert prefill_end["prompt_tokens"] == decode_end["prompt_tokens"] == num_prompt
    assert prefill_end["output_tokens"] == 1  # the first token, sent to the client at once
    # D counts the whole output: P's first token comes with the KV handle.
    assert decode_end["output_tokens"] == len(expected[0].outputs[0].token_ids)
    assert decode_end["finish_reason"] == expected[0].outputs[0].finish_reason

"""The CPU budget of engine processes: core lists, shares for `pdserve up`, pinning, and the
OpenMP spin default that keeps shared cores from collapsing (benchmarks/cpu_budget.py)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from pdserve.cpu_budget import (available_cores, format_cores, parse_cores, split_cores,
                                torch_ships_libgomp)


def test_parse_and_format_cores():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores(" 5 , 1-2,2") == [1, 2, 5]
    assert format_cores([0, 2]) == "0,2"
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_cores(bad)


def test_split_gives_disjoint_shares_then_round_robin():
    assert split_cores(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert split_cores(1, [4, 5]) == [[4, 5]]
    assert split_cores(3, [0, 1]) == [[0], [1], [0]]
    assert split_cores(0, [0, 1]) == []
    shares = split_cores(2)
    assert sorted(c for s in shares for c in s) == available_cores()[:sum(map(len, shares))]


def _child(code: str, env: dict | None = None, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True, env={**{k: v for k, v in os.environ.items()
                                             if k not in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS",
                                                          "OMP_WAIT_POLICY")},
                                          **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_pdserve_sets_the_spin_default_before_torch_and_keeps_a_users():
    code = "import json, os, pdserve; print(json.dumps(os.environ.get('GOMP_SPINCOUNT')))"
    assert _child(code) == "1000"
    assert _child(code, {"GOMP_SPINCOUNT": "123"}) == "123"


def test_import_pdserve_sets_the_wait_policy_for_libgomp_only_and_keeps_a_users():
    """libgomp's throttled spin (more OpenMP threads than cores: a server's engine thread
    beside the loading thread's pool) is 1,000 with the active policy, 100 without."""
    code = "import json, os, pdserve; print(json.dumps(os.environ.get('OMP_WAIT_POLICY')))"
    if sys.platform == "linux":  # the OpenMP library torch maps once loaded
        importlib.import_module("torch")
        mapped = [line.split()[-1] for line in open("/proc/self/maps") if "omp" in line]
        assert torch_ships_libgomp() == any("libgomp" in path for path in mapped)
    assert _child(code) == ("active" if torch_ships_libgomp() else None)
    assert _child(code, {"OMP_WAIT_POLICY": "passive"}) == "passive"


def test_cli_pins_the_engine_process_with_one_thread_per_core():
    """What `pdserve prefill|decode|serve --cpu-cores` does first, before torch loads."""
    core = available_cores()[-1]
    code = ("import json, os, sys\n"
            "from pdserve.cpu_budget import apply_cpu_budget, parse_cores\n"
            "apply_cpu_budget(parse_cores(sys.argv[1]))\n"
            "import torch\n"
            "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))")
    assert _child(code, None, str(core)) == [[core], 1]
    code_bad = ("from pdserve.cpu_budget import apply_cpu_budget\n"
                "apply_cpu_budget([100000])")
    done = subprocess.run([sys.executable, "-c", code_bad], capture_output=True, text=True)
    assert done.returncode != 0 and "cpu_cores: 100000 not available" in done.stderr


def test_cluster_engine_flags_for_each_way_of_sharing_cores(tmp_path):
    """What `pdserve up --cpu-sharing` passes to its prefill and decode processes."""
    from pdserve.cluster import Cluster, ClusterSpec

    def flags(sharing):
        spec = ClusterSpec(cpu_cores=(0, 1, 2), cpu_sharing=sharing, log_dir=str(tmp_path))
        return Cluster(spec)._cpu_flags(2)

    turns = ["--cpu-cores", "0,1,2", "--cpu-turns", str(tmp_path / "cpu-turns")]
    assert flags("turns") == [turns, turns]
    assert flags("split") == [["--cpu-cores", "0,1"], ["--cpu-cores", "2"]]
    assert flags("shared") == [["--cpu-cores", "0,1,2"]] * 2
    one = Cluster(ClusterSpec(num_prefill=0, cpu_cores=(0, 1), log_dir=str(tmp_path)))
    assert one._cpu_flags(1) == [["--cpu-cores", "0,1"]]  # nobody to take turns with
    with pytest.raises(ValueError, match="cpu_sharing: expected one of turns, split, shared"):
        ClusterSpec(cpu_sharing="spread")

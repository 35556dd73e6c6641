"""An engine stepping on its own thread (a server's EngineLoop) while the loading thread keeps
an OpenMP pool: libgomp counts more threads than cores and throttles the barrier spin, so the
compute threads sleep and wake at every barrier unless pdserve's wait-policy default
(cpu_budget.set_openmp_defaults) raises the throttled spin. Counted in context switches, in
child processes that set the policy before torch loads. Two to ten engine processes, each
counted against the machine's load: with PDSERVE_SLOW_TESTS=1 (tests/unit/test_cpu_budget.py
checks in every run that the policy is set before torch loads)."""

import json
import os
import subprocess
import sys

import pytest

from pdserve.cpu_budget import available_cores, torch_ships_libgomp

CHILD = """
import json, os, resource, sys, threading
import pdserve  # sets OMP_WAIT_POLICY before torch loads
if sys.argv[2] == "unset":
    os.environ.pop("OMP_WAIT_POLICY", None)
import torch
from pdserve import LLM, SamplingParams, TokensPrompt
llm = LLM(model=sys.argv[1], kv_cache_memory_bytes=1 << 24)
torch.ones(1 << 22).sum()  # the loading thread holds an OpenMP pool, as a server's does
engine, switches = llm.llm_engine, []
def steps():
    engine.add_request("r", TokensPrompt(prompt_token_ids=list(range(5, 69))),
                       SamplingParams(max_tokens=500, ignore_eos=True, temperature=0))
    for _ in range(3):
        engine.step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(100):
        engine.step()
    switches.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps(switches[0]))
"""


def _switches(model_dir, policy: str) -> int:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), policy], env=env,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.environ.get("PDSERVE_SLOW_TESTS"),
                    reason="set PDSERVE_SLOW_TESTS=1 (2-10 engine processes, 15-50 s)")
@pytest.mark.skipif(len(available_cores()) < 2 or not torch_ships_libgomp(),
                    reason="needs two cores and torch's libgomp")
def test_engine_thread_keeps_spinning_beside_another_pool(tiny_model_dir):
    if os.getloadavg()[0] > 2 * len(available_cores()):
        # Other jobs preempt the compute threads: long waits, which outlast either spin, then
        # dominate both counts, and the comparison says nothing.
        pytest.skip("the machine is too busy to count barrier sleeps")
    # Another tenant of the host preempting a compute thread only adds switches, to either
    # count, and the load average here does not see it. Hosts differ in how many barrier
    # gaps outlast the raised spin too (2 cores: about 400 against 3,400 on a quiet host,
    # 1,300-1,800 against 3,750 on a busier one, 2,700-3,000 against 3,500-3,700 on one with
    # slower memory). Without the policy the counts are level (within a few percent), so it
    # must halve them in one round, or cut them by a tenth in two rounds of up to five.
    rounds, cut = [], 0
    for _ in range(5):
        rounds.append((_switches(tiny_model_dir, "active"), _switches(tiny_model_dir, "unset")))
        active, unset = rounds[-1]
        cut += active * 10 < unset * 9
        if cut == 2 or (len(rounds) == 1 and active * 2 < unset):
            return
    if os.getloadavg()[0] > 1.5 * len(available_cores()):
        pytest.skip(f"the machine got busy while counting: {rounds}")
    pytest.fail(f"(active, unset) switches in each round: {rounds}")

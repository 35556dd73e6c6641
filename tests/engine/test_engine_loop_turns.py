"""An engine loop with CPU turns steps only while its process holds the turn."""

import subprocess
import sys

import pytest

from pdserve import EngineArgs, LLMEngine, SamplingParams
from pdserve.cpu_turns import use_cpu_turns
from pdserve.engine.engine_loop import EngineLoop, StreamTimeout

HOLDER = """
import sys
from pdserve.cpu_turns import CpuTurns
with CpuTurns(sys.argv[1]).turn():
    print("holding", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def turns(tmp_path):
    yield use_cpu_turns(str(tmp_path / "cpu-turns"))
    use_cpu_turns(None)


def test_steps_wait_for_the_turn_another_process_holds(tiny_model_dir, tmp_path, turns):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
    loop = EngineLoop(engine).start()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cpu-turns")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        stream = loop.submit("r", {"prompt_token_ids": list(range(100, 120))},
                             SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        with pytest.raises(StreamTimeout):
            stream.get(timeout=1.0)  # no step while the other process computes
        assert turns.turns_taken == 0
        holder.stdin.write("done\n")
        holder.stdin.flush()
        tokens = [t for out in stream for t in out.outputs[0].token_ids]
        assert len(tokens) == 4 and stream.finished
        assert turns.turns_taken >= 4 and turns.turns_missed == 0  # one per step with work
    finally:
        loop.stop()
        holder.kill()
        holder.wait(10)

"""`pdserve generate` as a user runs it."""

import subprocess
import sys

from pdserve import SamplingParams


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(tiny_model_dir, tiny_llm):
    result = run_cli("--model", str(tiny_model_dir), "--prompt", "Hello there",
                     "--max-tokens", "6", "--kv-cache-memory-bytes", str(4 << 20))
    assert result.returncode == 0, result.stderr
    [expected] = tiny_llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6),
                                   use_tqdm=False)
    assert result.stdout == expected.outputs[0].text + "\n"


def test_generate_bad_input_names_the_field(tiny_model_dir):
    result = run_cli("--model", str(tiny_model_dir), "--prompt", "x", "--temperature", "-2")
    assert result.returncode == 2 and "temperature" in result.stderr
    result = run_cli("--model", "/no/such/model", "--prompt", "x")
    assert result.returncode == 2 and "model" in result.stderr

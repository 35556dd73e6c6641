"""benchmarks/vs_vllm.py's ratios: what the results file and the plot report against the goals."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_vllm.py"


@pytest.fixture(scope="module")
def vs_vllm():
    spec = importlib.util.spec_from_file_location("vs_vllm", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(engine, tok_per_s, tok_per_cpu_s, s_per_request=1.0):
    return {"engine": engine, "tok_per_s": tok_per_s, "tok_per_cpu_s": tok_per_cpu_s,
            "s_per_request": s_per_request}


def _serving(throughput, ttft, tpot, itl_p99):
    return {"output_token_throughput": throughput, "ttft_s": {"p50": ttft},
            "tpot_s": {"p50": tpot}, "itl_s": {"p99": itl_p99}}


def test_best_against_best_for_throughput_and_cold_prefill(vs_vllm):
    report = {
        "offline": [_run("pdserve", 400, 200), _run("vllm", 300, 160),
                    _run("vllm", 320, 150), _run("pdserve", 380, 210)],
        "decode": [_run("pdserve", 900, 450), _run("vllm", 600, 300)],
        "prefill": [_run("pdserve", 0, 0, 1.2), _run("vllm", 0, 0, 1.5),
                    _run("pdserve", 0, 0, 1.1), _run("vllm", 0, 0, 1.3)],
        "decode_ceiling_tok_per_s": 450.0,
        "serving": {},
    }
    r = vs_vllm.ratios(report)
    assert r["offline_tok_per_s"] == pytest.approx(400 / 320)  # each system's best run
    assert r["offline_tok_per_cpu_s"] == pytest.approx(210 / 160)
    assert r["decode_tok_per_s"] == pytest.approx(1.5)
    assert r["prefill_2000_tokens_time"] == pytest.approx(1.1 / 1.3)  # the fastest of each
    assert r["decode_pdserve_over_ceiling"] == pytest.approx(2.0)
    assert not any(k.startswith("serving") for k in r)


def test_drafted_and_sampled_workloads_have_their_own_ratios(vs_vllm):
    """Runs with n-gram speculative decoding or sampling in both systems are compared with
    runs of the same kind only."""
    report = {"offline": [_run("pdserve", 400, 200), _run("vllm", 300, 150)],
              "offline-ngram": [_run("pdserve", 500, 250), _run("vllm", 350, 170)],
              "text-sampled": [_run("pdserve", 420, 220), _run("vllm", 200, 100)],
              "text-sampled-ngram": [_run("pdserve", 450, 230), _run("vllm", 150, 80)],
              "serving": {}}
    r = vs_vllm.ratios(report)
    assert r["offline_tok_per_s"] == pytest.approx(400 / 300)
    assert r["offline-ngram_tok_per_s"] == pytest.approx(500 / 350)
    assert r["offline-ngram_tok_per_cpu_s"] == pytest.approx(250 / 170)
    assert r["text-sampled_tok_per_s"] == pytest.approx(420 / 200)
    assert r["text-sampled-ngram_tok_per_cpu_s"] == pytest.approx(230 / 80)
    assert "text_tok_per_s" not in r


def test_serving_ratios_and_failed_runs_left_out(vs_vllm):
    report = {
        "offline": [_run("pdserve", 400, 200), {"error": "vLLM did not start", "engine": "vllm"}],
        "decode": [{"error": "killed", "engine": "pdserve"}], "prefill": [],
        "decode_ceiling_tok_per_s": 1.0,
        "serving": {8: {"colocated": _serving(280, 0.2, 0.025, 0.05),
                        "vllm": _serving(112, 2.0, 0.05, 0.04)},
                    32: {"colocated": _serving(300, 0.5, 0.09, 0.2)}},  # vLLM failed here
    }
    r = vs_vllm.ratios(report)
    assert "offline_tok_per_s" not in r  # no vLLM run to compare with
    assert "decode_pdserve_over_ceiling" not in r
    assert r["serving_c8_throughput"] == pytest.approx(2.5)
    assert r["serving_c8_ttft_p50"] == pytest.approx(0.1)
    assert r["serving_c8_tpot_p50"] == pytest.approx(0.5)
    assert r["serving_c8_itl_p99"] == pytest.approx(1.25)
    assert not any(k.startswith("serving_c32") for k in r)


def test_text_workload_ratio_needs_the_same_requests(vs_vllm):
    def run(engine, tok_per_s, sha):
        return _run(engine, tok_per_s, tok_per_s / 2) | {"requests_sha": sha}

    report = {"text": [run("pdserve", 330, "a1"), run("vllm", 220, "a1")],
              "offline": [run("pdserve", 400, "b1"), run("vllm", 300, "b2")],
              "decode": [], "prefill": [], "decode_ceiling_tok_per_s": 1.0, "serving": {}}
    r = vs_vllm.ratios(report)
    assert r["text_tok_per_s"] == pytest.approx(1.5)
    assert r["text_tok_per_cpu_s"] == pytest.approx(1.5)
    assert "offline_tok_per_s" not in r  # the two systems ran different requests

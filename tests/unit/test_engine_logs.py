"""What a serving engine logs, on a fake clock: one line per request's end (RequestLog) and
periodic stats while there is traffic (StatsLogger)."""

from __future__ import annotations

import logging

import pytest

from pdserve.engine.request_log import RequestLog
from pdserve.engine.stats_logger import Counters, StatsLogger, interval_from_env
from pdserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.sampling_params import RequestOutputKind


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def output(rid, tokens, finished=False, reason=None, index=0, prompt=(1, 2, 3), error=None,
           metrics=None):
    return RequestOutput(rid, None, list(prompt), None,
                         [CompletionOutput(index, "x", list(tokens), None, None, reason)],
                         finished, num_cached_tokens=1, error=error, metrics=metrics)


def fields(caplog, logger):
    return [r.fields for r in caplog.records if r.name == logger]


def test_request_end_has_tokens_ttft_and_e2e(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    log = RequestLog(clock)
    log.started("r1", RequestOutputKind.DELTA, prompt_tokens=3)
    times = RequestMetrics(arrival_time=1000.0)  # the engine's wall-clock record
    clock.now += 0.5
    log.output(output("r1", [], metrics=times))  # a step that sampled nothing for it yet
    clock.now += 0.25
    times = RequestMetrics(1000.0, first_token_time=1000.75)
    log.output(output("r1", [7], metrics=times))
    clock.now += 1.0
    times = RequestMetrics(1000.0, first_token_time=1000.75, finished_time=1001.75)
    log.output(output("r1", [8, 9], finished=True, reason="length", metrics=times))
    [f] = fields(caplog, "pdserve.request")
    assert f == {"request_id": "r1", "finish_reason": "length", "prompt_tokens": 3,
                 "output_tokens": 3, "cached_tokens": 1, "ttft_s": 0.75, "e2e_s": 1.75}
    assert "request r1 finished (length)" in caplog.records[-1].getMessage()


def test_final_only_outputs_are_counted_once_and_n_gt_1_sums_completions(caplog):
    caplog.set_level(logging.INFO)
    log = RequestLog(Clock())
    log.started("p", RequestOutputKind.FINAL_ONLY, prompt_tokens=3)
    log.output(output("p", [5], finished=True, reason="length"))
    log.started("n2", RequestOutputKind.DELTA, prompt_tokens=3)
    log.output(output("n2", [1, 2], index=0))
    log.output(output("n2", [3], index=1, finished=False, reason="stop"))
    log.output(output("n2", [4], index=0, finished=True, reason="length"))
    got = {f["request_id"]: f for f in fields(caplog, "pdserve.request")}
    assert got["p"]["output_tokens"] == 1 and got["p"]["finish_reason"] == "length"
    assert got["n2"]["output_tokens"] == 4 and got["n2"]["finish_reason"] == "stop,length"


def test_abort_and_error_end_a_request_once(caplog):
    caplog.set_level(logging.INFO)
    log = RequestLog(Clock())
    log.started("a", RequestOutputKind.DELTA, prompt_tokens=4)
    log.ended("a", "abort")
    log.ended("a", "abort")  # already logged: nothing
    log.output(output("a", [1], finished=True, reason="stop"))  # unknown now: nothing
    log.started("e", RequestOutputKind.DELTA, prompt_tokens=4)
    log.output(output("e", [], finished=True, reason="error", error="KV load failed"))
    got = fields(caplog, "pdserve.request")
    assert [(f["request_id"], f["finish_reason"]) for f in got] == [("a", "abort"),
                                                                    ("e", "error")]
    assert got[0]["prompt_tokens"] == 4 and got[0]["ttft_s"] is None
    assert got[1]["error"] == "KV load failed"


def counters(prompt=0, gen=0, queries=0, hits=0):
    return Counters(prompt, gen, queries, hits)


def test_stats_log_once_per_interval_while_there_is_traffic(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    stats = StatsLogger(10.0, clock)
    assert not stats.observe(counters(), 0, 0, 0, 100)  # the baseline
    clock.now += 5
    assert not stats.observe(counters(100, 10), 1, 2, 25, 100)  # within the interval
    clock.now += 5
    assert stats.observe(counters(200, 50, queries=4, hits=1), 1, 2, 25, 100)
    [f] = fields(caplog, "pdserve.stats")
    assert f == {"prompt_tokens_per_s": 20.0, "generation_tokens_per_s": 5.0,
                 "running_requests": 1, "waiting_requests": 2, "kv_cache_usage_pct": 25.0,
                 "prefix_cache_hit_rate_pct": 25.0}
    clock.now += 10
    assert stats.observe(counters(200, 50, 4, 1), 0, 0, 0, 100)  # one more: now idle
    clock.now += 10
    assert not stats.observe(counters(200, 50, 4, 1), 0, 0, 0, 100)  # idle: silent
    clock.now += 10
    assert stats.observe(counters(200, 60, 4, 1), 1, 0, 1, 100)  # traffic again


def test_stats_report_draft_acceptance_when_there_were_drafts(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    stats = StatsLogger(10.0, clock)
    stats.observe(Counters(0, 0, 0, 0, 40, 30), 0, 0, 0, 100)
    clock.now += 10
    assert stats.observe(Counters(0, 90, 0, 0, 100, 75), 3, 0, 10, 100)
    [f] = fields(caplog, "pdserve.stats")
    assert (f["draft_tokens"], f["accepted_tokens"], f["draft_acceptance_rate_pct"]) == (
        60, 45, 75.0)
    assert "draft acceptance rate: 75.0% (45 of 60 drafted tokens)" in caplog.text


def test_stats_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_LOG_STATS_INTERVAL_S", raising=False)
    assert interval_from_env() == 10.0
    monkeypatch.setenv("PDSERVE_LOG_STATS_INTERVAL_S", "0.5")
    assert interval_from_env() == 0.5
    for bad in ("soon", "0"):
        monkeypatch.setenv("PDSERVE_LOG_STATS_INTERVAL_S", bad)
        with pytest.raises(ValueError, match="PDSERVE_LOG_STATS_INTERVAL_S"):
            interval_from_env()

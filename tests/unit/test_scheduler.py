"""Scheduler and KV cache manager, step by step, without a model."""

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import SampleResult
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_records import ModelRunnerOutput
from pdserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, **cfg):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, BS)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1000, stop_token_ids=[2]), pool


def req(rid, n_prompt, max_tokens=4, first=10, **kw):
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), eos_token_id=2)


def run_step(sched, token=7):
    out = sched.schedule()
    result = ModelRunnerOutput({c.request.request_id: SampleResult(token, None)
                                for c in out.chunks if c.completes_sequence})
    sched.update(out, result)
    return out


def drain(sched, limit=200):
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        run_step(sched)
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_then_decode_and_blocks_freed():
    sched, pool = make(max_num_batched_tokens=6)
    r = req("a", 10, max_tokens=3)
    sched.add_request(r)
    steps = [[(c.start, c.num_tokens) for c in run_step(sched).chunks] for _ in range(4)]
    assert steps == [[(0, 6)], [(6, 4)], [(10, 1)], [(11, 1)]]
    assert r.is_finished and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.num_output_tokens == 3
    assert pool.num_free_blocks == 16


def test_mixed_batch_respects_token_budget_and_max_seqs():
    sched, _ = make(max_num_batched_tokens=8, max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(str(i), 5))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("0", 5), ("1", 3)]
    assert sched.num_waiting == 1  # max_num_seqs=2


def test_prefix_cache_hit_counts_full_blocks_and_leaves_one_token():
    sched, pool = make()
    a = req("a", 9, max_tokens=1)
    sched.add_request(a)
    drain(sched)
    b = req("b", 9, max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and out.chunks[0].start == 8
    exact = req("c", 8, max_tokens=1)  # whole prompt cached: last block recomputed
    sched.add_request(exact)
    out = sched.schedule()
    assert exact.num_cached_tokens == 4


def test_preemption_recomputes_and_everything_is_freed():
    sched, pool = make(num_blocks=6, max_num_batched_tokens=64)
    reqs = [req(str(i), 8, max_tokens=12, first=100 * i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted = 0
    for _ in range(300):
        if not sched.has_unfinished_requests():
            break
        preempted += len(run_step(sched).preempted)
    assert preempted > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert pool.num_free_blocks == 6


def test_priority_policy_runs_urgent_first_and_preempts_least_urgent():
    sched, _ = make(num_blocks=8, policy="priority", max_num_batched_tokens=64)
    low = Request("low", list(range(8)), SamplingParams(max_tokens=20, ignore_eos=True),
                  priority=5)
    sched.add_request(low)
    run_step(sched)
    high = Request("high", list(range(50, 58)), SamplingParams(max_tokens=20, ignore_eos=True),
                   priority=0)
    sched.add_request(high)
    for _ in range(40):
        out = run_step(sched)
        if out.preempted:
            assert [r.request_id for r in out.preempted] == ["low"]
            break
    else:
        pytest.fail("no preemption happened")


def test_sequence_never_outgrows_the_cache():
    sched, pool = make(num_blocks=3)
    r = req("a", 5, max_tokens=100)
    sched.add_request(r)
    drain(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 12
    assert pool.num_free_blocks == 3


def test_abort_frees_blocks_and_stop_token():
    sched, pool = make()
    a = req("a", 6, max_tokens=50)
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=50, stop_token_ids=[7]))
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both sample token 7
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 7
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert pool.num_free_blocks == 16 and not sched.has_unfinished_requests()


def test_prompt_tokens_beside_running_decodes_are_capped():
    """While a request decodes, a new prompt takes at most max_prefill_tokens_with_decodes
    tokens a step (the decode's next token waits for the whole step); alone, the full budget."""
    sched, _ = make(num_blocks=64, max_num_batched_tokens=40, max_prefill_tokens_with_decodes=8)
    sched.add_request(req("a", 20, max_tokens=10))
    assert [(c.start, c.num_tokens) for c in run_step(sched).chunks] == [(0, 20)]  # alone
    sched.add_request(req("b", 30, max_tokens=2, first=50))
    steps = [[(c.request.request_id, c.num_tokens) for c in run_step(sched).chunks]
             for _ in range(4)]
    assert steps == [[("a", 1), ("b", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 8)],
                     [("a", 1), ("b", 6)]]
    uncapped, _ = make(num_blocks=64, max_num_batched_tokens=40)
    uncapped.add_request(req("a", 20, max_tokens=10))
    run_step(uncapped)
    uncapped.add_request(req("b", 30, max_tokens=2, first=50))
    assert [c.num_tokens for c in run_step(uncapped).chunks] == [1, 30]
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)


def test_prompt_token_cap_grows_with_the_decoding_requests():
    """prefill_tokens_per_decode raises the cap to that many tokens per decoding request once
    that exceeds max_prefill_tokens_with_decodes; requests still in their prompt do not
    count."""
    sched, _ = make(num_blocks=128, max_num_batched_tokens=200,
                    max_prefill_tokens_with_decodes=8, prefill_tokens_per_decode=3)
    for i in range(4):
        sched.add_request(req(f"d{i}", 4, max_tokens=50, first=20 + 10 * i))
    assert sum(c.num_tokens for c in run_step(sched).chunks) == 16  # alone: the full budget
    sched.add_request(req("p", 100, max_tokens=2, first=500))
    chunks = {c.request.request_id: c.num_tokens for c in run_step(sched).chunks}
    assert chunks == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "p": 12}  # 3 x 4 decoding > 8
    sched.finish_requests(["d0", "d1"], RequestStatus.FINISHED_ABORTED)
    chunks = {c.request.request_id: c.num_tokens for c in run_step(sched).chunks}
    assert chunks == {"d2": 1, "d3": 1, "p": 8}  # 3 x 2 < 8: the base cap
    with pytest.raises(ValueError, match="prefill_tokens_per_decode"):
        SchedulerConfig(prefill_tokens_per_decode=0)


def test_cpu_engines_default_to_a_cap_that_grows_with_the_decodes(tiny_model_dir):
    """On CPU: 64 prompt tokens beside decodes, or 8 per decoding request; both settable."""
    sched = EngineArgs(model=str(tiny_model_dir), device="cpu").create_engine_config().scheduler
    assert (sched.max_prefill_tokens_with_decodes, sched.prefill_tokens_per_decode) == (64, 8)
    sched = EngineArgs(model=str(tiny_model_dir), device="cpu", max_prefill_tokens_with_decodes=32,
                       prefill_tokens_per_decode=2).create_engine_config().scheduler
    assert (sched.max_prefill_tokens_with_decodes, sched.prefill_tokens_per_decode) == (32, 2)

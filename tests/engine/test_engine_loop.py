"""EngineLoop: callers' engine calls run between steps, never starve, never hang."""

import threading

import pytest

from pdserve import EngineArgs, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop, RequestAborted
from pdserve.services.stream_wait import abort_when_done


class CountingEngine(LLMEngine):
    """Counts its steps, so a test can tell how many steps a caller waited."""

    steps = 0

    def step(self):
        self.steps += 1
        return super().step()


@pytest.fixture
def loop(tiny_model_dir):
    engine = CountingEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def long_request(loop, rid):
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    return loop.submit(rid, {"prompt_token_ids": list(range(100, 140))}, params)


def test_submit_waits_at_most_about_one_step_while_the_engine_is_busy(loop):
    busy = long_request(loop, "busy")
    busy.get(timeout=30)  # the engine is stepping now
    waited = []
    for i in range(20):
        before = loop.engine.steps
        stream = loop.submit(f"r{i}", {"prompt_token_ids": [5, 6, 7]},
                             SamplingParams(max_tokens=1))
        waited.append(loop.engine.steps - before)
        assert next(iter(stream)).request_id == f"r{i}"
    # The call runs right after the step in flight (plus one if it landed just as the next
    # one began). A lock contended with the stepping thread let it wait many steps.
    assert max(waited) <= 2, waited
    assert loop.abort("busy")


def test_bad_input_raises_for_the_caller_and_the_loop_goes_on(loop):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        loop.submit("bad", {"prompt_token_ids": [1, 10**9]}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        stream = long_request(loop, "same")
        long_request(loop, "same")
    assert loop.abort("same")
    out = list(loop.submit("ok", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3)))
    assert out[-1].finished and len(out[-1].outputs[0].token_ids) <= 3 and stream.request_id


def test_calls_from_many_threads_all_complete(loop):
    results, errors = {}, []

    def client(i):
        try:
            stream = loop.submit(f"t{i}", {"prompt_token_ids": [10 + i, 11, 12]},
                                 SamplingParams(max_tokens=4, ignore_eos=True))
            results[i] = sum(len(o.outputs[0].token_ids) for o in stream)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and results == {i: 4 for i in range(8)}
    stats = loop.stats()
    assert stats.running_requests == 0 and stats.free_blocks == stats.total_blocks


def test_after_stop_calls_answer_instead_of_hanging(loop):
    loop.stop()
    with pytest.raises(RuntimeError, match="not running"):
        loop.submit("late", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
    assert loop.stats().running_requests == 0
    assert loop.abort("late") is False


def test_a_listener_gets_every_output_in_order_including_those_queued_before(loop):
    stream = loop.submit("listened", {"prompt_token_ids": [3, 4, 5]},
                         SamplingParams(max_tokens=12, ignore_eos=True))
    first = stream.get(timeout=30)  # read one the usual way, then switch to a listener
    got, done = [], threading.Event()

    def collect(item):
        got.append(item)
        if getattr(item, "finished", False):
            done.set()

    stream.listen(collect)
    assert done.wait(30)
    tokens = list(first.outputs[0].token_ids) + [t for o in got for t in o.outputs[0].token_ids]
    assert len(tokens) == 12 and [o.finished for o in got] == [False] * (len(got) - 1) + [True]


def test_load_reports_never_wait_for_the_step_in_progress(tiny_model_dir):
    """A step held open (as a long prefill holds it) does not hold up stats(): heartbeats
    and load reports keep flowing, so a busy instance is not taken for a dead one."""
    engine = CountingEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
    release, inside = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        if engine.steps >= 3:  # after a few normal steps, one step that waits for the test
            inside.set()
            release.wait(30)
        return real_step()

    engine.step = held_step
    loop = EngineLoop(engine).start()
    try:
        loop.submit("busy", {"prompt_token_ids": list(range(100, 140))},
                    SamplingParams(max_tokens=50, ignore_eos=True))
        assert inside.wait(30)
        got = []
        reporter = threading.Thread(target=lambda: got.append(loop.stats()))
        reporter.start()
        reporter.join(10)
        assert got and not reporter.is_alive(), "stats() waited for the step in progress"
        assert got[0].running_requests == 1 and got[0].free_blocks < got[0].total_blocks
    finally:
        release.set()
        loop.stop()


def test_abort_soon_never_waits_for_the_engine_and_ends_the_stream(loop):
    """gRPC runs done-callbacks on the thread that serves every call's events: an abort
    there must not wait for the engine (here held between two steps by another call)."""
    stream = long_request(loop, "gone")
    stream.get(timeout=30)
    gate, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=loop.call, args=(lambda: (held.set(), gate.wait()),))
    holder.start()
    try:
        assert held.wait(timeout=30)  # the engine's thread is inside that call
        caller = threading.Thread(target=loop.abort_soon, args=("gone",))
        caller.start()
        caller.join(timeout=10)
        assert not caller.is_alive()  # returned while the engine was held
    finally:
        gate.set()
    holder.join(timeout=30)
    with pytest.raises(RequestAborted):
        while True:
            stream.get(timeout=30)
    assert not loop.engine.has_unfinished_requests()


class EndedRPC:
    """A servicer context whose RPC has ended already: gRPC refuses new callbacks."""

    def add_callback(self, callback) -> bool:
        return False


def test_a_request_queued_after_its_rpc_ended_is_aborted_at_once(loop):
    """The client left while `submit` waited for the step in flight: nobody will read the
    request's outputs, so it is aborted instead of generating to max_tokens."""
    stream = long_request(loop, "orphan")
    abort_when_done(EndedRPC(), loop, "orphan")
    with pytest.raises(RequestAborted):
        while True:
            stream.get(timeout=30)
    assert loop.call(lambda: not loop.engine.has_unfinished_requests())

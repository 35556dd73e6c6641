"""Prefill engine -> KV handle -> decode engine, in one process over a real transport."""

import threading
import time

import pytest

from pdserve import EngineArgs, LLMEngine, SamplingParams
from pdserve.kv_transfer import make_transport
from pdserve.kv_transfer.connector import TransportConnector

PROMPT = "The history of the printing press begins in ancient China where " * 3


def engine(model_dir, name, connector=None, **kw):
    args = EngineArgs(model=str(model_dir), **{"kv_cache_memory_bytes": 4 << 20, **kw})
    return LLMEngine.from_engine_args(args, connector=connector)


def run(engine):
    outs = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.fixture
def pd_pair(tiny_model_dir):
    released = []
    prefill = engine(tiny_model_dir, "p", TransportConnector(make_transport("shm", "p")),
                     kv_lease_s=30)
    decode = engine(tiny_model_dir, "d", TransportConnector(make_transport("shm", "d"),
                                                            released.append))
    yield prefill, decode, released
    prefill.connector.close()
    decode.connector.close()


def wait_for(predicate, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def colocated_tokens(model_dir, ids, params) -> list[int]:
    colocated = engine(model_dir, "c")
    colocated.add_request("c", {"prompt_token_ids": ids}, params)
    return run(colocated)["c"].outputs[0].token_ids


def remote_prefill(prefill, rid, ids, params) -> dict:
    """The kv_transfer_params a decode engine continues `ids` with, after `prefill` ran it."""
    first = params.clone()
    first.max_tokens = 1
    prefill.add_request(rid, {"prompt_token_ids": ids}, first,
                        kv_transfer_params={"do_remote_decode": True})
    out = run(prefill)[rid]
    return {"remote_handle": out.kv_transfer_params["handle"],
            "output_token_ids": out.outputs[0].token_ids}


def prefill_then_decode(prefill, decode, rid, params):
    p_params = params.clone()
    p_params.max_tokens = 1
    prefill.add_request(rid, PROMPT, p_params, kv_transfer_params={"do_remote_decode": True})
    p_out = run(prefill)[rid]
    handle = p_out.kv_transfer_params["handle"]
    first = p_out.outputs[0].token_ids
    decode.add_request(rid, {"prompt_token_ids": p_out.prompt_token_ids}, params,
                       kv_transfer_params={"remote_handle": handle, "output_token_ids": first})
    return p_out, run(decode)[rid], handle


def test_disaggregated_equals_colocated_and_frees_everything(tiny_model_dir, pd_pair):
    prefill, decode, released = pd_pair
    colocated = engine(tiny_model_dir, "c")
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True)):
        colocated.add_request("r", PROMPT, params)
        expected = run(colocated)["r"].outputs[0]
        rid = f"r{params.seed}"
        p_out, d_out, handle = prefill_then_decode(prefill, decode, rid, params)
        assert d_out.outputs[0].token_ids == expected.token_ids
        assert d_out.outputs[0].text == expected.text
        assert prefill.kv_manager.leases  # pinned until the reader says it is done
        assert wait_for(lambda: released and released[-1].request_id == rid)
        assert prefill.release_kv(rid)
    result = decode.scheduler.load_results[0]
    assert result.ok and result.num_bytes > 0
    for e in (prefill, decode):
        assert e.num_free_blocks == e.num_blocks and e.kv_manager.num_requests == 0


def test_decode_pulls_only_uncached_blocks(pd_pair):
    prefill, decode, _ = pd_pair
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # Warm the decode side with the first part of the prompt.
    decode.add_request("warm", PROMPT[: len(PROMPT) // 2], params)
    run(decode)
    _, d_out, handle = prefill_then_decode(prefill, decode, "x", params)
    cached_blocks = d_out.num_cached_tokens // 16
    assert cached_blocks > 0
    total_blocks = -(-handle["num_tokens"] // 16)
    block_bytes = prefill.runner.kv_cache[:, :, 0].numel() * 4
    assert decode.scheduler.load_results[-1].num_bytes == (total_blocks - cached_blocks) * \
        block_bytes


def test_a_prompt_cached_whole_on_the_decode_side_still_lets_the_lease_go(pd_pair):
    """Nothing to read (every block of a 32-token prompt is cached on the decode side), and
    yet the producer hears at once that the reader is done, instead of at its lease's end."""
    prefill, decode, released = pd_pair
    ids = list(range(500, 532))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid in ("first", "again"):
        prefill.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1),
                            kv_transfer_params={"do_remote_decode": True})
        p_out = run(prefill)[rid]
        decode.add_request(rid, {"prompt_token_ids": ids}, params, kv_transfer_params={
            "remote_handle": p_out.kv_transfer_params["handle"],
            "output_token_ids": p_out.outputs[0].token_ids})
        d_out = run(decode)[rid]
        assert wait_for(lambda: released and released[-1].request_id == rid)
        assert prefill.release_kv(rid)
    assert d_out.num_cached_tokens == 32  # the second read nothing
    assert decode.scheduler.load_results[-1].request_id == "first"


def test_lease_expiry_frees_prefill_blocks(tiny_model_dir):
    connector = TransportConnector(make_transport("shm", "lease"))
    prefill = engine(tiny_model_dir, "p", connector, kv_lease_s=0.2)
    try:
        prefill.add_request("a", PROMPT, SamplingParams(max_tokens=1),
                            kv_transfer_params={"do_remote_decode": True})
        run(prefill)
        assert prefill.num_free_blocks < prefill.num_blocks
        time.sleep(0.3)
        prefill.step()  # any step expires leases
        assert prefill.num_free_blocks == prefill.num_blocks
        assert not prefill.release_kv("a")
    finally:
        connector.close()


def test_an_id_holding_a_lease_is_refused_until_released(pd_pair):
    """A second prefill under the id of one whose blocks are leased to a reader would replace
    that lease, and its blocks would never be freed: it is refused until the lease ends."""
    prefill, _, _ = pd_pair
    params = SamplingParams(max_tokens=1)
    remote = {"do_remote_decode": True}
    prefill.add_request("held", PROMPT, params, kv_transfer_params=remote)
    handle = run(prefill)["held"].kv_transfer_params["handle"]
    with pytest.raises(ValueError, match="request_id"):
        prefill.add_request("held", PROMPT, params, kv_transfer_params=remote)
    assert list(prefill.kv_manager.leases["held"][0][:len(handle["block_ids"])]) == \
        handle["block_ids"]
    assert prefill.release_kv("held")
    prefill.add_request("held", PROMPT, params, kv_transfer_params=remote)
    run(prefill)
    assert prefill.release_kv("held")
    assert prefill.num_free_blocks == prefill.num_blocks


def test_an_engine_without_a_connector_refuses_handles(tiny_model_dir, pd_pair):
    """It has nothing to load them with: refused at once, not failed inside a step."""
    prefill, _, _ = pd_pair
    prefill.add_request("h", PROMPT, SamplingParams(max_tokens=1),
                        kv_transfer_params={"do_remote_decode": True})
    out = run(prefill)["h"]
    bare = engine(tiny_model_dir, "bare")
    with pytest.raises(ValueError, match="handle"):
        bare.add_request("h", {"prompt_token_ids": out.prompt_token_ids},
                         SamplingParams(max_tokens=4), kv_transfer_params={
                             "remote_handle": out.kv_transfer_params["handle"],
                             "output_token_ids": out.outputs[0].token_ids})
    assert not bare.has_unfinished_requests()
    assert prefill.release_kv("h")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_pull_recomputes_or_fails_clearly(tiny_model_dir, pd_pair, policy):
    prefill, _, _ = pd_pair
    decode = engine(tiny_model_dir, "d2", TransportConnector(make_transport("shm", "d2")),
                    kv_failure_policy=policy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    p_params = params.clone()
    p_params.max_tokens = 1
    prefill.add_request("f", PROMPT, p_params, kv_transfer_params={"do_remote_decode": True})
    p_out = run(prefill)["f"]
    handle = dict(p_out.kv_transfer_params["handle"])
    handle["descriptor"] = {**handle["descriptor"], "segment": "/dev/shm/pdserve-missing-segment"}
    prefill.release_kv("f")
    decode.add_request("f", {"prompt_token_ids": p_out.prompt_token_ids}, params,
                       kv_transfer_params={"remote_handle": handle,
                                           "output_token_ids": p_out.outputs[0].token_ids})
    out = run(decode)["f"]
    if policy == "recompute":
        colocated = engine(tiny_model_dir, "c")
        colocated.add_request("f", PROMPT, params)
        assert out.outputs[0].token_ids == run(colocated)["f"].outputs[0].token_ids
    else:
        assert out.outputs[0].finish_reason == "error" and "KV transfer failed" in out.error
    assert decode.num_free_blocks == decode.num_blocks
    decode.connector.close()


def test_prompt_logprobs_come_from_the_prefill_side(tiny_model_dir, pd_pair):
    """The prefill engine computes prompt_logprobs (as a colocated one does); a decode engine
    continuing its prefill refuses to be asked for them, naming the field."""
    prefill, decode, _ = pd_pair
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    colocated = engine(tiny_model_dir, "c")
    colocated.add_request("c", PROMPT, params)
    want = run(colocated)["c"].prompt_logprobs
    prefill.add_request("p", PROMPT, params, kv_transfer_params={"do_remote_decode": True})
    p_out = run(prefill)["p"]
    assert [None if e is None else sorted(e) for e in p_out.prompt_logprobs] == \
        [None if e is None else sorted(e) for e in want]
    handle = p_out.kv_transfer_params["handle"]
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        decode.add_request("p", {"prompt_token_ids": p_out.prompt_token_ids},
                           SamplingParams(max_tokens=4, prompt_logprobs=1),
                           kv_transfer_params={"remote_handle": handle,
                                               "output_token_ids": p_out.outputs[0].token_ids})


class CountingEngine(LLMEngine):
    steps = 0

    def step(self):
        self.steps += 1
        return super().step()


def test_a_loop_waiting_only_for_a_kv_load_sleeps_until_it_finishes(tiny_model_dir, pd_pair):
    """A decode engine's loop with nothing to compute but a remote KV load in flight waits for
    the load (the connector wakes it) instead of stepping empty batches without end."""
    from pdserve.engine.engine_loop import EngineLoop

    prefill = pd_pair[0]
    in_load, finish_load = threading.Event(), threading.Event()
    transport = make_transport("shm", "dw")
    read_blocks = transport.read_blocks

    def held_read(*args, **kwargs):  # a read that lasts until the test lets it go on
        in_load.set()
        finish_load.wait(60)
        return read_blocks(*args, **kwargs)

    transport.read_blocks = held_read
    decode = CountingEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_dir), kv_cache_memory_bytes=4 << 20),
        connector=TransportConnector(transport))
    loop = EngineLoop(decode).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        p_params = params.clone()
        p_params.max_tokens = 1
        prefill.add_request("w", PROMPT, p_params, kv_transfer_params={"do_remote_decode": True})
        p_out = run(prefill)["w"]
        stream = loop.submit("w", {"prompt_token_ids": p_out.prompt_token_ids}, params,
                             kv_transfer_params={
                                 "remote_handle": p_out.kv_transfer_params["handle"],
                                 "output_token_ids": p_out.outputs[0].token_ids})
        assert in_load.wait(30)
        before = decode.steps
        time.sleep(0.5)
        # One step per idle tick (0.05 s) at most; spinning made thousands.
        assert decode.steps - before <= 15
        finish_load.set()
        tokens = [t for out in stream for t in out.outputs[0].token_ids]
        colocated = engine(tiny_model_dir, "c")
        colocated.add_request("w", PROMPT, params)
        assert tokens == list(run(colocated)["w"].outputs[0].token_ids)
    finally:
        finish_load.set()
        loop.stop()
        decode.connector.close()


def test_a_decode_does_not_wait_for_the_producer_to_hear_of_its_load(tiny_model_dir, pd_pair):
    """A decode has its blocks as soon as they are read. Telling the producer (`on_loaded`:
    the Release call, which a prefill instance answers between its own steps) comes after,
    and a release that hangs holds nothing up."""
    prefill = pd_pair[0]
    releasing, let_go, returned = threading.Event(), threading.Event(), threading.Event()

    def hanging_release(handle):
        releasing.set()
        let_go.wait(20)
        returned.set()

    decode = engine(tiny_model_dir, "dr", TransportConnector(make_transport("shm", "dr"),
                                                             hanging_release))
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        _, d_out, _ = prefill_then_decode(prefill, decode, "h", params)
        assert len(d_out.outputs[0].token_ids) == 4
        assert releasing.is_set() and not returned.is_set()  # done while the release hangs
    finally:
        let_go.set()
        decode.connector.close()


def colocated_outputs(model_dir, requests):
    probe = engine(model_dir, "probe")
    for rid, ids, params in requests:
        probe.add_request(rid, {"prompt_token_ids": ids}, params)
    return {rid: out.outputs[0].token_ids for rid, out in run(probe).items()}, probe


def hand_over(prefill, decode, rid, ids, params):
    """Prefill `ids` on `prefill` and add the request to `decode` with the KV handle."""
    first = params.clone()
    first.max_tokens = 1
    prefill.add_request(rid, {"prompt_token_ids": ids}, first,
                        kv_transfer_params={"do_remote_decode": True})
    p_out = run(prefill)[rid]
    decode.add_request(rid, {"prompt_token_ids": ids}, params,
                       kv_transfer_params={"remote_handle": p_out.kv_transfer_params["handle"],
                                           "output_token_ids": p_out.outputs[0].token_ids})


def test_a_full_decode_pool_held_by_arrived_kv_never_stalls(tiny_model_dir, pd_pair):
    """A decode engine's pool is nearly all held by a request whose KV arrived, and a local
    request preempted for room sits ahead of it in the queue: the engine still finishes both,
    each with the colocated output (the arrived request runs first and gives the pool back)."""
    prefill, _, _ = pd_pair
    local = ("local", list(range(300, 331)),
             SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    remote = ("remote", list(range(400, 528)),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    want, probe = colocated_outputs(tiny_model_dir, [local, remote])
    bytes_per_block = (4 << 20) // probe.block_pool.num_blocks
    d_conn = TransportConnector(make_transport("shm", "d-small"))
    decode = engine(tiny_model_dir, "d-small", d_conn,
                    kv_cache_memory_bytes=10 * bytes_per_block)  # 10 blocks of 16 tokens
    assert decode.block_pool.num_blocks == 10
    try:
        decode.add_request(local[0], {"prompt_token_ids": local[1]}, local[2])
        decode.step()  # its prompt holds 2 blocks
        hand_over(prefill, decode, *remote)  # 8 more: the pool is full, "local" must wait
        outs = run(decode)
        assert {rid: o.outputs[0].token_ids for rid, o in outs.items()} == want
        assert decode.block_pool.num_free_blocks == 10
    finally:
        d_conn.close()


def test_arrived_kv_that_fills_the_pool_is_recomputed_rather_than_stall(tiny_model_dir, pd_pair):
    """Two requests whose KV arrived hold the whole pool and each needs one block more to
    go on: the later one gives its blocks back and computes its prompt when room returns."""
    prefill, _, _ = pd_pair
    requests = [(f"r{k}", list(range(500 + 100 * k, 580 + 100 * k)),
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for k in (0, 1)]
    want, probe = colocated_outputs(tiny_model_dir, requests)
    bytes_per_block = (4 << 20) // probe.block_pool.num_blocks
    d_conn = TransportConnector(make_transport("shm", "d-full"))
    decode = engine(tiny_model_dir, "d-full", d_conn, kv_cache_memory_bytes=10 * bytes_per_block)
    try:
        for request in requests:  # 80 prompt tokens: 5 blocks each, then a 6th to decode
            hand_over(prefill, decode, *request)
        outs = run(decode)
        assert {rid: o.outputs[0].token_ids for rid, o in outs.items()} == want
        assert decode.block_pool.num_free_blocks == 10
    finally:
        d_conn.close()

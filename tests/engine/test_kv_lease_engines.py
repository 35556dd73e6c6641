"""KV leases between a prefill and a decode engine, in one process over real transports: a
handle reads only what its lease was granted for, while the lease lives, by one reader."""

import pytest
import test_disaggregated_engines as base
from test_disaggregated_engines import PROMPT, colocated_tokens, engine, remote_prefill, run

from pdserve import SamplingParams
from pdserve.kv_transfer import make_transport
from pdserve.kv_transfer.connector import TransportConnector

pd_pair = base.pd_pair  # the fixture: a prefill and a decode engine over shm


def test_a_handle_used_again_after_its_lease_ended_reads_nothing(tiny_model_dir):
    """A second decode engine given a handle the first one read and released (a router
    retrying on another decode instance): its blocks may hold another prompt's KV by then, so
    the read is refused and the prompt computed again, with colocated output."""
    per_block = (4 << 20) // engine(tiny_model_dir, "probe").block_pool.num_blocks
    prefill = engine(tiny_model_dir, "p", TransportConnector(make_transport("shm", "p")),
                     kv_cache_memory_bytes=12 * per_block, kv_lease_s=30)
    readers = [engine(tiny_model_dir, name, TransportConnector(make_transport("shm", name)))
               for name in ("d1", "d2")]
    a, b = list(range(1000, 1080)), list(range(2000, 2160))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = colocated_tokens(tiny_model_dir, a, params)
    try:
        kv = remote_prefill(prefill, "a", a, params)
        readers[0].add_request("a", {"prompt_token_ids": a}, params, kv_transfer_params=kv)
        assert run(readers[0])["a"].outputs[0].token_ids == want
        assert prefill.release_kv("a")  # the first reader is done with it
        remote_prefill(prefill, "b", b, params)  # reuses a's blocks
        readers[1].add_request("a", {"prompt_token_ids": a}, params, kv_transfer_params=kv)
        assert run(readers[1])["a"].outputs[0].token_ids == want
        [load] = readers[1].scheduler.load_results
        assert not load.ok and "lease" in load.error
    finally:
        for e in (prefill, *readers):
            e.connector.close()


def test_a_handle_has_one_reader(pd_pair):
    """n > 1 with a handle would read one lease once per sample (the first release ends it)."""
    prefill, decode, _ = pd_pair
    first = SamplingParams(temperature=0, max_tokens=1)
    prefill.add_request("n", PROMPT, first, kv_transfer_params={"do_remote_decode": True})
    handle = run(prefill)["n"].kv_transfer_params["handle"]
    with pytest.raises(ValueError, match="^n: "):
        decode.add_request("n", PROMPT, SamplingParams(n=2, temperature=0.8, seed=1),
                           kv_transfer_params={"remote_handle": handle})
    assert prefill.release_kv("n")


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("forgery", ["other blocks", "other hashes"])
def test_a_handle_changed_from_what_was_granted_reads_nothing(tiny_model_dir, kind, forgery):
    """A cluster-secret holder calling Decode directly with a handle whose blocks or hashes
    are not those the lease was granted for (another prompt's KV under this prompt's hashes
    would poison the decode side's prefix cache): the read is refused, the prompt computed
    again, and later requests for it get colocated output."""
    prefill = engine(tiny_model_dir, "p", TransportConnector(make_transport(kind, "p")),
                     kv_lease_s=30)
    decode = engine(tiny_model_dir, "d", TransportConnector(make_transport(kind, "d")))
    a, b = list(range(1000, 1080)), list(range(3000, 3080))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = colocated_tokens(tiny_model_dir, b, params)
    try:
        kv_a, kv_b = (remote_prefill(prefill, rid, ids, params) for rid, ids in (("a", a),
                                                                             ("b", b)))
        handle_a, handle_b = kv_a["remote_handle"], kv_b["remote_handle"]
        forged = ({**handle_b, "block_ids": handle_a["block_ids"]}
                  if forgery == "other blocks" else
                  {**handle_a, "block_hashes": handle_b["block_hashes"]})
        decode.add_request("b", {"prompt_token_ids": b}, params,
                           kv_transfer_params={**kv_b, "remote_handle": forged})
        assert run(decode)["b"].outputs[0].token_ids == want
        [load] = decode.scheduler.load_results
        assert not load.ok and "lease" in load.error
        decode.add_request("again", {"prompt_token_ids": b}, params)  # from the prefix cache
        assert run(decode)["again"].outputs[0].token_ids == want
    finally:
        prefill.connector.close()
        decode.connector.close()


def test_a_prefill_finding_every_lease_slot_taken_gives_no_handle_and_goes_on(
        tiny_model_dir, monkeypatch):
    """shm publishes leases in a fixed number of slots: past them a prefill hands over no
    handle (the decode side computes the prompt) instead of failing the engine's step."""
    from pdserve.kv_transfer import shm_transport

    monkeypatch.setattr(shm_transport, "LEASE_SLOTS", 2)
    prefill = engine(tiny_model_dir, "p", TransportConnector(make_transport("shm", "p")),
                     kv_lease_s=30)
    first = SamplingParams(temperature=0, max_tokens=1)
    try:
        def handle(rid, start):
            prefill.add_request(rid, {"prompt_token_ids": list(range(start, start + 40))},
                                first, kv_transfer_params={"do_remote_decode": True})
            return run(prefill)[rid].kv_transfer_params.get("handle")

        assert handle("a", 1000) and handle("b", 2000)
        free = prefill.num_free_blocks
        assert handle("c", 3000) is None
        assert prefill.num_free_blocks == free  # c's blocks were not kept for anyone
        assert prefill.release_kv("a")
        assert handle("d", 4000)  # a slot came back with a's release
    finally:
        prefill.connector.close()

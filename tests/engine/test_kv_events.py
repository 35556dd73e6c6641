"""Engine prefix-cache events reach a prefix index through the publisher, with resync."""

import pytest

from pdserve import EngineArgs, LLMEngine, SamplingParams
from pdserve.block_hash import hash_blocks
from pdserve.engine.engine_loop import EngineLoop
from pdserve.router.memory_index import MemoryPrefixIndex
from pdserve.services.kv_event_publisher import MAX_RETRY_S, KVEventPublisher


@pytest.fixture
def loop(tiny_model_dir):
    # 12 blocks: small enough that a few prompts evict earlier ones.
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=12 * 16 * 2 * 2 * 2 * 16 * 4),
        record_kv_events=True)
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def generate(loop, rid, ids):
    stream = loop.submit(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    for _ in stream:
        pass


def test_published_blocks_match_prompt_hashes_and_evictions_remove_them(loop):
    index = MemoryPrefixIndex(ttl_s=60)
    index.heartbeat("e1", {"role": "prefill"})
    publisher = KVEventPublisher(loop, index, "e1")
    ids = list(range(500, 550))  # 3 full blocks
    generate(loop, "a", ids)
    publisher.publish_once()
    assert index.match(hash_blocks(ids, 16)) == {"e1": 3}
    # Fill the 12-block cache with other prompts: the first one's blocks are evicted.
    for i in range(4):
        generate(loop, f"b{i}", list(range(1000 + 100 * i, 1000 + 100 * i + 50)))
    publisher.publish_once()
    assert index.match(hash_blocks(ids, 16)) == {"e1": 0}
    assert index.num_blocks("e1") == len(loop.kv_snapshot())


def test_lost_batch_triggers_resync(loop):
    index = MemoryPrefixIndex(ttl_s=60)
    index.heartbeat("e1", {"role": "prefill"})
    publisher = KVEventPublisher(loop, index, "e1")
    publisher.publish_once()  # seq 0
    ids = list(range(700, 740))
    generate(loop, "a", ids)
    publisher.sequencer.batch(loop.take_kv_events())  # a batch lost on the way
    generate(loop, "b", list(range(800, 840)))
    publisher.publish_once()  # gap: applied as a snapshot instead
    assert publisher.in_sync
    assert index.match(hash_blocks(ids, 16)) == {"e1": 2}
    assert index.match(hash_blocks(list(range(800, 840)), 16)) == {"e1": 2}


class RecordingSink:
    """The in-memory index, recording each batch; it refuses the batch numbered `refuse`."""

    def __init__(self, index, refuse=None):
        self.index, self.refuse, self.seqs, self.resyncs = index, refuse, [], []

    def apply(self, batch):
        self.seqs.append(batch.seq)
        return batch.seq != self.refuse and self.index.apply(batch)

    def resync(self, instance_id, block_hashes, seq, medium="gpu"):
        self.resyncs.append(seq)
        return self.index.resync(instance_id, block_hashes, seq, medium)


def test_events_beyond_one_batch_go_in_several_and_a_refused_one_resyncs(loop, monkeypatch):
    """With batches of at most two hashes, a 3-block prompt goes in two batches; when the
    first is refused, the snapshot stands for both and takes the last one's seq."""
    from pdserve.router import kv_events

    monkeypatch.setattr(kv_events, "MAX_BATCH_OPS", 2)
    index = MemoryPrefixIndex(ttl_s=60)
    index.heartbeat("e1", {"role": "prefill"})
    sink = RecordingSink(index)
    publisher = KVEventPublisher(loop, sink, "e1")
    ids = list(range(300, 350))  # 3 full blocks
    generate(loop, "a", ids)
    publisher.publish_once()
    assert sink.seqs == [0, 1] and sink.resyncs == [] and publisher.in_sync
    assert index.match(hash_blocks(ids, 16)) == {"e1": 3}
    sink.refuse = 2
    generate(loop, "b", list(range(400, 450)))
    publisher.publish_once()
    assert sink.seqs == [0, 1, 2] and sink.resyncs == [3] and publisher.in_sync
    assert index.match(hash_blocks(list(range(400, 450)), 16)) == {"e1": 3}
    generate(loop, "c", list(range(500, 520)))
    publisher.publish_once()  # the index follows on from the snapshot's seq
    assert sink.seqs[-1] == 4 and sink.resyncs == [3]


class AwaySink:
    """A sink that cannot take anything (the router is down), then comes back."""

    def __init__(self):
        self.back = False
        self.snapshots = 0

    def apply(self, batch):
        return self.back

    def resync(self, instance_id, block_hashes, seq, medium="gpu"):
        self.snapshots += 1
        return self.back


class RecordedWaits:
    """The publisher's stop event: records each wait, and stops it after `tries` of them."""

    def __init__(self, sink, tries):
        self.sink, self.tries, self.waits = sink, tries, []

    def wait(self, timeout):
        self.waits.append(timeout)
        if len(self.waits) == self.tries - 3:
            self.sink.back = True
        return len(self.waits) > self.tries


def test_an_unreachable_sink_is_retried_less_and_less_often(loop):
    """Each failed try takes a snapshot of the whole cache on the engine's thread."""
    sink = AwaySink()
    publisher = KVEventPublisher(loop, sink, "e1", interval_s=0.1)
    publisher._stop = RecordedWaits(sink, tries=12)
    publisher._run()
    waits = publisher._stop.waits
    assert waits[:6] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])
    assert max(waits) == MAX_RETRY_S
    assert waits[-1] == pytest.approx(0.1)  # in sync again: back to the interval
    assert sink.snapshots == 8  # one for each try while the sink was away


def test_an_idle_engine_resyncs_an_index_that_lost_its_state(loop):
    """A router (or Redis) restarted empty while the engine had nothing new to publish: the
    periodic empty batch is refused and the snapshot follows, without waiting for an event."""
    index = MemoryPrefixIndex(ttl_s=60)
    index.heartbeat("e1", {"role": "prefill"})
    publisher = KVEventPublisher(loop, index, "e1", check_s=0.0)
    ids = list(range(900, 950))
    generate(loop, "a", ids)
    publisher.publish_once()
    fresh = MemoryPrefixIndex(ttl_s=60)  # the restarted router's index
    fresh.heartbeat("e1", {"role": "prefill"})
    publisher.sink = fresh
    publisher.publish_once()  # no new events
    assert fresh.match(hash_blocks(ids, 16)) == {"e1": 3}
    quiet = KVEventPublisher(loop, fresh, "e2", check_s=3600.0)
    quiet.in_sync = True
    quiet.publish_once()  # the first check
    quiet.publish_once()  # idle and in sync, the next check not due: nothing sent
    assert quiet.sequencer.batch([]).seq == 1

import pytest

from pdserve.engine.block_pool import BlockPool, BlockRemoved, BlockStored


def test_allocate_release_and_lru_eviction_order():
    pool = BlockPool(4, record_events=True)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    pool.cache(a, [11, 12], None, 16)
    pool.release(list(reversed(a)))  # tail first
    pool.release(b)
    assert pool.num_free_blocks == 4
    # Least recently freed goes first: a[1] (hash 12) then a[0] (hash 11), then b.
    first = pool.allocate(1)
    assert first == [a[1]]
    assert pool.lookup([11, 12]) == [a[0]]  # 12 evicted, 11 still cached
    events = pool.take_events()
    assert events == [BlockStored((11, 12), None, 32), BlockRemoved((12,))]


def test_touch_cached_free_block_takes_it_off_free_list():
    pool = BlockPool(3)
    [blk] = pool.allocate(1)
    pool.cache([blk], [99], None, 16)
    pool.release([blk])
    assert pool.num_free_blocks == 3
    hits = pool.lookup([99, 100])
    assert hits == [blk]
    assert pool.num_evictable(hits) == 1
    pool.touch(hits)
    assert pool.num_free_blocks == 2
    assert pool.ref_counts[blk] == 1
    pool.release(hits)
    assert pool.num_free_blocks == 3


def test_errors_and_duplicate_hashes():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    x, y = pool.allocate(2)
    pool.cache([x], [5], None, 16)
    pool.cache([y], [5], None, 16)  # same content computed twice: map keeps the first
    assert pool.lookup([5]) == [x]
    pool.release([x, y])
    with pytest.raises(RuntimeError):
        pool.release([x])
    assert pool.reset_prefix_cache()
    assert pool.lookup([5]) == []

"""Validate (remote, local) block-id pairs and coalesce them into runs of consecutive blocks.

A run (remote_start, local_start, count) means remote blocks remote_start..+count go to local
blocks local_start..+count. Within one (layer, k/v) plane a run is one contiguous byte range on
both sides, so backends copy/send/read one range per (plane, run) instead of one per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdserve.kv_transfer.errors import KVTransferError


class BlockRun(NamedTuple):
    remote_start: int
    local_start: int
    count: int


def coalesce_runs(remote_ids: Sequence[int], local_ids: Sequence[int],
                  remote_num_blocks: int, local_num_blocks: int) -> list[BlockRun]:
    """Runs covering the pairs in order. Raises KVTransferError on bad ids."""
    try:
        remote = [int(b) for b in remote_ids]
        local = [int(b) for b in local_ids]
    except (TypeError, ValueError) as e:
        raise KVTransferError(f"block ids must be integers: {e}") from e
    if len(remote) != len(local):
        raise KVTransferError(f"got {len(remote)} remote block ids but {len(local)} local block ids")
    check_block_ids(remote, remote_num_blocks, "remote")
    check_block_ids(local, local_num_blocks, "local")
    if len(set(local)) != len(local):
        raise KVTransferError("local block ids contain duplicates")
    runs: list[BlockRun] = []
    for r, loc in zip(remote, local):
        if runs:
            last = runs[-1]
            if r == last.remote_start + last.count and loc == last.local_start + last.count:
                runs[-1] = last._replace(count=last.count + 1)
                continue
        runs.append(BlockRun(r, loc, 1))
    return runs


def remote_runs(remote_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) runs of consecutive ids, in order (the producer's view of a request)."""
    runs: list[tuple[int, int]] = []
    for b in remote_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def check_block_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Raise KVTransferError if any id is outside [0, num_blocks)."""
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise KVTransferError(f"{side} block ids out of range [0, {num_blocks}): {bad[:8]}"
                              f"{' ...' if len(bad) > 8 else ''}")

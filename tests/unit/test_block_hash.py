import subprocess
import sys

from pdserve.block_hash import ROOT_HASH, extend_block_hashes, hash_block, hash_blocks


def test_chained_and_only_full_blocks():
    tokens = list(range(40))
    hashes = hash_blocks(tokens, 16)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # Same block contents after a different prefix hash differently.
    assert hash_blocks(tokens[16:32], 16) != [hashes[1]]


def test_extend_matches_full_recompute():
    tokens = list(range(100, 170))
    hashes: list[int] = []
    for end in range(0, len(tokens) + 1, 5):
        extend_block_hashes(hashes, tokens[:end], 16)
    assert hashes == hash_blocks(tokens, 16)


def test_same_in_another_process_with_another_hash_seed():
    code = "from pdserve.block_hash import hash_blocks; print(hash_blocks(list(range(64)), 16))"
    env = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, **env}, check=True).stdout
    assert out.strip() == str(hash_blocks(list(range(64)), 16))
    assert all(0 <= h < 2**63 for h in hash_blocks(list(range(64)), 16))

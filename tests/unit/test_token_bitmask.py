"""Applying a grammar's token bitmask (kernels/token_bitmask.py): the logits xgrammar's own
`apply_token_bitmask_inplace` gives, bit for bit, for words that are 0, all ones or mixed, a
vocabulary that ends inside a word, a bitmask wider than the logits and some rows only."""

import pytest
import torch
import xgrammar as xgr

from pdserve.kernels.token_bitmask import apply_token_bitmask


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """(rows, ceil(vocab / 32)) int32 words, each 0, all ones or random, in equal parts."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=g,
                          dtype=torch.int64).to(torch.int32)
    kind = torch.randint(0, 3, words.shape, generator=g)
    return torch.where(kind == 0, 0, torch.where(kind == 1, -1, words)).to(torch.int32)


@pytest.mark.parametrize("vocab,width", [(49152, 49152), (1000, 1000), (1000, 1024),
                                         (37, 64), (5, 5)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_same_logits_as_xgrammar(vocab, width, rows):
    """width: the logits' columns (a padded vocabulary is wider than the grammar's; the bits
    past `vocab` in the last word then apply, as xgrammar applies them)."""
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(vocab))
    bitmask = random_bitmask(4, vocab, seed=width + len(rows))
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, want)
    untouched = [i for i in range(4) if i not in rows]
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.isinf(got[rows]).any()  # something was forbidden


def test_nothing_forbidden_and_everything_forbidden():
    logits = torch.randn(2, 96)
    kept = logits.clone()
    apply_token_bitmask(kept, torch.full((2, 3), -1, dtype=torch.int32), [0, 1])
    assert torch.equal(kept, logits)
    apply_token_bitmask(kept, torch.zeros(2, 3, dtype=torch.int32), [1])
    assert torch.equal(kept[0], logits[0]) and torch.isneginf(kept[1]).all()

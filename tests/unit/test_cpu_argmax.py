"""The native argmax (kernels/csrc/argmax.c) gives torch.argmax's indices: the first of tied
maxima, the first NaN when a row has one, over rows with a stride, tails after the last
16-value block, rows shorter than a block, and a vocabulary-sized batch run on threads."""

import pytest
import torch

from pdserve.kernels import native
from pdserve.kernels.cpu_argmax import argmax_rows

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="no C compiler: the native kernels are not built")

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("row", [
    [1.0, NAN, 5.0], [5.0, NAN], [3.0, 3.0, 1.0], [-INF] * 20, [0.0, -0.0, 0.0],
    [1.0] * 17 + [NAN], [2.0] * 16 + [3.0] * 17, [1.0] * 5 + [7.0] + [1.0] * 20 + [7.0],
    [NAN] * 3, [-INF] * 3 + [-5.0], [4.0] * 33, [INF, 1.0, INF], [-1.0] * 16 + [-INF],
    [0.5] * 31 + [NAN] + [9.0]])
def test_edge_rows_match_torch(row):
    x = torch.tensor([row])
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_ties_in_every_lane_and_tail_match_torch():
    """Values from {0, 1, 2, 3}: ties everywhere, in the lanes of a block and across blocks."""
    gen = torch.Generator().manual_seed(0)
    for n in [*range(1, 70), 255, 256, 257]:
        wide = torch.randint(0, 4, (5, n + 3), generator=gen).float()
        x = wide[:, 1:n + 1]  # rows with a stride
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), n


def test_a_steps_logits_match_torch():
    """64 rows of a 49,152-token vocabulary in a wider buffer (the model's padded rows): the
    rows are shared among threads."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49160, generator=gen)[:, :49152]
    logits[3, 40000] = logits[3, 7] = 50.0  # a tie between blocks far apart
    logits[9, 123] = NAN
    got = argmax_rows(logits)
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1))
    assert got[3] == 7 and got[9] == 123


def test_what_the_kernel_does_not_serve_takes_torchs_path():
    x = torch.randn(4, 100, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    columns = torch.randn(100, 4).t()  # rows not contiguous
    assert torch.equal(argmax_rows(columns), columns.argmax(dim=-1))

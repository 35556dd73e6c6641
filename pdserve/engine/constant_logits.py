"""A request's logit adjustments that never change, as tensors built once instead of on every
step: `allowed_token_ids` as a mask and `logit_bias` as a dense row. A request allowing or
biasing the whole vocabulary would otherwise rebuild lists and tensors of every token for
each of its rows on each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ConstantLogits:
    """For a vocabulary of V tokens on one device; None where the request sets nothing."""

    forbidden: torch.Tensor | None  # (V,) bool: True for tokens outside allowed_token_ids
    bias: torch.Tensor | None  # (V,) float32: logit_bias, 0 for the tokens it leaves alone

    @classmethod
    def build(cls, params: SamplingParams, vocab: int, device: torch.device) -> ConstantLogits:
        forbidden = None
        if params.allowed_token_ids is not None:
            forbidden = torch.ones(vocab, dtype=torch.bool, device=device)
            forbidden[_in_vocab(params.allowed_token_ids, vocab, device)] = False
        bias = None
        if params.logit_bias:
            ids = _in_vocab(params.logit_bias, vocab, device)
            values = torch.tensor([params.logit_bias[t] for t in ids.tolist()],
                                  dtype=torch.float32, device=device)
            bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            bias[ids] = values
        return cls(forbidden, bias)


def _in_vocab(token_ids, vocab: int, device: torch.device) -> torch.Tensor:
    """The ids below `vocab` (others cannot be sampled), in order: (k,) long."""
    return torch.tensor([t for t in token_ids if 0 <= t < vocab], dtype=torch.long,
                        device=device)

"""Independent references computed with Hugging Face transformers."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly n greedy tokens from transformers' generate."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference logits at every position: (len(token_ids), vocab)."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)

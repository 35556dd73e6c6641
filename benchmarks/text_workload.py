"""A fixed pseudo-English text corpus and the mixed offline workload drawn from it.

Shared by `offline_throughput.py` (pdserve against transformers) and `offline_worker.py`
(pdserve against vLLM's CPU build, which runs it in vLLM's own venv): plain Python, no torch
and no pdserve, so both systems tokenize the same text into the same requests.
"""

from __future__ import annotations

import random

_WORDS_SEED_TEXT = (
    "the of and to in a is that for it as was with be by on not he i this are or his from at "
    "which but have an they you were her she there had been one all we their has would when "
    "what more if will so no can who out said time about up into some could them other than "
    "then now only its over also new after first two may any these like people years most "
    "made such where way many before must through back well much should because each just "
    "those how too work between own under little very life world still year being long day "
    "great same right down house another while three state never city part old during "
    "against place without number school around system however country water small found "
    "large again high government public local family second general every left power night "
    "hand point study child morning light river history question mountain village market "
    "language music science garden winter summer window story problem energy machine paper"
).split()


def make_corpus(tokenizer, seed: int, num_tokens: int) -> list[int]:
    """A fixed pseudo-English text (sentences of common words), tokenized once."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(_WORDS_SEED_TEXT))]  # Zipf-like
    sentences: list[str] = []
    total = 0
    while total < num_tokens * 1.1:
        n = rng.randint(6, 20)
        words = rng.choices(_WORDS_SEED_TEXT, weights, k=n)
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", ",", "?", ";"])
        sentences.append(sentence)
        total += n + 1
    ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise RuntimeError("corpus too short")
    return ids


def mixed_workload(corpus: list[int], num_requests: int, prompt_lens: tuple[int, int],
                   output_lens: tuple[int, int], rng: random.Random):
    """(prompt token ids, output length) per request; prompts start at distinct offsets of
    the corpus, their lengths uniform in `prompt_lens`, outputs in `output_lens` (inclusive)."""
    reqs = []
    starts = rng.sample(range(len(corpus) - prompt_lens[1]), num_requests)
    for start in starts:
        p = rng.randint(*prompt_lens)
        o = rng.randint(*output_lens)
        reqs.append((corpus[start:start + p], o))
    return reqs


def text_workload(tokenizer, seed: int = 0, num_requests: int = 64,
                  prompt_lens: tuple[int, int] = (32, 512),
                  output_lens: tuple[int, int] = (16, 256)):
    """offline_throughput.py's mixed workload: its corpus and requests for these arguments."""
    rng = random.Random(seed)
    corpus = make_corpus(tokenizer, seed, num_requests * prompt_lens[1] // 4
                         + 2 * prompt_lens[1])
    return corpus, mixed_workload(corpus, num_requests, prompt_lens, output_lens, rng)

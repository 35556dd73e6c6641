"""The bundled GGUF's tokenizer, converted once and then read from pdserve's cache: the cached
copy gives what transformers' conversion gives; a changed file gets a new key; a cached copy
that does not load is converted again and replaced; a cache that cannot be written only costs
the conversion."""

from __future__ import annotations

import logging
import os

from pdserve.cache_dir import CACHE_ENV
from pdserve.models.gguf_tokenizer import cache_key, cached_folder, load_gguf_tokenizer
from pdserve.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model

TEXTS = ["Hello world", "  leading spaces\n\ttabs and\r\nlines", "émoji 😀🎉 done",
         "<|im_start|>user\nhi<|im_end|>", "a" * 300, "日本語のテキスト", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def assert_same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.name_or_path == theirs.name_or_path
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_the_cached_tokenizer_is_the_converted_one(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    resolved = resolve_model(DEFAULT_MODEL)
    folder = cached_folder(resolved.path)
    assert not folder.exists()
    converted = load_tokenizer(resolved)  # transformers' conversion, saved
    assert (folder / "tokenizer.json").is_file()
    assert_same(load_tokenizer(resolved), converted)
    # the next load reads the cached files: what is written there is what it gives
    template = folder / "chat_template.jinja"
    template.write_text("{{ 'from the cache' }}")
    assert load_tokenizer(resolved).apply_chat_template(CHAT, tokenize=False) == "from the cache"
    # a copy that does not load: converted again and replaced (the conversion is the one
    # checked above, handed back as is: one conversion in this test, ~7 s)
    (folder / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pdserve.models.gguf_tokenizer"):
        assert load_gguf_tokenizer(resolved.path, lambda: converted) is converted
    assert "does not load" in caplog.text
    assert_same(load_tokenizer(resolved), converted)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written copy
    # a cache that cannot be written (under a file: mkdir fails) only costs the conversion
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    assert load_gguf_tokenizer(resolved.path, lambda: converted) is converted


def test_a_changed_or_moved_file_gets_another_key(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for path in (first, second):
        path.write_bytes(b"GGUF" + bytes(60))
        os.utime(path, ns=(10**18, 10**18))
    key = cache_key(first)
    assert cache_key(first) == key
    assert cache_key(second) != key  # same bytes and time, another file
    os.utime(first, ns=(10**18, 10**18 + 1))
    assert cache_key(first) != key
    first.write_bytes(b"GGUF" + bytes(61))
    os.utime(first, ns=(10**18, 10**18))
    assert cache_key(first) != key

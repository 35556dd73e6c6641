"""vLLM's cache_salt isolates prefix-cache entries, and vLLM's arguments for what pdserve does
not do (LoRA, multimodal inputs, tokenizer options) are accepted when empty and refused by
name otherwise, never ignored."""

import pytest

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
IDS = list(range(2000, 2070))  # 4 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)


def run(llm, **salt):
    [out] = llm.generate({"prompt_token_ids": IDS, **salt}, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_a_cache_salt_matches_only_prompts_with_the_same_salt(llm):
    assert llm.reset_prefix_cache()
    want, cached = run(llm)
    assert cached == 0
    assert run(llm) == (want, 64)  # unsalted: the cache serves the 4 full blocks
    assert run(llm, cache_salt="tenant-a") == (want, 0)
    assert run(llm, cache_salt="tenant-a") == (want, 64)
    assert run(llm, cache_salt="tenant-b") == (want, 0)
    assert run(llm, cache_salt="tenant-a") == (want, 64)
    assert run(llm) == (want, 64)


@pytest.mark.parametrize("prompt, field", [
    ({"prompt_token_ids": IDS, "cache_salt": ""}, "cache_salt"),
    ({"prompt_token_ids": IDS, "cache_salt": 7}, "cache_salt"),
    ({"prompt": "Hi", "cache_salt": "s" * 257}, "cache_salt"),
    ({"prompt": "Describe the image", "multi_modal_data": {"image": b"..."}},
     "prompt.multi_modal_data"),
    ({"prompt_embeds": [[0.0]], "prompt": "x"}, "prompt.prompt_embeds"),
])
def test_bad_salts_and_prompt_fields_pdserve_does_not_serve_are_refused(llm, prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_vllm_arguments_for_what_pdserve_does_not_do(llm):
    want = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    [out] = llm.generate("Hello", GREEDY, use_tqdm=False, lora_request=None,
                         tokenization_kwargs=None, mm_processor_kwargs={})
    assert out.outputs[0].token_ids == want
    for name in ("lora_request", "tokenization_kwargs", "mm_processor_kwargs"):
        with pytest.raises(ValueError, match=name):
            llm.generate("Hello", GREEDY, use_tqdm=False, **{name: {"x": 1}})
        with pytest.raises(ValueError, match=name):
            llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False,
                     **{name: {"x": 1}})
    with pytest.raises(ValueError, match="lora_request"):
        llm.enqueue("Hello", GREEDY, object())  # vLLM's third positional argument
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    chats = [llm.chat(messages, GREEDY, use_tqdm=False, chat_template_content_format=f)[0]
             for f in ("auto", "string", "openai")]
    assert len({tuple(c.outputs[0].token_ids) for c in chats}) == 1
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template_content_format="xml")
    # LLMEngine.add_request in vLLM's order: arrival_time, lora_request, tokenization_kwargs,
    # trace_headers, priority.
    engine = llm.llm_engine
    assert engine.add_request("pos", "Hello", GREEDY, None, None, None, None, 0) == "pos"
    with pytest.raises(ValueError, match="lora_request"):
        engine.add_request("lora", "Hello", GREEDY, None, object())
    while engine.has_unfinished_requests():
        engine.step()
    for flag in ("reset_running_requests", "reset_connector"):
        with pytest.raises(ValueError, match=flag):
            llm.reset_prefix_cache(**{flag: True})


def test_a_callable_use_tqdm_makes_the_progress_bar(llm):
    from tqdm import tqdm

    made = []

    def bar(**kwargs):
        made.append(kwargs)
        return tqdm(**{**kwargs, "disable": True})

    outs = llm.generate(["Hello", "Hi"], GREEDY, use_tqdm=bar)
    assert len(outs) == 2 and made and made[0]["total"] == 2


def test_the_engine_seed_repeats_unseeded_sampling_run_to_run(tiny_model_dir):
    """LLM(seed=...) seeds the draws of requests without their own seed, as vLLM's does."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def sample(seed):
        llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=4 << 20, seed=seed)
        outs = llm.generate(["Hello", "The sky is"], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


def test_a_cache_smaller_than_max_model_len_says_so(tiny_model_dir, caplog):
    """vLLM refuses to start then; pdserve serves shorter sequences and says how long."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=16 * 8192)  # 16 blocks: 256 tokens
    assert llm.llm_engine.scheduler.max_model_len == 256
    assert any("max_model_len" in r.getMessage() and "256" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.generate({"prompt_token_ids": list(range(100, 400))}, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def recommending_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation config that recommends sampling settings."""
    from transformers import GenerationConfig

    path = tmp_path_factory.mktemp("recommending")
    for f in tiny_model_dir.iterdir():
        if f.name != "generation_config.json":
            (path / f.name).symlink_to(f)
    GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7,
                     do_sample=True).save_pretrained(path)
    return path


def test_default_sampling_params_come_from_the_generation_config(recommending_model):
    """As vLLM's generation_config='auto': the model's settings are the defaults; 'vllm'
    ignores them; override_generation_config sets fields on top; a bad one names itself."""
    llm = LLM(str(recommending_model), kv_cache_memory_bytes=4 << 20)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (0.6, 0.9, 20, 7)
    [out] = llm.generate({"prompt_token_ids": IDS}, use_tqdm=False)
    assert 0 < len(out.outputs[0].token_ids) <= 7
    plain = LLM(str(recommending_model), kv_cache_memory_bytes=4 << 20,
                generation_config="vllm", override_generation_config={"temperature": 0.3})
    params = plain.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (0.3, 1.0, 0, 16)
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(recommending_model), kv_cache_memory_bytes=4 << 20,
            override_generation_config={"top_p": 7.0})
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(recommending_model), kv_cache_memory_bytes=4 << 20,
            generation_config=str(recommending_model / "missing"))


def test_which_generation_settings_cap_a_served_max_tokens(recommending_model, tmp_path):
    """As vLLM's server: the model's own max_new_tokens fills an unset max_tokens only; an
    override's, or that of a generation config named by path, caps every request."""
    from pdserve.engine.generation_defaults import max_tokens_cap, sampling_defaults
    from pdserve.models.loader import resolve_model

    model = resolve_model(str(recommending_model))
    own = sampling_defaults(model)
    assert dict(own)["max_tokens"] == 7 and max_tokens_cap(own) is None
    over = {"max_new_tokens": 3}
    assert max_tokens_cap(sampling_defaults(model, "auto", over), "auto", over) == 3
    assert max_tokens_cap(sampling_defaults(model, "vllm", over), "vllm", over) == 3
    named = sampling_defaults(model, str(recommending_model))
    assert max_tokens_cap(named, str(recommending_model)) == 7
    assert max_tokens_cap(sampling_defaults(model, "vllm"), "vllm") is None
    engine = LLM(str(recommending_model), kv_cache_memory_bytes=4 << 20,
                 override_generation_config=over).llm_engine
    assert engine.config.model.max_tokens_cap == 3


def test_without_generation_config_json_config_json_recommends(tiny_model_dir, tmp_path):
    """As vLLM: a model folder without generation_config.json takes the generation fields of
    its config.json; an unreadable one names the option."""
    import json

    for f in tiny_model_dir.iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "temperature": 0.4,
                                                      "max_new_tokens": 6}))
    params = LLM(str(tmp_path), kv_cache_memory_bytes=4 << 20).get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.4, 6)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text("{not json")
    from pdserve.engine.generation_defaults import sampling_defaults
    from pdserve.models.loader import ResolvedModel

    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(ResolvedModel(str(tmp_path), None, "tiny"), str(tmp_path))

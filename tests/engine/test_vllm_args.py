"""vLLM's LLM(...) arguments on the tiny model: honoured (tokenizer, chat_template,
max_logprobs, served_model_name, hf_overrides, priority), ignored with one log line, or
refused with a ValueError naming the argument."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from pdserve import LLM, EngineArgs, SamplingParams
from pdserve.beam_search import BeamSearchParams
from pdserve.engine import vllm_args
from pdserve.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model

KV = 4 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "hi"}]
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
            "{% if add_generation_prompt %}<<assistant|{% endif %}")
IGNORED = {"enforce_eager": True, "swap_space": 4, "cpu_offload_gb": 1,
           "trust_remote_code": True, "download_dir": "/tmp", "disable_custom_all_reduce": True,
           "max_seq_len_to_capture": 8192, "compilation_config": {"level": 3}}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def vllm_llm(tiny_model_dir, template_file):
    """An LLM built with every vLLM argument pdserve accepts."""
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV, seed=0, dtype="float32",
               tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
               chat_template=str(template_file), max_logprobs=3,
               served_model_name=["tiny-a", "tiny-b"], hf_overrides={}, quantization=None,
               tensor_parallel_size=1, pipeline_parallel_size=1, disable_log_stats=True,
               scheduling_policy="priority", **IGNORED)


def chat_text(llm, messages=MESSAGES, **kwargs) -> str:
    [out] = llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    return llm.get_tokenizer().decode(out.prompt_token_ids)


def test_chat_template_argument_is_honoured(vllm_llm):
    assert chat_text(vllm_llm) == "<<user|hi>><<assistant|"
    # a per-call template (a Jinja string here) wins, as in vLLM
    assert chat_text(vllm_llm, chat_template="{{ messages[0].content }}!") == "hi!"


def test_chat_template_forms(tiny_model_dir, template_file):
    def loaded(value):
        args = EngineArgs(model=str(tiny_model_dir), chat_template=value)
        return args.create_tokenizer_config().chat_template

    assert loaded(str(template_file)) == TEMPLATE == loaded(TEMPLATE)
    assert loaded(None) is None
    with pytest.raises(ValueError, match="^chat_template: .*no such file"):
        loaded("missing/chat.jinja")
    with pytest.raises(ValueError, match="^chat_template: not a valid Jinja"):
        loaded("{% for m in messages %}")


def test_max_logprobs_bounds_requests(vllm_llm, tiny_llm):
    [out] = vllm_llm.generate("hello", SamplingParams(max_tokens=2, logprobs=3,
                                                      prompt_logprobs=3), use_tqdm=False)
    assert all(len(pos) >= 3 for pos in out.outputs[0].logprobs)
    for kwargs, field in [({"logprobs": 4}, "logprobs"), ({"prompt_logprobs": 4},
                                                          "prompt_logprobs"),
                          ({"logprobs": -1}, "logprobs")]:
        with pytest.raises(ValueError, match=f"^{field}: .*max_logprobs=3"):
            vllm_llm.generate("hello", SamplingParams(**kwargs), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs=20"):  # vLLM's default
        tiny_llm.generate("hello", SamplingParams(logprobs=21), use_tqdm=False)
    assert vllm_llm.llm_engine.get_num_unfinished_requests() == 0


def test_served_model_name_and_ignored_args_are_accepted(vllm_llm):
    cfg = vllm_llm.llm_engine.config.model
    assert cfg.served_model_name == ("tiny-a", "tiny-b") and cfg.served_name == "tiny-a"
    [out] = vllm_llm.generate("hello", GREEDY, use_tqdm=False)  # still generates
    assert len(out.outputs[0].token_ids) == 2


def test_priority_takes_an_int(vllm_llm, tiny_llm):
    outs = vllm_llm.generate("hello", GREEDY, use_tqdm=False, priority=3)
    assert len(outs) == 1 and outs[0].finished
    outs = vllm_llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[2, 1])
    assert [o.prompt for o in outs] == ["a", "b"]
    assert len(vllm_llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=1)) == 2
    with pytest.raises(ValueError, match="^priority: 1 given for 2 prompts"):
        vllm_llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="^priority: must be an int"):
        vllm_llm.generate("a", GREEDY, use_tqdm=False, priority=[True])
    # the int reaches the engine: a non-zero priority needs the priority policy
    with pytest.raises(ValueError, match="^priority: only allowed with scheduling_policy"):
        tiny_llm.generate("a", GREEDY, use_tqdm=False, priority=1)
    assert len(tiny_llm.generate("a", GREEDY, use_tqdm=False, priority=0)) == 1


def test_arguments_of_the_wrong_kind_are_value_errors_naming_them(vllm_llm):
    for call, message in [
            (lambda: vllm_llm.generate("a", {"max_tokens": 2}), "^sampling_params: expected "
             "SamplingParams or a list of them, got dict"),
            (lambda: vllm_llm.generate(None), "^prompts: expected .* got NoneType"),
            (lambda: vllm_llm.generate(5, GREEDY), "^prompts: expected .* got int"),
            (lambda: vllm_llm.embed("a", GREEDY), "^pooling_params: expected PoolingParams"),
            (lambda: vllm_llm.beam_search("a", BeamSearchParams(beam_width=2, max_tokens=2)),
             "^beam_width: .* 4 logprobs .* max_logprobs=3")]:
        with pytest.raises(ValueError, match=message):
            call()
    assert vllm_llm.llm_engine.get_num_unfinished_requests() == 0
    outs = vllm_llm.generate((p for p in ["a", "b"]), iter([GREEDY, GREEDY]), use_tqdm=False)
    assert len(outs) == 2  # any iterable, as list() takes
    assert len(vllm_llm.embed(p for p in ["a", "b"])) == 2


def test_a_message_without_content_renders_as_empty_text(tiny_llm):
    """An assistant turn of tool calls has content None (OpenAI, vLLM): the model's template
    (which reads message['content'] as a string) gets ''."""
    messages = [*MESSAGES, {"role": "assistant", "content": None}, {"role": "user",
                                                                   "content": "more"}]
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nmore" in chat_text(
        tiny_llm, messages)


def test_tokenizer_argument_is_honoured(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    vocab = len(tok)
    tok.add_tokens(["<probe-token>"])
    tok.chat_template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")  # a tokenizer only: no config.json, no weights
    llm = LLM(str(tiny_model_dir), tokenizer=str(tmp_path / "tok"), kv_cache_memory_bytes=KV)
    assert llm.get_tokenizer().convert_tokens_to_ids("<probe-token>") == vocab
    assert chat_text(llm) == "hi|"  # the tokenizer directory's own chat template
    # the engine tokenizes with it too: the added token is past the model's vocabulary
    with pytest.raises(ValueError, match=f"^prompt_token_ids: token id {vocab} "):
        llm.generate("a <probe-token>", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="^tokenizer: .*does not exist"):
        EngineArgs(model=str(tiny_model_dir), tokenizer=str(tmp_path / "nope")
                   ).create_tokenizer_config()


def test_tokenizer_modes(tiny_model_dir):
    resolved = resolve_model(str(tiny_model_dir))
    fast = load_tokenizer(resolved, "auto")
    for mode in ("hf", "slow"):
        assert load_tokenizer(resolved, mode).encode("Hello world") == \
            fast.encode("Hello world")


def test_hf_overrides_reach_the_config(tiny_model_dir):
    def max_len(overrides):
        args = EngineArgs(model=str(tiny_model_dir), hf_overrides=overrides)
        return args.create_engine_config().model.max_model_len

    assert max_len(None) == 2048
    assert max_len({"max_position_embeddings": 256}) == 256

    def shrink(config):
        config.max_position_embeddings = 128
        return config
    assert max_len(shrink) == 128


def test_ignored_args_log_one_line_once(tiny_model_dir, caplog, monkeypatch):
    monkeypatch.setattr(vllm_args, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        for _ in range(2):
            EngineArgs(model=str(tiny_model_dir), disable_log_stats=True,
                       **IGNORED).create_engine_config()
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve"]
    assert len(lines) == len(IGNORED)
    for name in IGNORED:
        [line] = [m for m in lines if m.startswith(f"{name}=")]
        assert " is ignored: " in line and "\n" not in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        EngineArgs(model=str(tiny_model_dir)).create_engine_config()  # defaults: silent
    assert not [r for r in caplog.records if r.name == "pdserve"]


@pytest.mark.parametrize("kwargs, name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size"),
    ({"quantization": "awq"}, "quantization"),
    ({"quantization": "gguf"}, "quantization"),  # not a .gguf model
    ({"skip_tokenizer_init": True}, "skip_tokenizer_init"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode"),
    ({"max_logprobs": -2}, "max_logprobs"),
    ({"swap_space": -1}, "swap_space"),
    ({"cpu_offload_gb": -1}, "cpu_offload_gb"),
    ({"hf_overrides": 5}, "hf_overrides"),
    ({"served_model_name": []}, "served_model_name"),
    ({"chat_template": "missing.jinja"}, "chat_template"),
])
def test_unsupported_values_are_value_errors(tiny_model_dir, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        EngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()


def test_llm_refuses_unsupported_values_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match="^tensor_parallel_size: only 1"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2)


def test_gguf_quantization_is_accepted_for_a_gguf_model():
    config = EngineArgs(model=DEFAULT_MODEL, quantization="gguf").create_engine_config()
    assert config.model.resolved.gguf_file

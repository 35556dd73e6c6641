"""vLLM's LLM / LLMEngine extras: request ids, metrics, detokenize=False, prefix cache reset,
get_metrics, sleep / wake_up, enqueue / wait_for_completion, chat content parts."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.metrics_reader import Counter, Gauge

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "Once upon a time in a land far away there lived a dragon who loved books. " * 2


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)


def test_add_request_returns_request_id(llm):
    engine = llm.llm_engine
    assert engine.add_request("abc", "Hello", GREEDY) == "abc"
    while engine.has_unfinished_requests():
        engine.step()


def test_request_output_metrics_are_ordered_wall_clock(llm):
    import time

    before = time.time()
    [out] = llm.generate("Hello there", GREEDY, use_tqdm=False)
    m = out.metrics
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time <= time.time()
    assert m.time_in_queue >= 0


def test_metrics_unknown_until_reached(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params.output_kind = params.output_kind.CUMULATIVE
    engine.add_request("m", "Hi", params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[0].metrics.finished_time is None and not outs[0].finished
    assert outs[-1].finished and outs[-1].metrics.finished_time is not None


def test_detokenize_false_leaves_text_and_decoded_tokens_empty(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, detokenize=False)
    [out] = llm.generate("Hello there", params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == "" and len(completion.token_ids) == 4
    assert all(lp.decoded_token is None for d in completion.logprobs for lp in d.values())
    assert all(lp.decoded_token is None for d in out.prompt_logprobs[1:] for lp in d.values())
    # With detokenize (the default) they are filled.
    [out] = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=2,
                                                       logprobs=1), use_tqdm=False)
    assert all(isinstance(lp.decoded_token, str) for d in out.outputs[0].logprobs
               for lp in d.values())


def test_reset_prefix_cache(llm):
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    [cached] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert cached.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    [fresh] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == cached.outputs[0].token_ids
    llm.llm_engine.add_request("busy", "Hello", GREEDY)
    llm.llm_engine.step()
    assert llm.reset_prefix_cache() is False  # blocks in use: nothing done
    llm.llm_engine.abort_request("busy")


def test_get_metrics(llm):
    def by_name():
        return {m.name: m for m in llm.get_metrics()}

    before = by_name()
    [out] = llm.generate("Hello there", GREEDY, use_tqdm=False)
    after = by_name()
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens"):
        assert isinstance(after[name], Counter)
    assert after["vllm:generation_tokens"].value - before["vllm:generation_tokens"].value == 8
    assert (after["vllm:prompt_tokens"].value - before["vllm:prompt_tokens"].value
            == len(out.prompt_token_ids))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert isinstance(after[name], Gauge) and after[name].value == 0
    llm.llm_engine.add_request("w", "Hello", GREEDY)
    assert by_name()["vllm:num_requests_waiting"].value == 1
    llm.llm_engine.step()
    now = by_name()
    assert now["vllm:num_requests_running"].value == 1
    assert 0 < now["vllm:kv_cache_usage_perc"].value <= 1
    assert now["vllm:prompt_tokens"].labels["model_name"]
    llm.llm_engine.abort_request("w")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_greedy_output(llm, level):
    [before] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    llm.sleep(level=level)
    assert engine.runner.kv_cache is None and engine.kv_cache_bytes == 0
    assert (engine.model is None) == (level == 2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    llm.wake_up()
    [after] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert after.num_cached_tokens == 0  # the cache's contents were dropped
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_sleep_bad_level_and_wake_up_bad_tag(llm):
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["nope"])


def test_sleep_aborts_running_requests(llm):
    llm.llm_engine.add_request("s", "Hello", GREEDY)
    llm.sleep()
    llm.wake_up()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_blocks


def test_enqueue_then_wait_for_completion(llm):
    [expected_a, expected_b] = llm.generate(["Hello", "The sky is"], GREEDY, use_tqdm=False)
    ids = llm.enqueue(["Hello", "The sky is"], GREEDY)
    assert len(ids) == 2 and all(isinstance(i, str) for i in ids)
    assert llm.llm_engine.get_num_unfinished_requests() == 2  # queued, not run
    more = llm.enqueue("Hello", GREEDY)
    # generate() in between runs the queued requests too; their outputs are kept.
    llm.generate("Hi", GREEDY, use_tqdm=False)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids + more
    assert outputs[0].outputs[0].token_ids == expected_a.outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == expected_b.outputs[0].token_ids
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_chat_accepts_text_content_parts_and_priority(llm):
    plain = [{"role": "user", "content": "Hi!\nHow are you?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"},
                                          {"type": "text", "text": "How are you?"}]}]
    [a] = llm.chat(plain, GREEDY, use_tqdm=False)
    [b] = llm.chat(parts, GREEDY, use_tqdm=False, priority=0)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="priority"):  # forwarded: needs the priority policy
        llm.chat(parts, GREEDY, use_tqdm=False, priority=1)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]"):
        llm.chat(bad, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()

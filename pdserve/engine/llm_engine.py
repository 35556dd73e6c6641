"""LLMEngine: one model instance's engine, with vLLM's add_request / step / abort API.

A step reads like a sentence: schedule, execute, update; then outputs are made.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from typing import Any
from collections.abc import Iterable

import torch

from pdserve.block_hash import hash_blocks, root_hash
from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.host_memory import release_freed_memory
from pdserve.engine.input_processor import InputProcessor, prompt_cache_salt
from pdserve.engine.kv_budget import gib, num_kv_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.metrics_reader import Metric, engine_metrics
from pdserve.engine.model_runner import ModelRunner, allocate_kv_cache
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.pooling import make_pooling_request
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.vllm_args import refuse_unsupported
from pdserve.kv_transfer.connector import KVConnector
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.empty_init import skip_random_init
from pdserve.models.loader import load_state_dict, load_tokenizer
from pdserve.outputs import PoolingRequestOutput, RequestOutput
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_model(config: EngineConfig) -> LlamaForCausalLM:
    """Build the decoder and fill it with the checkpoint's weights."""
    arch, dtype = config.model.arch, config.model.dtype
    with torch.device(config.device.device), skip_random_init():  # every weight is loaded
        model = LlamaForCausalLM(arch).to(dtype)
    model.load_weights(load_state_dict(config.model.resolved, dtype))
    model.pack_for_cpu()  # oneDNN's weight layout too on CPU (float32); a no-op elsewhere
    return model.eval()


class LLMEngine:
    """Receives requests and generates text with continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig, record_kv_events: bool = False,
                 connector: KVConnector | None = None):
        self.config = config
        self.connector = connector or KVConnector()
        tok = config.model.tokenizer_config
        self.tokenizer = load_tokenizer(tok.source, tok.mode, tok.chat_template)
        # On CPU the cache's size does not depend on the weights, so a cache that cannot fit
        # fails before they load; on CUDA it is what the loaded weights leave.
        on_cpu = config.device.device == "cpu"
        self.num_blocks = num_kv_blocks(config) if on_cpu else 0
        start = time.perf_counter()
        logger.info("loading %s (%s)...", config.model.model, self._dtype_device())
        self.model = load_model(config)
        logger.info("loaded %s in %.1f s", config.model.model, time.perf_counter() - start)
        if not on_cpu:
            self.num_blocks = num_kv_blocks(config)
        self.block_pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching,
                                    record_kv_events)
        self.kv_manager = KVCacheManager(self.block_pool, config.cache.block_size,
                                         config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.model.max_model_len,
                                   config.model.arch.eos_token_ids, self.connector)
        if self.scheduler.max_model_len < config.model.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: a "
                           "sequence may have at most %d (give the cache more memory for more)",
                           self.scheduler.max_model_len, config.model.max_model_len,
                           self.scheduler.max_model_len)
        self.runner = ModelRunner(config, self.model, allocate_kv_cache(
            config, self.num_blocks, self.connector))
        self.input_processor = InputProcessor(config.model, self.tokenizer,
                                              self.scheduler.max_model_len,
                                              config.cache.block_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Prompt tokens computed so far (prefill, recomputation included); with
        # num_generation_tokens, servers log their rates (engine_loop's StatsLogger).
        self.num_prompt_tokens = 0
        logger.info("KV cache: %s", self.kv_cache_summary())

    def _dtype_device(self) -> str:
        return f"{str(self.config.model.dtype).removeprefix('torch.')}, " \
               f"{self.config.device.device}"

    @property
    def kv_cache_bytes(self) -> int:
        cache = self.runner.kv_cache
        return 0 if cache is None else cache.numel() * cache.element_size()

    def kv_cache_summary(self) -> str:
        """E.g. '5825 blocks of 16 tokens = 93200 tokens, 4.00 GiB'."""
        bs = self.config.cache.block_size
        return (f"{self.num_blocks} blocks of {bs} tokens = {self.num_blocks * bs} tokens, "
                f"{gib(self.kv_cache_bytes)}")

    def describe(self) -> str:
        """One line for a server's startup log: model, dtype, device and KV cache."""
        return (f"{self.config.model.served_name} ({self._dtype_device()}), KV cache "
                f"{self.kv_cache_summary()}")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), **kwargs)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict | None = None, trace_headers: Any = None,
                    priority: int = 0, kv_transfer_params: dict | None = None) -> str:
        """Queue a prompt (str, TextPrompt or TokensPrompt); returns `request_id` (as vLLM,
        whose argument order this keeps; `trace_headers` is accepted and unused). With
        PoolingParams it is an embedding request (its step output is a PoolingRequestOutput,
        see pooling.py). Raises ValueError on bad input."""
        refuse_unsupported(lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        self._check_awake()
        self._check_id_free(request_id)
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError("priority: only allowed with scheduling_policy='priority'")
        if isinstance(params, SamplingParams):
            params.verify_max_logprobs(self.config.model.max_logprobs,
                                       self.config.model.arch.vocab_size)
        text, ids = self.input_processor.tokenize_prompt(prompt)
        if isinstance(params, PoolingParams):
            if kv_transfer_params:
                raise ValueError("kv_transfer_params: not supported for embeddings")
            children = [make_pooling_request(self, request_id, ids, params, arrival_time,
                                             priority)]
        else:
            children = self.input_processor.make_requests(request_id, ids, params,
                                                          arrival_time, priority,
                                                          kv_transfer_params)
        root = root_hash(prompt_cache_salt(prompt))
        self._check_handle_hashes(children[0], root)
        for child in children:  # n > 1 names its sequences "{i}_{request_id}"
            self._check_id_free(child.request_id)
            child.hash_root = root
        if children[0].remote_kv is not None and self.connector.kind == "none":
            raise ValueError("handle: this engine has no KV connector to load it with")
        self.output_processor.add(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def _check_handle_hashes(self, request, root: int) -> None:
        """A remote KV handle's block hashes are the prompt's own (with its cache_salt): KV
        of another prompt would be used, and cached under this prompt's hashes."""
        handle = request.remote_kv
        if handle is None:
            return
        size = self.config.cache.block_size
        full = request.prompt_token_ids[:len(handle.block_hashes) * size]
        if list(handle.block_hashes) != hash_blocks(full, size, root):
            raise ValueError("handle.block_hashes: not the prompt's blocks (the KV of another "
                             "prompt, or of another cache_salt)")

    def _check_id_free(self, request_id: str) -> None:
        """Refuse an id that a request, one of its sequences or a prefill's KV lease holds."""
        holders = (self.output_processor.parents, self.output_processor.child_to_parent,
                   self.scheduler.requests, self.scheduler.kv.leases)
        if any(request_id in holder for holder in holders):
            raise ValueError(f"request_id: {request_id!r} is already in use")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(rid),
                                           RequestStatus.FINISHED_ABORTED)
            self.output_processor.remove(rid)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one iteration: schedule, execute the model, update requests, make outputs."""
        self._check_awake()
        sched = self.scheduler.schedule()
        if not sched.chunks and not sched.failed and self.scheduler.compiling:
            # Only requests whose grammar compiles: wait for one instead of spinning.
            self.input_processor.grammars.wait_for_any(self.scheduler.compiling, 0.05)
        self.num_prompt_tokens += sum(
            max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
            for c in sched.chunks)
        result = self.runner.execute(sched)
        touched = self.scheduler.update(sched, result)
        stopped = self.output_processor.process(touched, result)
        self.scheduler.finish_requests([r.request_id for r in stopped],
                                       RequestStatus.FINISHED_STOPPED)
        return self.output_processor.make_outputs(touched)

    @property
    def num_generation_tokens(self) -> int:
        """Output tokens generated so far: those the scheduler appended, less those dropped
        after a stop string completed inside kept drafts (output_processor.py)."""
        return self.scheduler.num_output_tokens - self.output_processor.num_dropped_tokens

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished prefill kept for a remote decode (see kv_lease_s)."""
        return self.scheduler.release_kv(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    # --- vLLM's maintenance API -----------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        return engine_metrics(self)

    @property
    def is_sleeping(self) -> bool:
        return self.model is None or self.runner.kv_cache is None

    def sleep(self, level: int = 1) -> None:
        """Abort every request and free the KV cache (level 1); level 2 frees the weights too
        (wake_up reloads them from the checkpoint)."""
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if type(self.connector) is not KVConnector:
            raise RuntimeError("sleep: not supported with a KV transfer connector")
        self.abort_request(list(self.output_processor.parents))
        if not self.block_pool.reset_prefix_cache():
            raise RuntimeError("sleep: KV blocks are still held (kv_lease_s leases)")
        self.runner.kv_cache = None
        if level == 2:
            self.model = self.runner.model = None
        gc.collect()
        release_freed_memory()
        if torch.cuda.is_available() and self.config.device.device != "cpu":
            torch.cuda.empty_cache()
        logger.info("engine asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what sleep freed: `tags` among "weights", "kv_cache" (default: both)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        for tag in tags:
            if tag not in ("weights", "kv_cache", "scheduling"):
                raise ValueError(f"tags: unknown tag {tag!r}")
        if "weights" in tags and self.model is None:
            self.model = self.runner.model = load_model(self.config)
        if "kv_cache" in tags and self.runner.kv_cache is None:
            self.runner.kv_cache = allocate_kv_cache(self.config, self.num_blocks,
                                                     self.connector)

    def _check_awake(self) -> None:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep (LLM.sleep); call wake_up() first")

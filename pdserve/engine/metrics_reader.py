"""A snapshot of an engine's metrics, shaped like vLLM's `vllm.v1.metrics.reader`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


@dataclass
class Metric:
    """A metric's name (vLLM's, e.g. "vllm:prompt_tokens") and labels."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    """A monotonically increasing count."""

    value: int = 0


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float = 0.0


def engine_metrics(engine: LLMEngine) -> list[Metric]:
    """Token counters, queue gauges and KV cache usage (0..1) of one engine; with
    speculative_config, vLLM's draft counters too."""
    labels = {"model_name": engine.config.model.served_name, "engine": "0"}
    sched = engine.scheduler

    def lb() -> dict[str, str]:
        return dict(labels)

    metrics = [
        Counter("vllm:prompt_tokens", lb(), engine.num_prompt_tokens),
        Counter("vllm:generation_tokens", lb(), engine.num_generation_tokens),
        Gauge("vllm:num_requests_running", lb(), float(sched.num_running)),
        Gauge("vllm:num_requests_waiting", lb(), float(sched.num_waiting)),
        Gauge("vllm:kv_cache_usage_perc", lb(), engine.block_pool.usage),
    ]
    if engine.config.scheduler.speculative is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", lb(), sched.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", lb(), sched.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", lb(), sched.num_accepted_tokens),
        ]
    return metrics

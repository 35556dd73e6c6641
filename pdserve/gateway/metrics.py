"""Prometheus metrics of the gateway, named as vLLM names its own with a `pdserve:` prefix.

Latencies and token counts are measured here, per backend request; load gauges and the
engines' cumulative counters (prefix cache, KV transfer) are read from the backend at each
scrape. Everything lives in the gateway's own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.gateway.backend import BackendStats, ServedBy

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "tool_calls"})


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("pdserve:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pdserve:inter_token_latency_seconds",
                             "Time between consecutive streamed outputs of a sequence.", m,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", m, buckets=E2E_BUCKETS,
                             registry=r).labels(model_name)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model_name)
        self._success = Counter("pdserve:request_success", "Requests finished, by reason.",
                                m + ["finished_reason"], registry=r)
        self._router = Counter("pdserve:router_decisions",
                               "Router placements, by outcome (from served_by).",
                               m + ["outcome"], registry=r)
        self._rejected = Counter("pdserve:http_requests_rejected",
                                 "Requests answered with an error status, by status.",
                                 m + ["status"], registry=r)
        self.backend = BackendCollector(model_name)
        r.register(self.backend)

    def finished(self, reason: str | None) -> None:
        # NOTE: a label value per reason an instance sends would let one grow /metrics forever.
        reason = reason if reason in FINISH_REASONS else "other" if reason else "unknown"
        self._success.labels(self.model_name, reason).inc()

    def routed(self, served_by: ServedBy) -> None:
        if not served_by.decode_instance and not served_by.prefill_instance:
            return
        if served_by.disaggregated:
            outcome = "disaggregated_retried" if served_by.prefill_attempts > 1 \
                else "disaggregated"
        else:
            outcome = "prefill_fallback" if served_by.prefill_attempts else "decode_only"
        self._router.labels(self.model_name, outcome).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def render(self, stats: BackendStats | None) -> bytes:
        self.backend.stats = stats
        return generate_latest(self.registry)


class BackendCollector:
    """Gauges and engine counters from the latest BackendStats (none when unreadable)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: BackendStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        gauges = [
            ("num_requests_running", "Requests in the engines' running batches.",
             s.running_requests),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting_requests),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
             s.kv_cache_usage),
            ("kv_cache_free_blocks", "KV cache blocks free (cached or empty).", s.free_blocks),
            ("kv_cache_total_blocks", "KV cache blocks in all.", s.total_blocks),
        ]
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        instances = GaugeMetricFamily("pdserve:instances", "Live engine instances, by role.",
                                      labels=["model_name", "role"])
        for role, count in sorted(s.instances.items()):
            instances.add_metric([self.model_name, role], count)
        yield instances
        counters = [
            ("prefix_cache_queries", "Blocks looked up in the prefix cache.", s.prefix_queries),
            ("prefix_cache_hits", "Blocks found in the prefix cache.", s.prefix_hits),
            ("kv_transfer_bytes", "KV bytes pulled from prefill instances.",
             s.kv_transfer_bytes),
            ("kv_transfer_seconds", "Seconds spent pulling KV from prefill instances.",
             s.kv_transfer_seconds),
            ("prefix_index_errors", "Prefix-index backend failures (routing fell back to load).",
             s.prefix_index_errors),
            ("spec_decode_num_drafts", "Drafts verified (speculative decoding).", s.spec_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens the model kept.",
             s.spec_accepted_tokens),
        ]
        for name, doc, value in counters:
            if value is not None:
                yield self._family(CounterMetricFamily, name, doc, value)

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(f"pdserve:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

"""Router scorers (one per file, llm-d style): each maps candidates to scores in [0, 1]."""

from pdserve.router.scorers.base import InstanceView, RoutingRequest, Scorer
from pdserve.router.scorers.disaggregation import should_disaggregate, uncached_tokens
from pdserve.router.scorers.kv_usage import KVUsageScorer
from pdserve.router.scorers.prefix_overlap import PrefixOverlapScorer
from pdserve.router.scorers.queue_depth import QueueScorer

__all__ = ["InstanceView", "KVUsageScorer", "PrefixOverlapScorer", "QueueScorer",
           "RoutingRequest", "Scorer", "should_disaggregate", "uncached_tokens"]

"""Where a request goes: a decode instance D, and whether (and which) prefill instance P first.

filters (live, role, connector) -> weighted scorers -> picker, llm-d style; the disaggregation
rule decides whether a prompt is worth a KV transfer. The prefix index plugs in through
`prefix_matches` (block hashes -> {instance id: leading blocks it holds}); until then it is
empty and only load counts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.block_hash import hash_blocks, root_hash
from pdserve.router.open_requests import OpenRequests
from pdserve.router.picker import PickerConfig, WeightedPicker
from pdserve.router.registry import Instance, Registry
from pdserve.router.scorers import RoutingRequest, should_disaggregate, uncached_tokens

PrefixMatches = Callable[[Sequence[int]], Mapping[str, int]]


def no_prefix_matches(block_hashes: Sequence[int]) -> Mapping[str, int]:
    return {}


@dataclass(frozen=True)
class RouterConfig:
    """How the router routes and how long it waits. Built once from the command line."""

    model: str = "SmolLM2-135M-Instruct"  # for the tokenizer (same as the instances')
    revision: str | None = None  # of `model`, a repo id in the local Hugging Face cache
    disagg_threshold: int = 64  # uncached prompt tokens from which a prompt goes through P
    # Requests a decode instance must already run for a prompt to go through P (0: any); below
    # it, D prefills the prompt beside its few decodes (scorers/disaggregation.py says why).
    disagg_min_running: int = 0
    prefill_attempts: int = 2  # prefill instances tried before prefilling on D
    decode_attempts: int = 2  # decode instances tried while none has sent anything
    embed_attempts: int = 2  # instances tried for an embedding
    # Times a request whose decode instance died mid-stream moves to another one, continuing
    # from the prompt plus the tokens the client has (n = 1 only).
    max_migrations: int = 2
    # A Prefill call that has not answered after this long, or a Decode stream that has sent
    # nothing for this long, has its instance probed (GetLoad, which never waits for a model
    # step): an answer means slow, not dead, and the wait goes on, up to the request's own
    # deadline; no answer means dead: try another instance (or migrate, router/stream_watch).
    prefill_timeout_s: float = 30.0
    request_timeout_s: float = 3600.0  # a whole request, when the client set no deadline
    control_timeout_s: float = 2.0  # Release / Abort / probe calls
    ttl_s: float = 3.0  # an instance not heard from for this long is not routed to
    poll_interval_s: float = 0.5  # GetLoad polls of static instances
    # The caps the HTTP gateway applies, checked before a request goes anywhere: context
    # length (0: the model's max_position_embeddings) and logprobs per position (-1: no cap).
    max_model_len: int = 0
    max_logprobs: int = 20
    # Generate and Embed calls run at once; more are refused with RESOURCE_EXHAUSTED, so the
    # instances' heartbeats always find a thread (services/call_slots.py).
    max_requests_in_flight: int = 1024
    # Instances the router tracks (its registry and its prefix index): heartbeats of one more
    # are refused with RESOURCE_EXHAUSTED, its KV events are not applied.
    max_instances: int = 1024
    # One INFO line per request's end (router/request_log.py), as the instances log theirs.
    log_requests: bool = True
    picker: PickerConfig = field(
        default_factory=lambda: PickerConfig(prefix_weight=2.0, queue_weight=1.0,
                                             kv_usage_weight=1.0))

    def __post_init__(self) -> None:
        if self.disagg_threshold < 0 or self.disagg_min_running < 0:
            raise ValueError(f"disagg_threshold and disagg_min_running must be >= 0, got "
                             f"{self.disagg_threshold} and {self.disagg_min_running}")
        if self.prefill_attempts < 0 or self.max_migrations < 0:
            raise ValueError("prefill_attempts and max_migrations must be >= 0")
        if self.decode_attempts < 1 or self.embed_attempts < 1:
            raise ValueError("decode_attempts and embed_attempts must be >= 1")
        if self.max_model_len < 0 or self.max_logprobs < -1:
            raise ValueError("max_model_len must be >= 0 and max_logprobs >= -1")
        if self.max_requests_in_flight < 1 or self.max_instances < 1:
            raise ValueError(f"max_requests_in_flight and max_instances must be >= 1, got "
                             f"{self.max_requests_in_flight} and {self.max_instances}")
        for name in ("prefill_timeout_s", "request_timeout_s", "control_timeout_s", "ttl_s",
                     "poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class NoDecodeInstance(RuntimeError):
    """No live decode instance can take the request."""


@dataclass(frozen=True)
class Plan:
    """The routing decision for one request (P is picked later, per attempt)."""

    decode: Instance
    disaggregate: bool
    request: RoutingRequest  # what scorers see (prompt length, blocks, prefix matches)


class Planner:
    """Picks instances from the registry. Thread-safe (pickers only share a tie counter)."""

    def __init__(self, config: RouterConfig, registry: Registry,
                 prefix_matches: PrefixMatches = no_prefix_matches):
        self.config = config
        self.registry = registry
        self.prefix_matches = prefix_matches
        self.open_requests = OpenRequests()  # request flows hold their decode instance's count
        # Separate pickers, so that one kind of pick does not shift another's tie rotation.
        self.decode_picker = WeightedPicker.from_config(config.picker)
        self.prefill_picker = WeightedPicker.from_config(config.picker)
        self.pooling_picker = WeightedPicker.from_config(config.picker)

    def plan(self, prompt_ids: Sequence[int], n: int, cache_salt: str = "") -> Plan:
        """Pick D; disaggregate when n == 1, enough of the prompt is uncached on D and D runs
        enough requests already."""
        request = self.routing_request(prompt_ids, cache_salt)
        decode = self.pick_decode(request)
        if decode is None:
            raise NoDecodeInstance("no healthy decode instance")
        uncached = uncached_tokens(len(prompt_ids), request.prefix_matches.get(decode.id, 0),
                                   self.registry.block_size())
        disaggregate = n == 1 and should_disaggregate(
            uncached, self.config.disagg_threshold, self.decode_running(decode),
            self.config.disagg_min_running)
        return Plan(decode, disaggregate, request)

    def decode_running(self, decode: Instance) -> int:
        """Requests on `decode`: its last load report's, or this router's count if larger."""
        reported = decode.view.running_requests + decode.view.queued_requests
        return max(reported, self.open_requests.count(decode.id))

    def routing_request(self, prompt_ids: Sequence[int], cache_salt: str = "") -> RoutingRequest:
        """What scorers see of a prompt: its length, its blocks (hashed from the salt's root,
        as the instances hash them), who holds their prefix."""
        hashes = hash_blocks(prompt_ids, self.registry.block_size(), root_hash(cache_salt))
        matches = dict(self.prefix_matches(hashes)) if hashes else {}
        return RoutingRequest(len(prompt_ids), len(hashes), matches)

    def pick_pooling(self, request: RoutingRequest,
                     exclude: Collection[str] = ()) -> Instance | None:
        """Where an embedding is computed: the best live prefill instance (prompt compute
        stays off the decode instances, as disaggregation keeps it), else the best decode."""
        for role in ("prefill", "decode"):
            found = [i for i in self.registry.live(role) if i.id not in exclude]
            if found:
                return self._pick(self.pooling_picker, request, found)
        return None

    def pick_decode(self, request: RoutingRequest, exclude: Collection[str] = (),
                    connector: str = "") -> Instance | None:
        """Best live decode instance not in `exclude` (reading `connector`, when given)."""
        found = [i for i in self.registry.live("decode") if i.id not in exclude
                 and (not connector or i.connector == connector)]
        return self._pick(self.decode_picker, request, found)

    def pick_prefill(self, request: RoutingRequest, decode: Instance,
                     exclude: Collection[str] = ()) -> Instance | None:
        """Best live prefill instance not in `exclude` whose KV `decode` can read."""
        found = [i for i in self.registry.live("prefill") if i.id not in exclude
                 and i.id != decode.id and compatible(i, decode)]
        return self._pick(self.prefill_picker, request, found)

    @staticmethod
    def _pick(picker: WeightedPicker, request: RoutingRequest,
              found: list[Instance]) -> Instance | None:
        if not found:
            return None
        by_id = {i.id: i for i in found}
        return by_id[picker.pick(request, [i.view for i in found]).id]


def compatible(prefill: Instance, decode: Instance) -> bool:
    """A decode instance reads only handles of its own connector kind and block size."""
    same_blocks = not prefill.block_size or not decode.block_size \
        or prefill.block_size == decode.block_size
    return same_blocks and (not prefill.connector or not decode.connector
                            or prefill.connector == decode.connector)

"""Table-driven tests of the router's scorers, pickers and disaggregation rule."""

from __future__ import annotations

import pytest

from pdserve.router.picker import (
    NoCandidateError,
    PickerConfig,
    RoundRobinPicker,
    WeightedPicker,
    filter_role,
)
from pdserve.router.scorers import (
    InstanceView,
    KVUsageScorer,
    PrefixOverlapScorer,
    QueueScorer,
    RoutingRequest,
    should_disaggregate,
    uncached_tokens,
)

A, B, C = "a", "b", "c"


def views(**queued_tokens: int) -> list[InstanceView]:
    return [InstanceView(i, queued_tokens=q) for i, q in queued_tokens.items()]


@pytest.mark.parametrize("num_blocks, matches, want", [
    (4, {A: 4, B: 2}, {A: 1.0, B: 0.5, C: 0.0}),
    (4, {}, {A: 0.0, B: 0.0, C: 0.0}),
    (0, {A: 3}, {A: 0.0, B: 0.0, C: 0.0}),  # prompt shorter than a block
    (2, {A: 5}, {A: 1.0, B: 0.0, C: 0.0}),  # clamped to [0, 1]
])
def test_prefix_overlap(num_blocks: int, matches: dict, want: dict) -> None:
    request = RoutingRequest(num_blocks * 16, num_blocks, matches)
    assert PrefixOverlapScorer().score(request, views(a=0, b=0, c=0)) == want


@pytest.mark.parametrize("by, loads, want", [
    ("tokens", {A: 0, B: 50, C: 100}, {A: 1.0, B: 0.5, C: 0.0}),
    ("tokens", {A: 7, B: 7, C: 7}, {A: 1.0, B: 1.0, C: 1.0}),  # all equal: nobody penalised
    ("tokens", {A: 300}, {A: 1.0}),
    ("requests", {A: 1, B: 3, C: 2}, {A: 1.0, B: 0.0, C: 0.5}),
])
def test_queue(by: str, loads: dict, want: dict) -> None:
    cands = [InstanceView(i, queued_tokens=q, queued_requests=q) for i, q in loads.items()]
    assert QueueScorer(by).score(RoutingRequest(0, 0), cands) == want


def test_queue_rejects_unknown_measure() -> None:
    with pytest.raises(ValueError, match="by must be"):
        QueueScorer("bytes")


@pytest.mark.parametrize("free, total, want", [
    (100, 100, 1.0), (25, 100, 0.25), (0, 100, 0.0), (0, 0, 1.0),  # total 0: unknown, no penalty
])
def test_kv_usage(free: int, total: int, want: float) -> None:
    cand = InstanceView(A, free_blocks=free, total_blocks=total)
    assert KVUsageScorer().score(RoutingRequest(0, 0), [cand]) == {A: pytest.approx(want)}


@pytest.mark.parametrize("config, matches, loads, want", [
    # prefix 2 : queue 1: a full prefix hit outweighs the emptiest queue
    (PickerConfig(), {A: 4}, {A: 100, B: 0}, A),
    # ... but a small overlap does not
    (PickerConfig(), {A: 1}, {A: 100, B: 0}, B),
    (PickerConfig(prefix_weight=0.0), {A: 4}, {A: 100, B: 0}, B),  # load only
    (PickerConfig(queue_weight=0.0), {B: 2}, {A: 0, B: 100}, B),  # prefix only
    # equal scores: fewer queued tokens wins (queue weight 0 leaves the score tied)
    (PickerConfig(queue_weight=0.0), {A: 2, B: 2}, {A: 9, B: 3}, B),
])
def test_weighted_picker(config: PickerConfig, matches: dict, loads: dict, want: str) -> None:
    request = RoutingRequest(64, 4, matches)
    assert WeightedPicker.from_config(config).pick(request, views(**loads)).id == want


def test_weighted_scores_are_a_weighted_mean() -> None:
    picker = WeightedPicker([(PrefixOverlapScorer(), 3.0), (QueueScorer(), 1.0)])
    scores = picker.scores(RoutingRequest(64, 4, {A: 2}), views(a=10, b=0))
    assert scores == {A: pytest.approx((3 * 0.5 + 0) / 4), B: pytest.approx((0 + 1) / 4)}


def test_remaining_ties_rotate_in_id_order() -> None:
    picker = WeightedPicker.from_config(PickerConfig())
    idle = views(c=0, a=0, b=0)
    picks = [picker.pick(RoutingRequest(0, 0), idle).id for _ in range(4)]
    assert picks == [A, B, C, A]
    # a tie broken by queued requests does not rotate
    cands = [InstanceView(A, queued_requests=2), InstanceView(B, queued_requests=1)]
    assert {picker.pick(RoutingRequest(0, 0), cands).id for _ in range(3)} == {B}


def test_round_robin_cycles_by_id() -> None:
    picker = RoundRobinPicker()
    picks = [picker.pick(RoutingRequest(0, 0), views(b=5, a=0, c=9)).id for _ in range(4)]
    assert picks == [A, B, C, A]


@pytest.mark.parametrize("picker", [RoundRobinPicker(), WeightedPicker.from_config(PickerConfig())])
def test_no_candidates_is_a_clear_error(picker) -> None:
    with pytest.raises(NoCandidateError, match="no live instance"):
        picker.pick(RoutingRequest(0, 0), [])


@pytest.mark.parametrize("kwargs", [
    {"prefix_weight": -1.0}, {"prefix_weight": 0.0, "queue_weight": 0.0},
])
def test_picker_config_is_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="weights"):
        PickerConfig(**kwargs)


def test_filter_role_keeps_colocated() -> None:
    cands = [InstanceView(A, role="prefill"), InstanceView(B, role="decode"),
             InstanceView(C, role="both")]
    assert [c.id for c in filter_role(cands, "prefill")] == [A, C]
    assert [c.id for c in filter_role(cands, "decode")] == [B, C]


def test_instance_view_from_heartbeat_info() -> None:
    info = {"role": "decode", "address": "h:1", "queued_requests": 2, "queued_tokens": 300,
            "running_requests": 4, "free_blocks": 10, "total_blocks": 40, "extra": "ignored"}
    view = InstanceView.from_info(A, info)
    assert view == InstanceView(A, "decode", "h:1", 2, 300, 4, 10, 40)
    assert view.kv_usage == pytest.approx(0.75)


@pytest.mark.parametrize("uncached, threshold, want", [
    (0, 0, True), (511, 512, False), (512, 512, True), (4000, 512, True),
])
def test_should_disaggregate(uncached: int, threshold: int, want: bool) -> None:
    assert should_disaggregate(uncached, threshold) is want


def test_should_disaggregate_rejects_negative_threshold() -> None:
    with pytest.raises(ValueError, match="threshold"):
        should_disaggregate(10, -1)


@pytest.mark.parametrize("prompt, matched, block, want", [
    (100, 0, 16, 100), (100, 6, 16, 4), (96, 6, 16, 0), (10, 3, 16, 0),
])
def test_uncached_tokens(prompt: int, matched: int, block: int, want: int) -> None:
    assert uncached_tokens(prompt, matched, block) == want

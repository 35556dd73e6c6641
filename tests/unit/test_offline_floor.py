"""benchmarks/offline_floor.py's accounting: what one engine step costs at best."""

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# hidden 4, 2 heads of 2 (1 KV head), MLP 8, 3 layers, vocabulary 10
_CFG = {"hidden_size": 4, "intermediate_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 10}


@pytest.fixture(scope="module")
def floor_module():
    sys.path.insert(0, str(_BENCHMARKS))  # it imports offline_worker beside it
    try:
        spec = importlib.util.spec_from_file_location("offline_floor",
                                                      _BENCHMARKS / "offline_floor.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks itself up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_BENCHMARKS))
    return module


def test_projection_shapes_are_every_layers_qkv_o_gate_up_down(floor_module):
    one_layer = [(4 + 2 * 2, 4), (4, 4), (16, 4), (4, 8)]
    assert floor_module.projection_shapes(_CFG) == one_layer * 3


def test_a_decode_step_reads_each_context_once_and_is_bound_by_arithmetic(floor_module):
    floor = floor_module.Floor.of(_CFG, flops_per_s=1e3, bytes_per_s=1e4)
    params = 3 * (8 * 4 + 4 * 4 + 16 * 4 + 4 * 8)
    assert (floor.params, floor.head_params) == (params, 40)
    step = floor.step([(9, 1, True), (19, 1, True)])  # decodes at positions 9 and 19
    assert step["matmul_s"] == pytest.approx(2 * (2 * params + 2 * 40) / 1e3)
    # 10 + 20 positions x 1 KV head x 2 values x (K and V) x 4 bytes x 3 layers
    assert step["decode_attention_s"] == pytest.approx((10 + 20) * 2 * 2 * 4 * 3 / 1e4)
    assert step["prompt_attention_s"] == 0


def test_a_prompt_chunk_attends_causally_and_a_small_step_streams_its_weights(floor_module):
    floor = floor_module.Floor.of(_CFG, flops_per_s=1e12, bytes_per_s=1e4)
    start, n = 5, 4  # a chunk of 4 prompt tokens after 5 computed ones
    step = floor.step([(start, n, False)])
    seen = sum(start + i + 1 for i in range(n))  # query at position p sees p + 1 keys
    # scores and weighted values: 2 products x 2 FLOP x 2 heads x head size 2 x 3 layers
    assert step["prompt_attention_s"] == pytest.approx(seen * 4 * 2 * 2 * 3 / 1e12)
    assert step["decode_attention_s"] == 0
    # at this rate arithmetic is nothing: the projections' weights (no LM head: no sample)
    assert step["matmul_s"] == pytest.approx(4 * floor.params / 1e4)

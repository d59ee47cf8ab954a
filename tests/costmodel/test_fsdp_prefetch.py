"""fsdp_prefetch_choice: the depth FSDP's prefetch="auto" takes, and the schedule behind it."""

import math

import pytest

from overlapkit.costmodel import ConfigError, fsdp_prefetch_choice
from overlapkit.costmodel.fsdp import prefetch_wall_ms


def test_depth_zero_exposes_every_gather_and_depth_one_hides_all_but_the_first():
    assert prefetch_wall_ms(5.0, 3.0, 0, num_layers=8) == pytest.approx(8 * (5 + 3))
    assert prefetch_wall_ms(5.0, 3.0, 1, num_layers=8) == pytest.approx(3 + 8 * 5)


def test_gathers_shorter_than_compute_need_depth_one():
    depth, why = fsdp_prefetch_choice(5.0, 3.0, 1e8, None)
    assert depth == 1 and "depth 1" in why


def test_reduce_scatters_on_the_same_stream_push_the_depth_up():
    # 3 ms gather + 3 ms reduce-scatter per 5 ms layer: depth 1 leaves the next gather queued
    # behind the reduce-scatter; depth 2 issues it a layer earlier.
    assert prefetch_wall_ms(5.0, 3.0, 2, reduce_ms=3.0) < prefetch_wall_ms(5.0, 3.0, 1, reduce_ms=3.0)
    assert fsdp_prefetch_choice(5.0, 3.0, 1e8, None, reduce_ms=3.0)[0] == 2


def test_memory_budget_caps_the_depth():
    assert fsdp_prefetch_choice(5.0, 3.0, 1e8, None, reduce_ms=3.0)[0] == 2
    depth, why = fsdp_prefetch_choice(5.0, 3.0, 1e8, 1.5e8, reduce_ms=3.0)
    assert depth == 1 and "memory allows 1" in why
    depth, why = fsdp_prefetch_choice(5.0, 3.0, 1e8, 5e7)
    assert depth == 0 and "memory budget" in why


def test_no_gather_needs_no_prefetch():
    assert fsdp_prefetch_choice(5.0, 0.0, 1e8, None)[0] == 0


@pytest.mark.parametrize("kw,field", [({"gather_ms": math.inf}, "gather_ms"),
                                      ({"layer_compute_ms": -1.0}, "layer_compute_ms"),
                                      ({"memory_budget_bytes": math.nan}, "memory_budget_bytes")])
def test_bad_inputs_name_the_field(kw, field):
    args = dict(layer_compute_ms=5.0, gather_ms=3.0, param_bytes_per_layer=1e8, memory_budget_bytes=None) | kw
    with pytest.raises(ConfigError, match=field):
        fsdp_prefetch_choice(**args)
